"""Train-step throughput: this trainer (MindSpore, jit) vs HF transformers LlamaForCausalLM on PyTorch eager.

Identical shapes (`tiny-llama-bench`: vocab 8192, hidden 256, ffn 688, 4 layers, 8 heads, 4 KV heads),
fp32, micro batch 8, seq 256, AdamW, global-norm clip 1.0. Each side runs in its own process
(so peak RSS is its own), one after the other, with 2 threads. Prints one JSON line.

MFU of both sides divides by the same theoretical fp32 peak of this machine
(`tasks.training.trainer.resolve_peak_flops`: cores × clock × FLOPs/cycle); a measured 2048³ MatMul
through MindSpore's kernel is printed beside it (`sgemm_gflops`, the achievable peak; a busy machine
under-measures it, so it is a denominator only if it exceeds the theoretical peak).

    python scripts/bench/train.py [--steps 10] [--warmup 3]
    python scripts/bench/train.py --preset small --batch 8 --seq 256      # the demo's model
    python scripts/bench/train.py --profile /tmp/prof [--steps 3]         # MindSpore side only:
        MindSpore's Profiler over `--steps` steps; one JSON line with the time by op category
        (MatMul, BatchMatMul, reductions, element-wise, softmax kernels, data movement,
        optimizer, fused kernels, host gaps) and the top ops with their shapes.
    python scripts/bench/train.py --no-fused                             # MindSpore's own ops only
Needs the `reference` extra (torch==2.13.0 CPU, transformers) for the baseline.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tasks.training.trainer import peak_rss_bytes  # noqa: E402  (after the sys.path insert)

PRESET, BATCH, SEQ = "tiny-llama-bench", 8, 256


def _ms(a: argparse.Namespace) -> dict:
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.training.optim import causal_lm_train_step

    cfg = ModelConfig.from_name(a.preset)
    net = LlamaForCausalLM(cfg, seed=0, fused_kernels=not a.no_fused)  # as the trainer (pretrain.fused_kernels)
    step = causal_lm_train_step(net, net.trainable_params(), fused=not a.no_fused)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.seq + 1)).astype(np.int32)
    batch = [(ids[:, :-1], ids[:, 1:])]
    for s in range(a.warmup):
        step(batch, 1e-4, s + 1)
    prof = None
    if a.profile:
        from mindspore.profiler import Profiler

        prof = Profiler(output_path=a.profile)
    t0 = time.perf_counter()
    for s in range(a.steps):
        loss = step(batch, 1e-4, a.warmup + s + 1)[0]
    dt = time.perf_counter() - t0
    res = {"tokens_per_s": a.steps * a.batch * a.seq / dt, "peak_rss_bytes": peak_rss_bytes(),
           "fused_kernels": net.fused_kernels,
           "flops_per_token": cfg.flops_per_token(a.seq), "loss": loss, "step_s": dt / a.steps}
    if prof is not None:
        prof.analyse()
        res["profile"] = profile_breakdown(a.profile, a.steps, dt / a.steps)
    return res


def _torch(a: argparse.Namespace) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(2)
    torch.manual_seed(0)
    from model.config import ModelConfig

    c = ModelConfig.from_name(a.preset)
    hf = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
                     max_position_embeddings=c.max_seq_length, rope_theta=c.rope_theta, rms_norm_eps=c.norm_eps,
                     tie_word_embeddings=c.tie_embeddings, attn_implementation="eager")
    model = LlamaForCausalLM(hf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, c.vocab_size, (a.batch, a.seq + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def one():
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss)

    for _ in range(a.warmup):
        one()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        loss = one()
    dt = time.perf_counter() - t0
    return {"tokens_per_s": a.steps * a.batch * a.seq / dt, "peak_rss_bytes": peak_rss_bytes(),
            "loss": loss, "step_s": dt / a.steps}


# ---- profile breakdown ------------------------------------------------------------------------

_MATMUL = {"MatMul", "MatMulExt", "Dense"}
_BATCHMATMUL = {"BatchMatMul", "BatchMatMulExt"}
_SOFTMAX = {"Softmax", "SoftmaxGrad", "LogSoftmax", "LogSoftmaxGrad"}
_MOVEMENT = {"Transpose", "Concat", "Split", "Slice", "StridedSlice", "Tile", "Reshape", "BroadcastTo", "Gather",
             "GatherD", "GatherDGradV2", "UnsortedSegmentSum", "TensorScatterAdd", "ScatterNd", "Cast", "Stack"}
_OPTIMIZER = {"AdamWeightDecay", "Adam", "ApplyAdam"}


def _category(op: str, scope: str, after_backward: bool, shapes: str) -> str:
    if op in _OPTIMIZER or after_backward:
        return "optimizer"
    if op.startswith("Custom"):
        return "fused kernels"  # model/train_kernels.cc: causal softmax, SwiGLU, RMSNorm and their backward
    if op in _MATMUL:
        return "MatMul"
    if op in _BATCHMATMUL:
        return "BatchMatMul"
    if op.startswith(("Reduce", "ArgMax", "ArgMin")) or op in {"SumExt", "MeanExt"}:
        if "TupleShape()" in shapes and not scope.startswith("Gradients"):
            return "optimizer"  # full reductions to a scalar of a parameter-sized tensor: the gradient norm
        return "reductions"
    if op in _SOFTMAX:
        return "softmax kernels"
    if op in _MOVEMENT:
        return "data movement"
    return "element-wise"


def profile_breakdown(out_dir: str, steps: int, step_wall_s: float, top: int = 12) -> dict:
    """Time per step by op category from a MindSpore CPU profile (FRAMEWORK/cpu_op_execute_timestamp_0.txt
    and cpu_framework_0.txt, matched in execution order), plus host gaps = step wall time − op time.

    `optimizer` is AdamWeightDecay, every op that runs after the step's last gradient op (clip,
    bias correction) and the full reductions of the gradient norm.
    """
    d = sorted(glob.glob(os.path.join(out_dir, "*", "FRAMEWORK")))[-1]
    framework = [line.strip().split(";") for line in open(os.path.join(d, "cpu_framework_0.txt")) if line.strip()]
    events = []
    for line in open(os.path.join(d, "cpu_op_execute_timestamp_0.txt")):
        name, _, rest = line.strip().split(";", 2)
        for e in rest.split():
            t, dur, _ = e.split(",")
            events.append((int(t), float(dur), name))
    events.sort()
    if len(events) != len(framework) or len(events) % steps:
        raise SystemExit(f"profile in {d}: {len(events)} op events vs {len(framework)} op records for {steps} steps")
    per = len(events) // steps
    by_cat: collections.Counter = collections.Counter()
    by_op: collections.Counter = collections.Counter()
    for s in range(steps):
        ev, fw = events[s * per:(s + 1) * per], framework[s * per:(s + 1) * per]
        last_grad = max((i for i, e in enumerate(ev) if e[2].startswith(("Gradients", "Expand/_Softmax"))), default=per)
        for i, ((_, dur, name), rec) in enumerate(zip(ev, fw)):
            op = rec[0]
            shapes = " ".join(p.split(":", 1)[1] for p in rec[3:] if ":" in p and "NoShape" not in p)
            scope = name
            by_cat[_category(op, scope, i > last_grad, shapes)] += dur / steps
            kind = "bwd" if name.startswith(("Gradients", "Expand/_Softmax")) else "fwd"
            by_op[f"{op} {kind} {shapes}"] += dur / steps
    op_ms = sum(by_cat.values())
    wall_ms = step_wall_s * 1e3
    by_cat["host gaps"] = max(0.0, wall_ms - op_ms)
    return {"step_ms": round(wall_ms, 1), "op_ms": round(op_ms, 1),
            "categories_ms": {k: round(v, 1) for k, v in by_cat.most_common()},
            "categories_share": {k: round(v / wall_ms, 3) for k, v in by_cat.most_common()},
            "top_ops_ms": {k: round(v, 2) for k, v in by_op.most_common(top)}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--batch", type=int, default=BATCH)
    ap.add_argument("--seq", type=int, default=SEQ)
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="profile the MindSpore side into DIR and print its breakdown (no baseline)")
    ap.add_argument("--no-fused", action="store_true",
                    help="MindSpore's own ops only (pretrain.fused_kernels: false; a machine without g++)")
    ap.add_argument("--side", choices=["ms", "torch"], default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side:
        print(json.dumps((_ms if a.side == "ms" else _torch)(a)))
        return
    env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS="2")
    common = ["--steps", str(a.steps), "--warmup", str(a.warmup), "--preset", a.preset, "--batch", str(a.batch),
              "--seq", str(a.seq), *(["--no-fused"] if a.no_fused else [])]

    def side(name: str, extra: list[str] = ()) -> dict:
        out = subprocess.run([sys.executable, __file__, "--side", name, *common, *extra],
                             capture_output=True, text=True, env=env)
        if out.returncode:
            raise SystemExit(f"the {name} side failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])

    if a.profile:
        ms_ = side("ms", ["--profile", os.path.abspath(a.profile)])
        print(json.dumps({"bench": "train_profile", "preset": a.preset, "batch": a.batch, "seq": a.seq,
                          "steps": a.steps, "tokens_per_s": round(ms_["tokens_per_s"], 1), **ms_["profile"]}))
        return
    res = {name: side(name) for name in ("ms", "torch")}
    os.environ["OMP_NUM_THREADS"] = "2"  # the theoretical peak counts the cores both sides use
    from tasks.training.trainer import resolve_peak_flops

    from model.runtime import setup_mindspore

    setup_mindspore()  # the measured sgemm runs through MindSpore's MatMul
    peak = resolve_peak_flops()
    ms_, pt = res["ms"], res["torch"]
    fpt = ms_["flops_per_token"]
    achievable = peak.achievable or peak.flops
    print(json.dumps({
        "bench": "train", "preset": a.preset, "batch": a.batch, "seq": a.seq, "steps": a.steps,
        "fused_kernels": ms_["fused_kernels"],
        "tokens_per_s": round(ms_["tokens_per_s"], 1), "baseline_tokens_per_s": round(pt["tokens_per_s"], 1),
        "ratio": round(ms_["tokens_per_s"] / pt["tokens_per_s"], 3),
        "mfu": round(ms_["tokens_per_s"] * fpt / peak.flops, 4),
        "baseline_mfu": round(pt["tokens_per_s"] * fpt / peak.flops, 4),
        "peak_gflops": round(peak.flops / 1e9, 1), "peak_how": peak.how,
        "sgemm_gflops": round(achievable / 1e9, 1),
        "peak_rss_gb": round(ms_["peak_rss_bytes"] / 1e9, 2),
        "baseline_peak_rss_gb": round(pt["peak_rss_bytes"] / 1e9, 2),
        "rss_ratio": round(ms_["peak_rss_bytes"] / pt["peak_rss_bytes"], 2),
        "step_s": round(ms_["step_s"], 3), "baseline_step_s": round(pt["step_s"], 3),
        "loss": round(ms_["loss"], 4), "baseline_loss": round(pt["loss"], 4),
    }))


if __name__ == "__main__":
    main()
