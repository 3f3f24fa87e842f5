"""The one training loop, shared by pretraining and fine-tuning.

Reads top-down: `fit()` sets up (optimizer, compiled step, resume), then loops
step → log → validate → checkpoint, and returns a summary. The caller owns the
network, which parameters train, the loss and the batches:

    result = fit(net, params, loss_fn, loop, batches=lambda start: iterator, valid=lambda: iterator,
                 run_dir=Path(...), meta={...}, flops_per_token=...)

`batches(start_sample)` yields (input_ids [B, T] int32, labels [B, T] int32, -100 = no loss)
starting at global sample `start_sample`, so a resumed run sees exactly the data
it would have seen. Checkpoints go to `run_dir/checkpoints`, metrics to
`run_dir/metrics.jsonl`. Everything is deterministic on CPU: a resumed run's
per-step losses equal an uninterrupted run's bit for bit.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tasks.training.checkpoint import CheckpointError, load_checkpoint, newest_checkpoint, save_checkpoint
from tasks.store.tensors import assign

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]


class NonFiniteError(RuntimeError):
    """The run went non-finite (or applied no update): a retry from the same checkpoint would too."""

    permanent = True


@dataclass
class LoopConfig:
    max_steps: int
    micro_batch_size: int
    gradient_accumulation: int = 1
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_steps: int = 0
    decay: str = "cosine"
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False
    grad_clip: float | None = 1.0
    log_steps: int = 10
    eval_steps: int = 50
    eval_batches: int = 8
    save_steps: int = 100
    keep_checkpoint_max: int = 3
    resume: bool = True
    max_nonfinite_steps: int = 5
    precision: str = "fp32"
    """"fp32" (loss scale fixed at 1) or "fp16" (dynamic loss scaling; the caller builds an fp16 network)."""
    loss_scale: float = 65536.0
    """Initial dynamic loss scale S (fp16 only)."""
    loss_scale_window: int = 1000
    """fp16: S doubles after this many consecutive finite steps (and halves on every overflow)."""
    peak_flops: float | None = None
    fused_kernels: bool = True
    """pretrain.fused_kernels: the AdamW update (ZeRO-1's too) as model/train_kernels.cc ZeroAdamW's in-place op
    where it builds; False keeps it on MindSpore's AdamWeightDecay (under ZeRO-1 with an fp32 master share)."""
    progress: bool = True
    fault_steps: list[int] = field(default_factory=list)
    """Test hook: steps whose gradients are made non-finite (exercises the skip path)."""
    stop_after: int | None = None
    """Stop (as if killed) after this many steps of this process, leaving the checkpoints."""
    load_checkpoint: str | None = None
    """A training checkpoint (dir with state.json, or a checkpoints/ dir: its newest) to continue from when
    this run has none of its own: weights, optimizer state, step and data position, resharded to this layout."""

    @classmethod
    def from_sections(cls, pretrain, checkpoint, max_steps: int, progress: bool = True) -> "LoopConfig":
        o = pretrain.optimizer
        return cls(
            max_steps=max_steps, micro_batch_size=pretrain.micro_batch_size,
            gradient_accumulation=pretrain.gradient_accumulation, lr=o.lr, min_lr=o.min_lr,
            warmup_steps=pretrain.schedule.warmup_steps, decay=pretrain.schedule.decay, beta1=o.beta1,
            beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, decay_norms_and_biases=o.decay_norms_and_biases,
            decay_embeddings=o.decay_embeddings, grad_clip=pretrain.grad_clip, log_steps=pretrain.log_steps,
            eval_steps=pretrain.eval_steps, eval_batches=pretrain.eval_batches, save_steps=checkpoint.save_steps,
            keep_checkpoint_max=checkpoint.keep_checkpoint_max, resume=checkpoint.resume,
            max_nonfinite_steps=pretrain.max_nonfinite_steps, peak_flops=pretrain.peak_flops, progress=progress,
            precision=pretrain.precision, loss_scale=pretrain.loss_scale, loss_scale_window=pretrain.loss_scale_window,
            load_checkpoint=checkpoint.load_checkpoint, fused_kernels=pretrain.fused_kernels,
        )


@dataclass
class FitResult:
    steps: int
    consumed_samples: int
    final_loss: float
    val_loss: float | None
    skipped_steps: int
    tokens_per_s: float
    history: list[dict[str, Any]]
    initial_val_loss: float | None = None
    stopped_early: bool = False
    overflow_steps: int = 0
    """fp16: steps skipped because the scaled gradients overflowed (expected; S halved, not faults)."""
    loss_scale: float = 1.0
    """The loss scale S at the end (1 in fp32)."""
    updates: int = 0
    """Updates applied in the whole run (resumed ones included)."""


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: VmHWM, the high-water mark of its own address space.

    Not ru_maxrss: Linux folds the pre-exec image into it, so a child started by a large
    parent (pytest, a Prefect worker) would report the parent's peak.
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure_peak_flops(n: int = 2048, repeats: int = 3) -> float:
    """Achievable fp32 matmul FLOP/s here: the best of a few n³ MatMuls through MindSpore's own kernel
    (oneDNN, the one the train step uses; numpy's BLAS here reaches a fraction of it).

    Shown beside MFU as the achievable peak; never MFU's denominator unless it exceeds the theoretical
    peak (a busy machine under-measures it, which once printed "MFU 211%"). See `theoretical_peak_flops`.
    """
    a_np = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    try:
        import mindspore as ms
        from mindspore import ops

        a = ms.Tensor(a_np)
        matmul = ops.MatMul()

        def product(x):
            return matmul(x, x)

        compiled = ms.jit(product)  # ~1.5x PyNative's single-op path; compiles in ~0.2 s

        def once():
            return compiled(a).asnumpy()  # asnumpy waits for the kernel
    except Exception:  # noqa: BLE001  (no usable MindSpore in this process: numpy's BLAS)
        def once():
            return a_np @ a_np
    once()  # warm up the kernel and its threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _cpu_ghz() -> tuple[float, str]:
    """The highest clock this machine reports (GHz) and where it was read."""
    cands: list[tuple[float, str]] = []
    try:
        cands.append((int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6,
                      "cpufreq cpuinfo_max_freq"))
    except (OSError, ValueError):
        pass
    try:
        info = Path("/proc/cpuinfo").read_text()
        for line in info.splitlines():
            if line.startswith("cpu MHz"):
                cands.append((float(line.split(":")[1]) / 1e3, "/proc/cpuinfo cpu MHz"))
                break
        import re

        m = re.search(r"model name\s*:.*@\s*([0-9.]+)\s*GHz", info)
        if m:
            cands.append((float(m.group(1)), "model name"))
    except (OSError, ValueError):
        pass
    return max(cands) if cands else (0.0, "unknown")


def _cores_for_this_process() -> int:
    """Cores this process computes on: its CPU affinity, capped by OMP_NUM_THREADS (msrun sets it per rank)."""
    import os

    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, min(n, int(omp))) if omp.isdigit() and int(omp) > 0 else n


