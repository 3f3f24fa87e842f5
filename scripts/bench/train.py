"""Train-step throughput: this trainer (MindSpore, jit) vs HF transformers LlamaForCausalLM on PyTorch, one run.

Identical shapes (default `tiny-llama-bench`: vocab 8192, hidden 256, ffn 688, 4 layers, 8 heads, 4 KV
heads, micro batch 8 × seq 256; `smollm2-135m`: micro batch 2 × seq 128), fp32, AdamW, global-norm clip
1.0, the same step on every side: forward, loss, backward, clip, AdamW. Each side runs in its own process
(so peak RSS is its own), one after the other (`--rounds N`: all alive, timed in turn N times), with `--threads`
(2) threads:

- `ms`: this trainer's whole-model step (`causal_lm_train_step`, `train.layerwise: false`; fused kernels as
  `pretrain.train.fused_kernels`, the body `kernel_body` names: avx512 / avx2 / neon / scalar, forced with
  MSLLM_KERNEL_ISA or `--isa`);
- `ms_layerwise`: the step one decoder layer at a time (`train.layerwise: true`, the trainer's default on CPU;
  `default_step` names the default), beside it (`--no-layerwise` leaves it out);
- `hf.sdpa`: HF LLaMA with its default attention (`sdpa`): the baseline `ratio` divides by;
- `hf.eager`: the same with `attn_implementation="eager"` (`ratio_vs_eager`);
- `hf.compile`: the sdpa model under `torch.compile` (inductor, CPU): forward, loss and backward compiled
  (AOTAutograd), clip and AdamW (foreach) eager; its first step, compilation included, is `compile_s`
  (`ratio_vs_compile`), in an inductor cache of its own (one left by an earlier torch or machine crashed its step:
  "malloc(): unaligned tcache chunk"). Where compilation fails the line carries `hf.compile.error` instead.
`--hf sdpa,eager` picks the baselines (sdpa is always run).

MFU divides by the best of independent figures, never by the measured code alone: the theoretical fp32
peak of the cores used (`tasks.training.hardware.theoretical_peak_flops`, of the emulated CPU under
`--isa avx2`) and a measured 2048³ sgemm through MindSpore's MatMul (oneDNN), numpy's BLAS and PyTorch's
`mm` (MKL); `peak_how` names the one that won, `sgemm_gflops` has all three. So MFU cannot pass 100%.

Every line carries the date, CPU model, ISA levels, emulated ISA, kernel setting and threads
(scripts/bench/host.py; `--isa avx2` emulates an AVX2-only CPU for both sides, and host.py says what is
and is not emulated), prints to stdout and is appended to docs/bench/results.jsonl
(`--results`, `--tag`), from which scripts/bench/report.py writes docs/BENCHMARKS.md.

    python scripts/bench/train.py [--steps 10] [--warmup 3]
    python scripts/bench/train.py --isa avx2                              # both sides as on an AVX2-only CPU
    python scripts/bench/train.py --preset smollm2-135m --steps 5          # continued-pretraining shapes, 2 × 128
    python scripts/bench/train.py --preset smollm2-135m --no-layerwise     # the whole-model step alone
    python scripts/bench/train.py --preset smollm2-135m --rounds 3         # sides alive at once, timed
        in turn, three rounds: each ratio within a round (a shared VM's speed drifts by ~30% over minutes)
    python scripts/bench/train.py --rounds 3 --load                        # every side also timed beside one
        `nice -n 19` busy loop in each round (host.py busy_loop): `load_slowdown` per side, 1 - loaded / quiet
    python scripts/bench/train.py --profile /tmp/prof [--steps 3]         # MindSpore side only:
        MindSpore's Profiler over `--steps` steps; one JSON line with the time by op category
        (MatMul, BatchMatMul, reductions, element-wise, softmax kernels, data movement,
        optimizer, fused kernels, host gaps) and the top ops with their shapes.
    python scripts/bench/train.py --no-fused                             # MindSpore's own ops only
    python scripts/bench/train.py --steps 1 --warmup 1 --seq 32 --batch 2 --tag smoke   # smoke run
Needs the `reference` extra (torch==2.13.0 CPU, transformers) for the baselines.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host import BUSY_LOOP, add_isa_arg, apply_isa, busy_loop, describe, effective_flags  # noqa: E402
from report import add_record_args, record  # noqa: E402

from tasks.config.schema import TrainSection  # noqa: E402  (after the sys.path insert)
from tasks.training.hardware import best_time, peak_rss_bytes  # noqa: E402

PRESET = "tiny-llama-bench"
SHAPES = {
    "tiny-llama-bench": (8, 256),
    "smollm2-135m": (2, 128),
    "smollm2-360m": (2, 128),
}  # (micro batch, seq) per preset; else 8 × 256
SGEMM_N = 2048


def _ms(a: argparse.Namespace) -> dict:
    import numpy as np

    from model import runtime

    runtime.setup_mindspore(host_blocking=True)  # as the trainer
    from model.config import ModelConfig
    from model.kernel_build import kernel_path
    from tasks.modeling.build import build_network
    from tasks.training.layerwise import causal_lm_train_step

    cfg = ModelConfig.from_name(a.preset)
    built = build_network("llama", cfg, seed=0, fused_kernels=not a.no_fused)  # as the trainer builds it
    net = built.net
    step = causal_lm_train_step(
        net, net.trainable_params(), in_place=built.kernels.optimizer, layerwise=a.layerwise_side
    )
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.seq + 1)).astype(np.int32)
    batch = [(ids[:, :-1], ids[:, 1:])]
    steps = iter(range(1, 1 << 30))
    for _ in range(a.warmup):
        step(batch, 1e-4, next(steps))
    info = {
        "fused_kernels": built.kernels.fused,
        "step": type(step).__name__,
        "kernel_body": kernel_path() if built.kernels.fused else built.kernels.model,
        "flops_per_token": cfg.flops_per_token(a.seq),
        "spin_wait": runtime.SPIN_WAIT,  # MindSpore's pool waits: "spin (...)" or "yield: <why>"
    }
    if not a.profile:
        return _timed(a, lambda: step(batch, 1e-4, next(steps))[0], info)
    from mindspore.profiler import Profiler

    prof = Profiler(output_path=a.profile)
    res = _timed(a, lambda: step(batch, 1e-4, next(steps))[0], info)
    prof.analyse()
    return {**res, "profile": profile_breakdown(a.profile, a.steps, res["step_s"])}


def _timed(a: argparse.Namespace, one, info: dict, extra=None) -> dict:
    """`info` and the timing of `one()` (a warmed-up step returning its loss): `--steps` steps, then peak RSS and
    `extra()`. `--worker` (`--rounds`): a JSON line {"ready"}, then for each "run" on stdin `--steps` steps and a
    line with their step_s, until "done": then the result (peak RSS over every round)."""

    def run() -> tuple[float, float]:
        t0 = time.perf_counter()
        for _ in range(a.steps):
            loss = one()
        return (time.perf_counter() - t0) / a.steps, loss

    if a.worker:
        print(json.dumps({"ready": True}), flush=True)
        step_s = None
        for line in sys.stdin:
            if line.strip() != "run":
                break
            step_s, loss = run()
            print(json.dumps({"step_s": step_s, "loss": loss}), flush=True)
        if step_s is None:  # told to stop (or the parent gone) before any round
            return {**info, "error": "no round ran"}
    else:
        step_s, loss = run()
    res = {
        **info,
        "tokens_per_s": a.batch * a.seq / step_s,
        "peak_rss_bytes": peak_rss_bytes(),
        "loss": loss,
        "step_s": step_s,
    }
    return {**res, **(extra() if extra else {})}


def _torch(a: argparse.Namespace) -> dict:
    """One HF baseline (`--attn`, `--compile`); on a compile failure, {"error": ...} instead of a crash."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import ModelConfig
    from model.convert import config_to_hf

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    c = ModelConfig.from_name(a.preset)
    hf = {k: v for k, v in config_to_hf(c).items() if k not in ("architectures", "model_type", "dtype")}
    model = LlamaForCausalLM(LlamaConfig(**hf, attn_implementation=a.attn))
    attn = model.config._attn_implementation  # what HF actually runs (it may fall back)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ids = torch.randint(0, c.vocab_size, (a.batch, a.seq + 1))
    x, y = ids[:, :-1], ids[:, 1:]

    def forward_loss(x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    if a.compile:  # a fresh inductor cache (module docstring), removed with the process
        a.inductor_cache = tempfile.TemporaryDirectory(prefix="bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = a.inductor_cache.name
    fwd = torch.compile(forward_loss, backend="inductor") if a.compile else forward_loss

    def one():
        loss = fwd(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    info = {"attn": attn, "compiled": a.compile, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    t0 = time.perf_counter()
    try:
        one()
    except Exception as exc:  # noqa: BLE001  (only a compiled step gets here: reported, not fatal)
        if not a.compile:
            raise
        return {
            **info,
            "error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}",
        }
    if a.compile:
        info["compile_s"] = time.perf_counter() - t0  # the first step: tracing, inductor codegen, g++
    for _ in range(a.warmup - 1):
        one()

    def sgemm() -> dict:
        m = torch.randn(SGEMM_N, SGEMM_N)
        return {"sgemm_flops": 2 * SGEMM_N**3 / best_time(lambda: torch.mm(m, m))}

    return _timed(a, one, info, sgemm if a.sgemm else None)


def _peak(a: argparse.Namespace) -> dict:
    """The theoretical peak of the cores used and the sgemm of MindSpore's MatMul and numpy's BLAS, here."""
    import numpy as np

    from model.runtime import setup_mindspore
    from tasks.training.hardware import measure_peak_flops, theoretical_peak_flops

    setup_mindspore()  # the MindSpore sgemm runs through its MatMul (oneDNN), as the train step
    theo, how = theoretical_peak_flops(effective_flags())
    m = np.random.default_rng(0).standard_normal((SGEMM_N, SGEMM_N)).astype(np.float32)
    return {
        "theoretical": theo,
        "theoretical_how": how,
        "mindspore": measure_peak_flops(n=SGEMM_N, repeats=3),
        "numpy": 2 * SGEMM_N**3 / best_time(lambda: m @ m),
    }


# ---- interleaved sides ---------------------------------------------------------------------------


def _json_line(p: subprocess.Popen, command: str | None = None) -> dict | None:
    """The next JSON line a worker prints (other output skipped), after sending it `command`; None when it has
    exited."""
    try:
        if command:
            p.stdin.write(command + "\n"), p.stdin.flush()
    except BrokenPipeError:
        return None
    for line in p.stdout:
        if line.startswith("{"):
            return json.loads(line)
    return None


def _interleaved(specs: dict, cmd, env, a: argparse.Namespace) -> dict:
    """`--rounds`: every side started and warmed up in turn (no compilation beside a timed step), then `a.rounds`
    rounds, each side timing `--steps` steps in turn while the others wait on stdin; step_s the median, rounds_step_s
    each round's (`_ratio`), peak RSS the side's own. A failed side is the bench's error where `fatal`, else
    {"error": ...}; no worker outlives the call."""
    procs, out = {}, {}

    def failed(name: str, p: subprocess.Popen, err, fatal: bool, first: dict | None = None) -> None:
        p.kill(), p.wait(), err.seek(0)
        tail = ([ln for ln in err.read().strip().splitlines() if ln.strip()][-1:] or [""])[0]
        if fatal:
            raise SystemExit(f"the {name} side failed (exit {p.returncode}): {tail[:3000]}")
        out[name] = first if first is not None else {"error": f"exit {p.returncode}: {tail[:300]}"}
        procs.pop(name, None)

    try:
        for name, (kind, extra, fatal) in specs.items():
            err = tempfile.TemporaryFile("w+")
            p = subprocess.Popen(
                cmd(kind, [*extra, "--worker"]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=env(kind),
            )
            procs[name] = (p, err, fatal)
            first = _json_line(p)
            if first is None or "ready" not in first:  # exited, or an error line (a compile failure) instead
                failed(name, p, err, fatal and first is None, first)
        times = {f"{phase}{name}": [] for name in procs for phase in ("", "load:")}
        for _ in range(a.rounds):
            for name, (p, err, fatal) in list(procs.items()):
                for phase in ("", "load:") if a.load else ("",):  # quiet, then beside the busy loop (--load)
                    with busy_loop() if phase else contextlib.nullcontext():
                        r = _json_line(p, "run")
                    if r is None or "step_s" not in r:
                        failed(name, p, err, fatal)
                        break
                    times[phase + name].append(r["step_s"])
        for name, (p, err, fatal) in list(procs.items()):
            res = _json_line(p, "done")
            if res is None or "error" in res:
                failed(name, p, err, fatal, res)
                continue
            p.wait()
            step_s = statistics.median(times[name])
            out[name] = {
                **res,
                "step_s": step_s,
                "tokens_per_s": a.batch * a.seq / step_s,
                "rounds_step_s": times[name],
            }
            if times["load:" + name]:  # each round's loaded step against the same round's quiet one
                out[name]["load_step_s"] = statistics.median(times["load:" + name])
                out[name]["load_rounds_step_s"] = times["load:" + name]
                out[name]["load_slowdown"] = statistics.median(
                    1 - q / w for q, w in zip(times[name], times["load:" + name])
                )
    finally:
        for p, _, _ in procs.values():
            if p.poll() is None:
                p.kill(), p.wait()
    return out


def _ratio(x: dict, y: dict) -> float:
    """x's speed over y's: the median of the rounds' ratios (each within one round), else of their single runs."""
    if "rounds_step_s" in x and "rounds_step_s" in y:
        return statistics.median(ty / tx for tx, ty in zip(x["rounds_step_s"], y["rounds_step_s"]))
    return x["tokens_per_s"] / y["tokens_per_s"]


# ---- profile breakdown ------------------------------------------------------------------------

_MATMUL = {"MatMul", "MatMulExt", "Dense"}
_BATCHMATMUL = {"BatchMatMul", "BatchMatMulExt"}
_SOFTMAX = {"Softmax", "SoftmaxGrad", "LogSoftmax", "LogSoftmaxGrad"}
_MOVEMENT = {
    "Transpose",
    "Concat",
    "Split",
    "Slice",
    "StridedSlice",
    "Tile",
    "Reshape",
    "BroadcastTo",
    "Gather",
    "GatherD",
    "GatherDGradV2",
    "UnsortedSegmentSum",
    "TensorScatterAdd",
    "ScatterNd",
    "Cast",
    "Stack",
}
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
        ev, fw = events[s * per : (s + 1) * per], framework[s * per : (s + 1) * per]
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
    return {
        "step_ms": round(wall_ms, 1),
        "op_ms": round(op_ms, 1),
        "categories_ms": {k: round(v, 1) for k, v in by_cat.most_common()},
        "categories_share": {k: round(v / wall_ms, 3) for k, v in by_cat.most_common()},
        "top_ops_ms": {k: round(v, 2) for k, v in by_op.most_common(top)},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default=PRESET)
    ap.add_argument("--batch", type=int, default=None, help="micro batch (default: per preset, SHAPES)")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default: per preset, SHAPES)")
    ap.add_argument(
        "--threads",
        type=int,
        default=2,
        help="threads of every side (torch: OMP_NUM_THREADS; the MindSpore sides get OMP_NUM_THREADS only "
        "below the cores, as the trainer runs)",
    )
    ap.add_argument(
        "--hf", default="sdpa,eager,compile", help="HF baselines, comma-separated, of sdpa (always run), eager, compile"
    )
    ap.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="profile the MindSpore side into DIR and print its breakdown (no baseline)",
    )
    ap.add_argument(
        "--layerwise",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the step one decoder layer at a time (train.layerwise: true, the trainer's default on CPU), "
        "as `ms_layerwise` (default: on; --no-layerwise: the whole-model step alone)",
    )
    ap.add_argument("--layerwise-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--no-fused",
        action="store_true",
        help="MindSpore's own ops only (pretrain.train.fused_kernels: false; a machine without g++)",
    )
    add_isa_arg(ap)
    add_record_args(ap)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="every side alive at once, timed in turn this many rounds (each ratio the median of the "
        "rounds' ratios): drift of a shared machine between sides becomes drift between rounds; "
        "needs the sides' memory at once (tiny and 135M: yes; the 360M shape: no)",
    )
    ap.add_argument(
        "--load",
        action="store_true",
        help="time every side also beside one `nice -n 19` busy loop in each round (the machine as users have it): "
        "`load_slowdown` per side, 1 - loaded / quiet speed, the median of the rounds'",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--side", choices=["ms", "torch", "peak"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--attn", default="sdpa", help=argparse.SUPPRESS)
    ap.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sgemm", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    batch, seq = SHAPES.get(a.preset, (8, 256))
    a.batch, a.seq = a.batch or batch, a.seq or seq
    if a.side:
        print(json.dumps({"ms": _ms, "torch": _torch, "peak": _peak}[a.side](a)))
        return
    apply_isa(a.isa)  # re-execs under the emulated CPU's environment; the children inherit it
    baselines = ["sdpa", *(b for b in ("eager", "compile") if b in a.hf.split(","))]
    base_env = dict(os.environ, GLOG_v="3", OMP_NUM_THREADS=str(a.threads))

    def env(kind: str) -> dict:
        """A side's environment. PyTorch's threads are OMP_NUM_THREADS. MindSpore sizes its own pool from the cores
        and, where OMP_NUM_THREADS is unset, sets it to its own choice (1 on 2 cores) for the OpenMP kernels inside
        the step: the trainer runs so, and an explicit OMP_NUM_THREADS=2 made SmolLM2-135M's step 16-20% slower
        (0.735 -> 0.855-0.886 s, alternated, AMD EPYC Zen 5): the ms sides get it only below the cores."""
        if kind in ("ms", "peak") and a.threads >= len(os.sched_getaffinity(0)):
            return {k: v for k, v in base_env.items() if k != "OMP_NUM_THREADS"}
        return base_env

    common = [
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        "--preset",
        a.preset,
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--threads",
        str(a.threads),
        *(["--no-fused"] if a.no_fused else []),
    ]

    def cmd(name: str, extra) -> list[str]:
        return [sys.executable, __file__, "--side", name, *common, *extra]

    def side(name: str, extra: list[str] = (), fatal: bool = True) -> dict:
        out = subprocess.run(cmd(name, extra), capture_output=True, text=True, env=env(name))
        if out.returncode:
            if fatal:
                raise SystemExit(
                    f"the {name} {' '.join(extra)} side failed (exit {out.returncode}):\n{out.stderr[-3000:]}"
                )
            tail = [ln for ln in out.stderr.strip().splitlines() if ln.strip()][-1:] or [""]
            return {"error": f"exit {out.returncode}: {tail[0][:300]}"}
        return json.loads(out.stdout.strip().splitlines()[-1])

    if a.profile:
        ms_ = side("ms", ["--profile", os.path.abspath(a.profile)])
        print(
            json.dumps(
                {
                    "bench": "train_profile",
                    "preset": a.preset,
                    "batch": a.batch,
                    "seq": a.seq,
                    "steps": a.steps,
                    "tokens_per_s": round(ms_["tokens_per_s"], 1),
                    **ms_["profile"],
                }
            )
        )
        return
    specs = {
        "ms": ("ms", [], True),
        **({"layerwise": ("ms", ["--layerwise-side"], True)} if a.layerwise else {}),
        "sdpa": ("torch", ["--attn", "sdpa", "--sgemm"], True),
        **({"eager": ("torch", ["--attn", "eager"], True)} if "eager" in baselines else {}),
        # a compile failure is a result
        **({"compile": ("torch", ["--attn", "sdpa", "--compile"], False)} if "compile" in baselines else {}),
    }
    if a.rounds > 1 or a.load:
        runs = _interleaved(specs, cmd, env, a)
    else:
        runs = {name: side(kind, extra, fatal) for name, (kind, extra, fatal) in specs.items()}
    ms_, layerwise = runs["ms"], runs.get("layerwise")
    hf = {k: runs[k] for k in ("sdpa", "eager", "compile") if k in runs}
    peak = side("peak")
    fpt = ms_["flops_per_token"]
    measured = {"mindspore": peak["mindspore"], "numpy": peak["numpy"], "torch": hf["sdpa"]["sgemm_flops"]}
    denominator, peak_how = max(
        (peak["theoretical"], f"theoretical: {peak['theoretical_how']}"),
        *(
            (v, f"measured {k} sgemm {SGEMM_N}³ (above the theoretical {peak['theoretical'] / 1e9:.1f} GFLOP/s)")
            for k, v in measured.items()
        ),
    )

    def figures(r: dict) -> dict:
        if "error" in r:
            return {"error": r["error"]}
        out = {
            "tokens_per_s": round(r["tokens_per_s"], 1),
            "step_s": round(r["step_s"], 3),
            "mfu": round(r["tokens_per_s"] * fpt / denominator, 4),
            "peak_rss_gb": round(r["peak_rss_bytes"] / 1e9, 2),
            "loss": round(r["loss"], 4),
        }
        if "rounds_step_s" in r:
            out["rounds_step_s"] = [round(v, 3) for v in r["rounds_step_s"]]
        if "load_slowdown" in r:
            out["load_step_s"] = round(r["load_step_s"], 3)
            out["load_rounds_step_s"] = [round(v, 3) for v in r["load_rounds_step_s"]]
            out["load_slowdown"] = round(r["load_slowdown"], 3)
        for k in ("attn", "cpu_capability", "compile_s"):
            if k in r:
                out[k] = round(r[k], 1) if isinstance(r[k], float) else r[k]
        return out

    res = {
        "bench": "train",
        **describe(a.threads),
        "preset": a.preset,
        "batch": a.batch,
        "seq": a.seq,
        "steps": a.steps,
        "rounds": a.rounds,
        "load": BUSY_LOOP if a.load else None,
        "fused_kernels": ms_["fused_kernels"],
        "kernel_body": ms_["kernel_body"],
        "step": ms_["step"],
        "default_step": "layer at a time" if TrainSection().layerwise else "whole model",  # what the trainer runs
        "spin_wait": ms_.get("spin_wait"),
        **figures(ms_),
        "hf": {k: figures(v) for k, v in hf.items()},
    }
    if layerwise is not None:
        res["ms_layerwise"] = {
            **figures(layerwise),
            "ratio_vs_compile": round(_ratio(layerwise, hf["compile"]), 3)
            if "tokens_per_s" in hf.get("compile", {})
            else None,
            "rss_ratio": round(layerwise["peak_rss_bytes"] / hf["sdpa"]["peak_rss_bytes"], 2),
        }
    for k, v in hf.items():
        if "tokens_per_s" in v:
            suffix = "" if k == "sdpa" else f"_vs_{k}"
            res[f"ratio{suffix}"] = round(_ratio(ms_, v), 3)
            res[f"rss_ratio{suffix}"] = round(ms_["peak_rss_bytes"] / v["peak_rss_bytes"], 2)
    res.update(
        peak_gflops=round(denominator / 1e9, 1),
        peak_how=peak_how,
        theoretical_gflops=round(peak["theoretical"] / 1e9, 1),
        sgemm_gflops={k: round(v / 1e9, 1) for k, v in measured.items()},
    )
    record(res, a)


if __name__ == "__main__":
    main()
