"""Decode throughput against HF `generate` (PyTorch, KV cache) side by side, and eval throughput.

A random-init model of `--preset` (default `small`, the demo's shape) generates `--new-tokens`
(256) greedy tokens after a `--prompt-tokens` (16) prompt, batch 1, on three paths in one run:

- this project's `Generator` with its KV cache (jit-compiled, in-place cache; the headline),
- HF transformers `LlamaForCausalLM.generate` on PyTorch eager with its cache (`use_cache=True`),
  the same weights (converted with model/convert.py), 2 threads, in its own process
  (`--no-hf` skips it; needs the `reference` extra: torch, transformers),
- the same `Generator` recomputing the full forward each step (jit, 32-token buckets): the
  secondary `kv_speedup` field only (that path is already compiled and bucketed).

Compilation / warm-up happen before the clock starts on every path. Decode speed is also given
as a fraction of this machine's memory-bandwidth limit: bytes of matmul weights read per token
(every projection and the LM head, fp32) against the bytes/s of a large fp32 GEMV measured
here with numpy (`gemv_gb_per_s`). Then `MindSporeLM._loglikelihood_tokens` scores `--requests`
synthetic (context, continuation) pairs shaped like multiple-choice requests (context 20–100
tokens, continuation 1–12) with `--batch-size`, after one warm-up pass. Prints one JSON line.

    python scripts/bench/generate.py [--preset small] [--new-tokens 256] [--requests 256]
    python scripts/bench/generate.py --preset tiny --new-tokens 16 --requests 16     # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def gemv_bytes_per_s(rows: int = 8192, cols: int = 8192, repeats: int = 5) -> float:
    """Memory bandwidth as a large fp32 GEMV streams it: matrix bytes / best time (numpy's BLAS, all cores)."""
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((rows, cols), dtype=np.float32)
    v = rng.standard_normal(cols, dtype=np.float32)
    a @ v  # warm up (pages touched, BLAS threads started)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ v
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best


def weight_bytes_per_token(cfg) -> int:
    """fp32 bytes of the weights one decode step multiplies by: every projection and the LM head."""
    h, kv, f = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    return 4 * (cfg.num_layers * per_layer + cfg.vocab_size * h)


def _hf_side(a: argparse.Namespace) -> dict:
    """HF LlamaForCausalLM.generate (greedy, use_cache=True) on the weights in a.weights."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import ModelConfig
    from model.convert import config_to_hf

    torch.set_num_threads(2)
    cfg = ModelConfig.from_name(a.preset)
    hf_cfg = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation="eager"))
    missing, unexpected = model.load_state_dict(load_file(a.weights), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"HF side: weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    prompt = torch.tensor([json.loads(a.prompt)], dtype=torch.long)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
        dt = time.perf_counter() - t0
    new = out[0, prompt.shape[1]:].tolist()
    return {"tokens_per_s": len(new) / dt, "tokens": new}


def _run_hf(a: argparse.Namespace, net, prompt: list[int]) -> dict:
    from safetensors.numpy import save_file

    from model.convert import native_to_hf

    with tempfile.TemporaryDirectory() as tmp:
        weights = os.path.join(tmp, "weights.safetensors")
        save_file(native_to_hf({p.name: p.asnumpy() for p in net.get_parameters()}, net.config), weights)
        env = dict(os.environ, OMP_NUM_THREADS="2", GLOG_v="3")
        out = subprocess.run([sys.executable, __file__, "--side", "hf", "--preset", a.preset, "--weights", weights,
                              "--prompt", json.dumps(prompt), "--new-tokens", str(a.new_tokens)],
                             capture_output=True, text=True, env=env)
    if out.returncode:
        raise SystemExit(f"the HF side failed (exit {out.returncode}); install the `reference` extra or pass "
                         f"--no-hf:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers / PyTorch baseline")
    ap.add_argument("--side", choices=["hf"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "hf":
        print(json.dumps(_hf_side(a)))
        return

    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.generate import Generator
    from model.llama import LlamaForCausalLM
    from tasks.stages.evaluate.lm_adapter import MindSporeLM

    cfg = ModelConfig.from_name(a.preset)
    if a.prompt_tokens + a.new_tokens > cfg.max_seq_length:
        raise SystemExit(f"prompt + new tokens ({a.prompt_tokens + a.new_tokens}) exceed {a.preset}'s "
                         f"max_seq_length {cfg.max_seq_length}")
    net = LlamaForCausalLM(cfg, seed=0)
    net.set_train(False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt_tokens)]
    gen = Generator(net)

    res: dict = {"bench": "generate", "preset": a.preset, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
                 "batch": 1}
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing and not a.no_hf:
        res["hf_skipped"] = f"{', '.join(missing)} not installed (the `reference` extra)"
    hf = None if a.no_hf or missing else _run_hf(a, net, prompt)
    tokens = {}
    for name, cached in (("cached", True), ("uncached", False)):
        t0 = time.perf_counter()
        gen.compile(len(prompt), a.new_tokens, use_cache=cached)
        res[f"{name}_compile_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        tokens[name] = gen.generate(prompt, a.new_tokens, use_cache=cached)  # no eos: always the full length
        dt = time.perf_counter() - t0
        res[f"{name}_tokens_per_s"] = round(len(tokens[name]) / dt, 2)
    tps = res["cached_tokens_per_s"]
    bw = gemv_bytes_per_s()
    per_token = weight_bytes_per_token(cfg)
    limit = bw / per_token
    if hf is not None:
        same = next((i for i, (x, y) in enumerate(zip(tokens["cached"], hf["tokens"])) if x != y), len(hf["tokens"]))
        res.update(speedup_vs_hf=round(tps / hf["tokens_per_s"], 2), tokens_per_s=tps,
                   hf_tokens_per_s=round(hf["tokens_per_s"], 2), hf_same_tokens_prefix=same)
    else:
        res["tokens_per_s"] = tps
    res.update(decode_ms_per_token=round(1000 / tps, 2), gemv_gb_per_s=round(bw / 1e9, 1),
               weight_mb_per_token=round(per_token / 1e6, 1), bandwidth_limit_tokens_per_s=round(limit, 1),
               fraction_of_bandwidth_limit=round(tps / limit, 3))
    if hf is not None:
        res["hf_fraction_of_bandwidth_limit"] = round(hf["tokens_per_s"] / limit, 3)
    res["kv_speedup"] = round(tps / res["uncached_tokens_per_s"], 2)  # secondary: vs our own uncached path
    res["same_tokens"] = tokens["cached"] == tokens["uncached"]

    lm = MindSporeLM(net=net, tokenizer=None, eot_token_id=2, batch_size=a.batch_size, progress=False)
    reqs = [(None, [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(20, 101)))],
             [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(1, 13)))]) for _ in range(a.requests)]
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)  # warm-up: compiles each length bucket
    res["eval_compile_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)
    dt = time.perf_counter() - t0
    n_tok = sum(min(len(c) + len(x), lm.max_length + 1) - 1 for _, c, x in reqs)
    res.update(eval_requests_per_s=round(a.requests / dt, 2), eval_tokens_per_s=round(n_tok / dt, 1),
               eval_batch_size=a.batch_size, eval_shapes=sorted(lm.scorer.shapes_compiled))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