def theoretical_peak_flops(flags: set[str] | None = None) -> tuple[float, str]:
    """fp32 peak of the cores this process uses: cores × clock × FLOPs per cycle per core, and how it was derived.

    FLOPs per cycle = SIMD fp32 lanes (16 with AVX-512, 8 with AVX2, 4 with SSE/NEON) × 2 with FMA
    × 2 FMA units (every AVX2/AVX-512 server core since Haswell/Skylake-SP has two; with one, the true
    peak is half and MFU is understated, never overstated). The clock is the highest one the machine
    reports; a turbo clock above it could in principle exceed it, so `resolve_peak_flops` also never
    lets the denominator fall below a measured sgemm. `flags` (default: cpu_flags()) lets a benchmark that
    emulates a lesser CPU (scripts/bench/host.py, AVX-512 flags removed) count that CPU's lanes.
    """
    from model.kernels import cpu_flags

    flags = cpu_flags() if flags is None else flags
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags or "avx" in flags else 4
    fma = 2 if ("fma" in flags or "asimd" in flags) else 1
    units = 2 if lanes >= 8 else 1
    ghz, src = _cpu_ghz()
    cores = _cores_for_this_process()
    if ghz <= 0:
        return 0.0, "clock unknown"
    per_cycle = lanes * fma * units
    how = (f"{cores} cores × {ghz:.2f} GHz ({src}) × {per_cycle} fp32 FLOP/cycle "
           f"({lanes} lanes{' × FMA' if fma == 2 else ''} × {units} units)")
    return cores * ghz * 1e9 * per_cycle, how


