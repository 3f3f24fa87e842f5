"""Train-step throughput: this trainer (MindSpore, jit) vs HF transformers LlamaForCausalLM on PyTorch eager.

Identical shapes (`tiny-llama-bench`: vocab 8192, hidden 256, ffn 688, 4 layers, 8 heads, 4 KV heads),
fp32, micro batch 8, seq 256, AdamW, global-norm clip 1.0. Each side runs in its own process
(so peak RSS is its own), one after the other, with 2 threads. Prints one JSON line.

    python scripts/bench/train.py [--steps 10] [--warmup 3]
Needs the `reference` extra (torch==2.13.0 CPU, transformers) for the baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.training.trainer import peak_rss_bytes  # noqa: E402  (after the sys.path insert)

PRESET, BATCH, SEQ = "tiny-llama-bench", 8, 256


def _ms(steps: int, warmup: int) -> dict:
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.training.optim import causal_lm_train_step
    from tasks.training.trainer import measure_peak_flops

    cfg = ModelConfig.from_name(PRESET)
    net = LlamaForCausalLM(cfg, seed=0)
    step = causal_lm_train_step(net, net.trainable_params())
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    batch = [(ids[:, :-1], ids[:, 1:])]
    for s in range(warmup):
        step(batch, 1e-4, s + 1)
    t0 = time.perf_counter()
    for s in range(steps):
        loss = step(batch, 1e-4, warmup + s + 1)[0]
    dt = time.perf_counter() - t0
    return {"tokens_per_s": steps * BATCH * SEQ / dt, "peak_rss_bytes": peak_rss_bytes(),
            "flops_per_token": cfg.flops_per_token(SEQ), "peak_flops": measure_peak_flops(), "loss": loss,
            "step_s": dt / steps}


def _torch(steps: int, warmup: int) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    from model.config import ModelConfig

    c = ModelConfig.from_name(PRESET)
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     max_position_embeddings=c.max_seq_length, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                     tie_word_embeddings=c.tie_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, c.vocab_size, (BATCH, SEQ + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def one():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    for _ in range(warmup):
        one()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = one()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": steps * BATCH * SEQ / dt, "peak_rss_bytes": peak_rss_bytes(),
            "loss": loss, "step_s": dt / steps}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--side", choices=["ms", "torch"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        print(json.dumps((_ms if a.side == "ms" else _torch)(a.steps, a.warmup)))
        return
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="2")
    res = {}
    for side in ("ms", "torch"):
        out = subprocess.run([sys.executable, __file__, "--side", side, "--steps", str(a.steps), "--warmup", str(a.warmup)],
                             capture_output=True, text=True, env=env, check=True)
        res[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ms_, pt = res["ms"], res["torch"]
    fpt, peak = ms_["flops_per_token"], ms_["peak_flops"]
    print(json.dumps({
        "bench": "train", "preset": PRESET, "batch": BATCH, "seq": SEQ, "steps": a.steps,
        "tokens_per_s": round(ms_["tokens_per_s"], 1), "baseline_tokens_per_s": round(pt["tokens_per_s"], 1),
        "ratio": round(ms_["tokens_per_s"] / pt["tokens_per_s"], 3),
        "mfu": round(ms_["tokens_per_s"] * fpt / peak, 4), "baseline_mfu": round(pt["tokens_per_s"] * fpt / peak, 4),
        "peak_flops": round(peak / 1e9, 1), "peak_rss_gb": round(ms_["peak_rss_bytes"] / 1e9, 2),
        "baseline_peak_rss_gb": round(pt["peak_rss_bytes"] / 1e9, 2),
        "step_s": round(ms_["step_s"], 3), "baseline_step_s": round(pt["step_s"], 3),
    }))


if __name__ == "__main__":
    main()
