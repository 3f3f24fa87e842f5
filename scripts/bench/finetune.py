"""LoRA versus full fine-tuning: step time, peak memory and trainable parameters. Prints one JSON line.

Same model (`small` preset by default: ~21M parameters, vocab 4096), same batch
(micro batch 8 × seq 128, random tokens), the same compiled train step and AdamW
as `tasks.training.trainer.fit`; LoRA on q_proj,v_proj (rank 8, alpha 16) versus every
weight trainable, and the reference: HF LlamaForCausalLM (sdpa) on PyTorch with the same LoRA (frozen base
projections plus scale · B(A x), B zero at the start, as peft; peft itself is not in the lock), the same batch,
clip 1.0 and AdamW over the adapters (`hf_lora`; `lora_vs_hf_lora` holds the ratios). Each variant runs in its own
process, one after the other, so its peak RSS is its own (MindSpore keeps graph memory for the life of a process).

    python scripts/bench/finetune.py [--preset small] [--steps 10] [--warmup 2] [--batch 8] [--seq 128]
    python scripts/bench/finetune.py --preset tiny --steps 2 --warmup 1     # a smoke run (seconds)
    python scripts/bench/finetune.py --preset smollm2-135m --batch 2 --seq 128 --steps 4 --layerwise   # + LoRA one
        layer at a time (`lora_layerwise`), at the issue-33 shape
    python scripts/bench/finetune.py --preset llama-3.2-1b --batch 2 --seq 128 --steps 3 --variants lora,hf_lora \
        --layerwise      # Llama-3.2-1B's shape: no full fine-tuning (its AdamW state alone is 15 GB)

The line is labelled with the CPU and ISA (scripts/bench/host.py) and appended to docs/bench/results.jsonl
(`--results`, `--tag`; scripts/bench/report.py writes docs/BENCHMARKS.md). Output fields per variant: trainable_params,
trainable_share, step_s (mean over
`steps` after `warmup` steps, compile excluded), tokens_per_s, first_step_s
(compile + one step), peak_rss_bytes (whole process) and rss_before_train_bytes
(model built, nothing compiled); `lora_vs_full` holds the ratios.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from host import describe  # noqa: E402
from report import add_record_args, record  # noqa: E402


def _rss() -> int:
    from tasks.training.hardware import peak_rss_bytes

    return peak_rss_bytes()


def run_variant(
    variant: str, preset: str, steps: int, warmup: int, batch: int, seq: int, rank: int, targets: str
) -> dict:
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore(seed=0, host_blocking=True)  # as the trainer
    from model.config import ModelConfig
    from model.lora import inject_lora, mark_only_lora_trainable, trainable_summary
    from tasks.modeling.build import build_network
    from tasks.training.layerwise import causal_lm_train_step

    cfg = ModelConfig.from_name(preset)
    seq = min(seq, cfg.max_seq_length)
    built = build_network("llama", cfg, seed=0, fused_kernels=True)  # as the trainer builds it (train.fused_kernels)
    net = built.net
    if variant.startswith("lora"):
        inject_lora(net, targets, rank=rank, alpha=2.0 * rank)
        params = mark_only_lora_trainable(net)
    else:
        params = net.trainable_params()
    summary = trainable_summary(net)
    step = causal_lm_train_step(
        net, params, weight_decay=0.0, in_place=built.kernels.optimizer, layerwise=variant == "lora_layerwise"
    )
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, seq + 1)).astype(np.int32)
    micro = [(ids[:, :-1], ids[:, 1:])]
    steps_done = iter(range(1, 1 << 30))
    return {
        "step": type(step).__name__,
        "trainable_params": summary.trainable,
        "total_params": summary.total,
        "trainable_share": round(summary.share, 6),
        **_timed(lambda: step(micro, 1e-4, next(steps_done))[0], steps, warmup, batch * seq),
    }


def _timed(one, steps: int, warmup: int, tokens: int) -> dict:
    """The first call of `one()` (a step returning its loss: compilation included), `warmup - 1` more, then `steps`
    timed; peak RSS before and after."""
    rss_before = _rss()
    t0 = time.perf_counter()
    first_loss = loss = one()
    first_step_s = time.perf_counter() - t0
    for _ in range(1, warmup):
        one()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = one()
    dt = (time.perf_counter() - t0) / max(steps, 1)
    return {
        "step_s": round(dt, 4),
        "tokens_per_s": round(tokens / dt, 1),
        "first_step_s": round(first_step_s, 2),
        "peak_rss_bytes": _rss(),
        "rss_before_train_bytes": rss_before,
        "first_loss": round(first_loss, 4),
        "last_loss": round(loss, 4),
    }


def run_hf_lora(preset: str, steps: int, warmup: int, batch: int, seq: int, rank: int, targets: str) -> dict:
    """The reference: HF LLaMA (sdpa) with LoRA on `targets` written as peft does it (the base frozen, scale · B(A x)
    added, B zero at the start), AdamW over the adapters, clip 1.0; timed as `run_variant`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import ModelConfig
    from model.convert import config_to_hf

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "0")) or torch.get_num_threads())
    torch.manual_seed(0)
    cfg = ModelConfig.from_name(preset)
    seq = min(seq, cfg.max_seq_length)
    hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa"))
    model.requires_grad_(False)

    class LoRALinear(torch.nn.Module):
        def __init__(self, base: torch.nn.Linear):
            super().__init__()
            self.base, self.scale = base, 2.0  # alpha / rank, alpha = 2 · rank as run_variant
            bound = 1.0 / base.in_features**0.5  # as model/lora.py and peft: kaiming-uniform A
            self.a = torch.nn.Parameter(torch.empty(rank, base.in_features).uniform_(-bound, bound))
            self.b = torch.nn.Parameter(torch.zeros(base.out_features, rank))

        def forward(self, x):
            return self.base(x) + (x @ self.a.t() @ self.b.t()) * self.scale

    names = set(targets.split(","))
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if name in names and isinstance(child, torch.nn.Linear):
                setattr(module, name, LoRALinear(child))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1], ids[:, 1:]

    def one() -> float:
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return float(loss.detach())

    trainable, total = sum(p.numel() for p in params), sum(p.numel() for p in model.parameters())
    return {
        "trainable_params": trainable,
        "total_params": total,
        "trainable_share": round(trainable / total, 6),
        **_timed(one, steps, warmup, batch * seq),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="steps before timing (the first one compiles)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--threads", type=int, default=2, help="threads of every variant (OMP_NUM_THREADS, torch)")
    ap.add_argument(
        "--layerwise",
        action="store_true",
        help="also LoRA one decoder layer at a time (train.layerwise: true), as `lora_layerwise`",
    )
    ap.add_argument(
        "--variants",
        default="lora,full,hf_lora",
        help="which to run, comma-separated, of lora, full, hf_lora, lora_layerwise (--layerwise adds the last); "
        "at 1B full fine-tuning's AdamW state alone (12 bytes a weight) outgrows a 24 GB machine: leave it out",
    )
    ap.add_argument(
        "--variant", choices=["lora", "full", "hf_lora", "lora_layerwise"], help=argparse.SUPPRESS
    )  # the per-variant child
    add_record_args(ap)
    a = ap.parse_args(argv)
    knobs = dict(
        preset=a.preset,
        steps=a.steps,
        warmup=max(1, a.warmup),
        batch=a.batch,
        seq=a.seq,
        rank=a.rank,
        targets=a.targets,
    )
    if a.variant:
        print(json.dumps(run_hf_lora(**knobs) if a.variant == "hf_lora" else run_variant(a.variant, **knobs)))
        return 0
    out = {"bench": "finetune", **describe(threads=a.threads), **knobs}
    env = dict(os.environ, GLOG_v=os.environ.get("GLOG_v", "3"), OMP_NUM_THREADS=str(a.threads))
    variants = [v for v in a.variants.split(",") if v] + (["lora_layerwise"] if a.layerwise else [])
    if unknown := set(variants) - {"lora", "full", "hf_lora", "lora_layerwise"}:
        ap.error(f"--variants: unknown {sorted(unknown)}")
    for variant in dict.fromkeys(variants):
        cmd = [sys.executable, __file__, "--variant", variant] + [f"--{k}={v}" for k, v in knobs.items()]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            print(proc.stdout + proc.stderr, file=sys.stderr)
            raise SystemExit(f"{variant} run failed with exit code {proc.returncode}")
        out[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    lo, fu, ref, lw = (out.get(v) for v in ("lora", "full", "hf_lora", "lora_layerwise"))
    for v in (lo, fu, ref, lw):
        if v:
            v["peak_rss_gb"] = round(v["peak_rss_bytes"] / 1e9, 3)
    if lo and fu:
        out["lora_vs_full"] = {
            "step_time": round(lo["step_s"] / fu["step_s"], 3),
            "peak_rss": round(lo["peak_rss_bytes"] / fu["peak_rss_bytes"], 3),
            "trainable_params": round(lo["trainable_params"] / fu["trainable_params"], 6),
        }
    if lo and ref:
        out["lora_vs_hf_lora"] = {
            "speed": round(ref["step_s"] / lo["step_s"], 3),
            "peak_rss": round(lo["peak_rss_bytes"] / ref["peak_rss_bytes"], 3),
            "trainable_params": round(lo["trainable_params"] / ref["trainable_params"], 6),
        }
    if lw and ref:
        out["lora_layerwise_vs_hf_lora"] = {
            "speed": round(ref["step_s"] / lw["step_s"], 3),
            "peak_rss": round(lw["peak_rss_bytes"] / ref["peak_rss_bytes"], 3),
        }
    record(out, a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