@dataclass
class PeakFlops:
    flops: float
    how: str
    achievable: float | None = None

    def describe(self) -> str:
        s = f"{self.flops / 1e9:.1f} GFLOP/s fp32 per rank ({self.how})"
        if self.achievable:
            s += f"; measured sgemm {self.achievable / 1e9:.1f} GFLOP/s ({100 * self.achievable / self.flops:.0f}% of it)"
        return s


def resolve_peak_flops(configured: float | None = None) -> PeakFlops:
    """MFU's denominator: `pretrain.peak_flops` when set, else the hardware's theoretical peak.

    The measured sgemm rides along as the achievable peak; should it ever exceed the theoretical
    figure (an unreported turbo clock), it becomes the denominator, so MFU > 100% cannot be printed.
    """
    if configured:
        return PeakFlops(float(configured), "pretrain.peak_flops")
    theo, how = theoretical_peak_flops()
    meas = measure_peak_flops(n=2048, repeats=3)
    if theo < meas:
        return PeakFlops(meas, f"measured sgemm (above the derived {how})", meas)
    return PeakFlops(theo, how, meas)


def _named_arrays(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir (has state.json), or the newest good one under a checkpoints/ or run dir."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = newest_checkpoint(root, good_only=True)
        if found is not None:
            return found
    raise ValueError(f"checkpoint.load_checkpoint: {p} holds no good training checkpoint "
                     "(a step_* dir with state.json and finite weights); point it at one, or at a run's checkpoints/ dir")


def check_compatible(state: dict[str, Any], meta: dict[str, Any], ckpt: Path) -> None:
    """A checkpoint continues this run only if it has the same model config and tokenizer (both sides named)."""
    saved, want = state.get("model"), meta.get("model")
    if saved is not None and want is not None and saved != want:
        diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs this run {want.get(k)!r}" for k in diff[:4])
        raise CheckpointError(f"{ckpt}: model config differs from this run's ({detail}); load a checkpoint of "
                              "this architecture or change the model section to match it")
    saved_tok, want_tok = state.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved_tok and want_tok and saved_tok != want_tok:
        raise CheckpointError(f"{ckpt}: trained with tokenizer sha256 {saved_tok[:12]}… but this run's data artifact "
                              f"uses {want_tok[:12]}…; the token ids mean different pieces. Tokenize the data with the "
                              "checkpoint's tokenizer (data.tokenizer.path) or start from scratch")


@dataclass
class LoopState:
    """The loop's counters: what a checkpoint's state.json saves and a resume restores (mirror images)."""

    step: int = 0
    consumed: int = 0
    updates: int = 0
    skipped: int = 0
    """Non-finite steps (loss, gradient, or an update refused by the UpdateGuard): faults, not fp16 overflows."""
    consecutive: int = 0
    overflows: int = 0
    skipped_at_save: int = 0
    """`skipped` when the previous checkpoint was written: a checkpoint is good only if none happened since."""

    def to_state(self) -> dict[str, Any]:
        return {"consumed_samples": self.consumed, "updates": self.updates, "skipped_steps": self.skipped,
                "overflow_steps": self.overflows, "good": self.skipped == self.skipped_at_save}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> "LoopState":
        skipped = state["skipped_steps"]
        return cls(step=state["step"], consumed=state["consumed_samples"], updates=state["updates"], skipped=skipped,
                   overflows=state.get("overflow_steps", 0), skipped_at_save=skipped)


def native_kernels(net, fused_setting: bool) -> str:
    """Which native kernel body the train step runs, for the manifest (metrics `native_kernels`) and the log:
    "avx512", "avx2", "neon", "scalar", or "off: <why>". model/kernels.py logs the body (or why it could not
    build) when the model loads it; a model that never asked for it is logged here."""
    why = ("pretrain.fused_kernels is false" if not fused_setting else
           "fp16 compute (the fused kernels are fp32)" if getattr(net, "half", False) else "")
    if why:
        print(f"[train] native kernels: off, MindSpore's own ops run: {why}", file=sys.stderr, flush=True)
        return f"off: {why}"
    from model.kernels import kernel_path

    return kernel_path()


def _optimizer(params, loop: LoopConfig, mesh):
    """AdamW over `params`, or under parallel.optimizer_shard (ZeRO-1) ShardedAdamW, each rank keeping the moments
    of its 1/dp share."""
    from tasks.training.optim import AdamW, ShardedAdamW, decays

    decay_mask = [decays(p.name, decay_norms_and_biases=loop.decay_norms_and_biases,
                         decay_embeddings=loop.decay_embeddings) for p in params]
    if mesh.zero:
        return ShardedAdamW(params, beta1=loop.beta1, beta2=loop.beta2, eps=loop.eps, weight_decay=loop.weight_decay,
                            grad_clip=loop.grad_clip, decay_mask=decay_mask, dp=mesh.dp, dp_index=mesh.dp_index,
                            in_place=loop.fused_kernels)
    return AdamW(params, beta1=loop.beta1, beta2=loop.beta2, eps=loop.eps, weight_decay=loop.weight_decay,
                 grad_clip=loop.grad_clip, decay_mask=decay_mask, sharded=mesh.sharded(params), tp_group=mesh.tp_group,
                 fused=loop.fused_kernels)


def _resume(loop: LoopConfig, mesh, ckpt_root: Path, params, optimizer, opt_params, scaler, meta: dict[str, Any],
            metrics_path: Path) -> tuple[LoopState, list[dict[str, Any]]]:
    """Where training starts: the newest good checkpoint of this run (pretrain.resume), else
    checkpoint.load_checkpoint, else step 0. Loads weights, moments (this rank's share under ZeRO-1), the
    loss scale and the counters into place, and returns the counters with the metrics history up to them."""
    fp16 = loop.precision == "fp16"
    st, history = LoopState(), []
    latest = newest_checkpoint(ckpt_root, good_only=True) if loop.resume else None
    if latest is None and loop.load_checkpoint:
        latest = resolve_checkpoint(loop.load_checkpoint)
    if latest is not None:
        weights, opt_state, state = load_checkpoint(latest, tp=mesh.tp, tp_index=mesh.tp_index)
        check_compatible(state, meta, latest)
        assign(params, weights, str(latest))
        if mesh.zero:
            optimizer.load_full(opt_state, str(latest))  # this rank's share, from the full moments of any layout
        else:
            assign(opt_params, opt_state, str(latest))
        st = LoopState.from_state(state)
        if fp16:
            scaler.load_state_dict(state)  # S and its good-step count: resume stays exact
        if st.consumed % mesh.dp:
            raise ValueError(f"{latest}: {st.consumed} samples consumed is not a multiple of data_parallel={mesh.dp}, "
                             "so the ranks cannot split the data position evenly; resume with a data_parallel "
                             "that divides it (e.g. 1)")
        history = [r for r in _read_jsonl(metrics_path) if r.get("step", 0) <= st.step]
        if not history and latest.parent != ckpt_root:  # continuing another (checked compatible) run: its metrics too
            history = [r for r in _read_jsonl(latest.parent.parent / "metrics.jsonl") if r.get("step", 0) <= st.step]
        saved = state.get("layout", {})
        print(f"[train] resumed from {latest.name if latest.parent == ckpt_root else latest}: step {st.step}, "
              f"{st.consumed} samples consumed (saved by dp={saved.get('data_parallel', 1)} "
              f"tp={saved.get('tensor_parallel', 1)}{', optimizer sharded' if 'optimizer_shard' in saved else ''}, "
              f"now dp={mesh.dp} tp={mesh.tp}{', optimizer sharded' if mesh.zero else ''})", file=sys.stderr)
    return st, history


def fit(net, params, loss_fn, loop: LoopConfig, *, batches: Batches, valid: Callable[[], Iterator] | None,
        run_dir: Path, meta: dict[str, Any], flops_per_token: float, tokens_per_sample: int, mesh=None) -> FitResult:
    """Train; with a distributed `mesh` (tasks/runtime/distributed.py) every rank calls this with its own slice of the
    model and `batches` yielding its own data shard; rank 0 writes the metrics, replica 0 the checkpoints.

    Raises NonFiniteError when the run cannot produce a trustworthy model: `max_nonfinite_steps` non-finite
    steps in a row (the message names the newest *good* checkpoint), no update applied at all, or a
    non-finite final validation loss. Nothing is published in those cases (the caller publishes after fit).
    """
    import mindspore as ms

    from tasks.runtime.distributed import Mesh
    from tasks.training.optim import DynamicLossScale, TrainStep, UpdateGuard, lr_at

    mesh = mesh or Mesh()
    lead = mesh.rank == 0
    # ---- setup
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = run_dir / "checkpoints"
    optimizer = _optimizer(params, loop, mesh)
    step_fn = TrainStep(loss_fn, params, optimizer, accumulation=loop.gradient_accumulation,
                        dp_group=mesh.dp_group, dp=mesh.dp)
    fp16 = loop.precision == "fp16"
    scaler = DynamicLossScale(loop.loss_scale if fp16 else 1.0, window=loop.loss_scale_window, dynamic=fp16)
    eval_fn = ms.jit(loss_fn)
    opt_params = list(optimizer.exp_avg) + list(optimizer.exp_avg_sq)
    metrics_path = run_dir / "metrics.jsonl"

    # ---- resume (the mirror image of the save at the bottom of the loop)
    st, history = _resume(loop, mesh, ckpt_root, params, optimizer, opt_params, scaler, meta, metrics_path)
    if mesh.zero:
        optimizer.sync_master()  # the master share follows the (possibly loaded) weights
    if lead:
        _write_jsonl(metrics_path, history)
    from tasks.training.tensorboard import open_run

    events = open_run(run_dir, history, meta, enabled=lead)  # TensorBoard: the same records, rewritten on resume
    guard = UpdateGuard(UpdateGuard.max_abs(p.asnumpy() for p in params), beta1=loop.beta1, beta2=loop.beta2,
                        weight_decay=loop.weight_decay)
    peak = resolve_peak_flops(loop.peak_flops)  # per rank: MFU divides by world × peak
    if lead:
        print(f"[train] MFU denominator: {peak.describe()}", file=sys.stderr, flush=True)

    # under pure data parallel only rank 0 validates (the replicas are equal); tensor-parallel ranks all take part
    do_eval = valid is not None and (lead or mesh.tp > 1)
    if do_eval and st.step == 0:  # the starting point: shows what training (or continuing) changed
        v0 = evaluate_loss(eval_fn, valid(), loop.eval_batches)
        r0 = {"step": 0, "val_loss": v0, "val_ppl": _ppl(v0)}
        history.append(r0)
        if lead:
            _append_jsonl(metrics_path, r0)
            events.write(r0)
        print(f"[train] step 0: val_loss {v0:.4f} (ppl {r0['val_ppl']:.1f})", file=sys.stderr, flush=True)

    # ---- the loop: step → log → validate → save
    per_step = loop.micro_batch_size * loop.gradient_accumulation * mesh.dp  # global samples per step
    it = batches(st.consumed)
    bar = _progress(loop, st.step) if lead else _NoBar()
    t_start, steps_here, last_loss, val_loss = time.perf_counter(), 0, float("nan"), None
    t_log, tok_log = time.perf_counter(), 0
    stopped = False
    while st.step < loop.max_steps:
        micro = [next(it) for _ in range(loop.gradient_accumulation)]
        lr = lr_at(st.step, lr=loop.lr, min_lr=loop.min_lr, warmup_steps=loop.warmup_steps,
                   max_steps=loop.max_steps, decay=loop.decay)
        scale = scaler.scale
        allow = guard.allows(lr, st.updates + 1)
        # fault hook: scale 0 -> grads / 0 -> non-finite
        loss, gnorm, finite = step_fn(micro, lr, st.updates + 1, 0.0 if st.step + 1 in loop.fault_steps else scale,
                                      allow=allow)
        if math.isfinite(loss):
            overflow = scaler.update(finite)  # fp16: a non-finite gradient while S > 1 halves S
        else:  # a non-finite forward is never a loss-scale overflow (S only scales the backward)
            finite, overflow, scaler.good_steps = False, False, 0
        st.step += 1
        steps_here += 1
        st.consumed += per_step
        tok_log += per_step * tokens_per_sample
        if finite and allow:
            guard.applied(lr, st.updates + 1)
            st.updates += 1
            st.consecutive = 0
            last_loss = loss
        elif overflow:
            st.overflows += 1
            print(f"[train] step {st.step}: gradient overflow at loss scale {scale:g}; update skipped, "
                  f"scale -> {scaler.scale:g}", file=sys.stderr)
        else:
            st.skipped += 1
            st.consecutive += 1
            why = (f"non-finite loss/grad norm ({loss}, {gnorm})" if not finite else
                   f"the update at lr {lr:.3g} could make weights non-finite (|w| bound {guard._next_bound(lr, st.updates + 1):.3g})")
            print(f"[train] step {st.step}: {why}; update skipped ({st.consecutive} in a row)", file=sys.stderr)
            if st.consecutive >= loop.max_nonfinite_steps:
                bar.close()
                raise NonFiniteError(
                    f"{st.consecutive} consecutive non-finite steps (limit pretrain.max_nonfinite_steps="
                    f"{loop.max_nonfinite_steps}) at step {st.step}; the last good checkpoint is "
                    f"{newest_checkpoint(ckpt_root, good_only=True) or 'none (no good checkpoint yet)'}; "
                    "lower the learning rate or check the data")
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        record: dict[str, Any] | None = None
        if st.step % loop.log_steps == 0 or st.step == loop.max_steps:
            now = time.perf_counter()
            tps = tok_log / max(now - t_log, 1e-9)
            eta = (loop.max_steps - st.step) * (now - t_start) / max(steps_here, 1)
            record = {"step": st.step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
                      "mfu": tps * flops_per_token / (peak.flops * mesh.world), "peak_rss_bytes": peak_rss_bytes(),
                      "eta_s": eta, "consumed_samples": st.consumed, "skipped_steps": st.skipped}
            if fp16:
                record.update(loss_scale=scale, overflow_steps=st.overflows)
            t_log, tok_log = now, 0
        if do_eval and (st.step % loop.eval_steps == 0 or st.step == loop.max_steps):
            val_loss = evaluate_loss(eval_fn, valid(), loop.eval_batches)
            record = record or {"step": st.step, "loss": loss, "lr": lr}
            record.update(val_loss=val_loss, val_ppl=_ppl(val_loss))
        if record is not None:
            history.append(record)
            if lead:
                _append_jsonl(metrics_path, record)
                events.write(record)
                bar.write(_format_record(record, loop.max_steps))
        if st.step % loop.save_steps == 0 or st.step == loop.max_steps:
            _save(ckpt_root, st, params, optimizer if mesh.zero else opt_params, scaler, loop, meta, mesh)
        if loop.stop_after is not None and steps_here >= loop.stop_after and st.step < loop.max_steps:
            stopped = True
            break
    bar.close()
    events.close()
    if mesh.dp > 1:
        digest = mesh.check_replicas(_named_arrays(params))
        print(f"[train] rank {mesh.rank}: parameters sha256 {digest} (equal on all {mesh.dp} data-parallel replicas)",
              file=sys.stderr, flush=True)
        print(f"[train] rank {mesh.rank}: peak RSS {peak_rss_bytes()} bytes"
              f"{' (optimizer state sharded)' if mesh.zero else ''}", file=sys.stderr, flush=True)
    if not stopped and steps_here == 0:  # resumed at max_steps (killed after the last checkpoint, before publishing)
        last_loss, val_loss = _final_from_history(history, st.step, last_loss, val_loss)
        if val_loss is None and do_eval:  # its validation record was lost with the kill: measure it again
            val_loss = evaluate_loss(eval_fn, valid(), loop.eval_batches)
    if not stopped:
        _check_trustworthy(st, val_loss, ckpt_root, fp16)
    elapsed = time.perf_counter() - t_start
    initial_val = next((r["val_loss"] for r in history if r.get("step") == 0 and "val_loss" in r), None)
    return FitResult(steps=st.step, consumed_samples=st.consumed, final_loss=last_loss, val_loss=val_loss,
                     initial_val_loss=initial_val, skipped_steps=st.skipped,
                     tokens_per_s=steps_here * per_step * tokens_per_sample / max(elapsed, 1e-9),
                     history=history, stopped_early=stopped, overflow_steps=st.overflows, loss_scale=scaler.scale,
                     updates=st.updates)


def _final_from_history(history: list[dict[str, Any]], step: int, loss: float,
                        val_loss: float | None) -> tuple[float, float | None]:
    """The final train loss and validation loss of a run that resumed with nothing left to train: the
    metrics records of its last step (a kill may have torn or lost them: then what was passed in)."""
    for r in reversed(history):
        if r.get("step") == step and isinstance(r.get("val_loss"), (int, float)) and val_loss is None:
            val_loss = float(r["val_loss"])
        if not math.isfinite(loss) and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]):
            loss = float(r["loss"])
    return loss, val_loss


def _save(ckpt_root: Path, st: LoopState, params, opt_params, scaler, loop: LoopConfig, meta: dict[str, Any],
          mesh) -> None:
    """Checkpoint the loop: weights, moments, counters; marked good only with finite weights and no
    non-finite step since the previous checkpoint (resume and the error messages use good ones only).
    Under ZeRO-1 `opt_params` is the ShardedAdamW: every rank writes its own share of the moments."""
    opt_shard = opt_params.layout() if mesh.zero else None
    weights = _named_arrays(params)
    moments = opt_params.shard_state() if mesh.zero else _named_arrays(opt_params)
    state = {**st.to_state(), "precision": loop.precision, **scaler.state_dict(),
             "rng": {"data_seed": meta.get("seed"), "numpy": "order derived from seed+epoch"}, **meta}
    if mesh.tp == 1 and not all(np.isfinite(a).all() for a in (*weights.values(), *moments.values())):
        # cannot happen while the UpdateGuard holds; never write a checkpoint a resume could pick up
        raise NonFiniteError(f"step {st.step}: the weights or optimizer moments are non-finite; not checkpointed. "
                             f"The last good checkpoint is {newest_checkpoint(ckpt_root, good_only=True) or 'none'}")
    save_checkpoint(ckpt_root, st.step, weights, moments, state, loop.keep_checkpoint_max, mesh=mesh,
                    opt_shard=opt_shard)
    st.skipped_at_save = st.skipped


def _check_trustworthy(st: LoopState, val_loss: float | None, ckpt_root: Path, fp16: bool) -> None:
    """A finished run publishes only if it changed the model and its final validation loss is finite."""
    if st.updates == 0:
        why = ("every step overflowed in fp16 (the loss scale fell to its floor without a finite step); "
               "raise pretrain.loss_scale_window or train in fp32" if fp16 and st.overflows else
               "every step was non-finite or refused; lower the learning rate or check the data")
        raise NonFiniteError(f"no update was applied in {st.step} steps: {why}. Nothing is published")
    if val_loss is not None and not math.isfinite(val_loss):
        raise NonFiniteError(f"the final validation loss is {val_loss} after {st.step} steps; the model is not "
                             f"usable and is not published. The last good checkpoint is "
                             f"{newest_checkpoint(ckpt_root, good_only=True) or 'none'}; lower the learning rate")


def _ppl(loss: float) -> float:
    return math.exp(min(loss, 50)) if math.isfinite(loss) else float("nan")


def evaluate_loss(eval_fn, batches: Iterator, max_batches: int) -> float:
    """Token-weighted mean loss over at most `max_batches` batches."""
    import mindspore as ms

    total, count = 0.0, 0
    for i, (ids, labels) in enumerate(batches):
        if i >= max_batches:
            break
        n = int((labels != -100).sum())
        total += float(eval_fn(ms.Tensor(ids), ms.Tensor(labels)).asnumpy()) * n
        count += n
    return total / max(count, 1)


def _format_record(r: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {r['step']:>5}/{max_steps}", f"loss {r['loss']:.4f}"]
    if "lr" in r:
        parts.append(f"lr {r['lr']:.2e}")
    if "grad_norm" in r:
        parts += [f"gnorm {r['grad_norm']:.3f}", f"{r['tokens_per_s']:.0f} tok/s", f"MFU {100 * r['mfu']:.1f}%",
                  f"rss {r['peak_rss_bytes'] / 2**30:.2f} GiB", f"eta {r['eta_s']:.0f}s"]
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
    return "[train] " + " | ".join(parts)


class _NoBar:
    def update(self, n):  # noqa: D401
        pass

    def set_postfix(self, **kw):
        pass

    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def close(self):
        pass


def _progress(loop: LoopConfig, initial: int):
    if not loop.progress:
        return _NoBar()
    from tasks.runtime.progress import progress_bar

    return progress_bar(total=loop.max_steps, initial=initial, desc="train", unit="step", leave=True)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line torn by a kill (-9, power loss) mid-write is dropped, not fatal."""
    if not path.is_file():
        return []
    rows, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
    if torn:
        print(f"[train] {path}: dropped {torn} partial line(s) left by an interrupted run", file=sys.stderr)
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from tasks.store.artifacts import atomic_write_bytes

    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def run_outcome(result: FitResult, mesh, run_dir: Path) -> Path | None | bool:
    """What a training stage returns after `fit` when it does not publish: None when stopped on request
    (tests: checkpoints stay, no artifact), `run_dir` on ranks other than 0; True when this rank publishes."""
    if result.stopped_early:
        return None
    if mesh.rank != 0:
        return run_dir
    return True


def add_run_files(out_dir: Path, run_dir: Path, result: FitResult, title: str) -> None:
    """Put the run's metrics.jsonl and its loss curve into the artifact being built (pretrain and finetune)."""
    import shutil

    shutil.copy2(run_dir / "metrics.jsonl", out_dir / "metrics.jsonl")
    plot_loss_curve(result.history, out_dir / "loss_curve.png", title)


def plot_loss_curve(history: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    tr = [(r["step"], r["loss"]) for r in history if "loss" in r and math.isfinite(r["loss"])]
    va = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="train loss")
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


__all__ = ["LoopConfig", "FitResult", "fit", "run_outcome", "add_run_files", "NonFiniteError", "plot_loss_curve", "evaluate_loss", "asdict"]
