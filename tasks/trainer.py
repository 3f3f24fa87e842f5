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

from tasks.checkpoint import load_checkpoint, newest_checkpoint, save_checkpoint

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]


class NonFiniteError(RuntimeError):
    """Too many consecutive NaN/Inf steps."""


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
            load_checkpoint=checkpoint.load_checkpoint,
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
    """Peak fp32 matmul FLOP/s of this machine (the MFU denominator when `pretrain.peak_flops` is unset).

    The best of a few large sgemms (numpy's BLAS, all cores): a single timing on a busy machine
    under-measures, and MFU above 100% is the symptom. Configure `pretrain.peak_flops` for a
    fixed denominator (e.g. the accelerator's datasheet number).
    """
    a = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    a @ a  # warm up the BLAS threads
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ a
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _named_arrays(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


def _assign(params, arrays: dict[str, np.ndarray], what: str) -> None:
    import mindspore as ms

    missing = [p.name for p in params if p.name not in arrays]
    if missing:
        raise RuntimeError(f"checkpoint {what} lacks {missing[:3]}{'…' if len(missing) > 3 else ''}; it belongs to another model")
    for p in params:
        if tuple(arrays[p.name].shape) != tuple(p.shape):
            raise RuntimeError(f"checkpoint {what}: {p.name} has shape {arrays[p.name].shape}, model wants {tuple(p.shape)}")
        p.set_data(ms.Tensor(arrays[p.name]))


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir (has state.json), or the newest complete one under a checkpoints/ or run dir."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = newest_checkpoint(root)
        if found is not None:
            return found
    raise ValueError(f"checkpoint.load_checkpoint: {p} holds no complete training checkpoint "
                     "(a step_* dir with state.json); point it at one, or at a run's checkpoints/ dir")


def fit(net, params, loss_fn, loop: LoopConfig, *, batches: Batches, valid: Callable[[], Iterator] | None,
        run_dir: Path, meta: dict[str, Any], flops_per_token: float, tokens_per_sample: int, mesh=None) -> FitResult:
    """Train; with a distributed `mesh` (tasks/distributed.py) every rank calls this with its own slice of the
    model and `batches` yielding its own data shard; rank 0 writes the metrics, replica 0 the checkpoints."""
    import mindspore as ms

    from tasks.distributed import Mesh
    from tasks.optim import AdamW, DynamicLossScale, TrainStep, decays, lr_at

    mesh = mesh or Mesh()
    lead = mesh.rank == 0
    # ---- setup
    run_dir.mkdir(parents=True, exist_ok=True)
    ckpt_root = run_dir / "checkpoints"
    optimizer = AdamW(
        params, beta1=loop.beta1, beta2=loop.beta2, eps=loop.eps, weight_decay=loop.weight_decay,
        grad_clip=loop.grad_clip,
        decay_mask=[decays(p.name, decay_norms_and_biases=loop.decay_norms_and_biases,
                           decay_embeddings=loop.decay_embeddings) for p in params],
        sharded=mesh.sharded(params), tp_group=mesh.tp_group,
    )
    step_fn = TrainStep(loss_fn, params, optimizer, accumulation=loop.gradient_accumulation,
                        dp_group=mesh.dp_group, dp=mesh.dp)
    fp16 = loop.precision == "fp16"
    scaler = DynamicLossScale(loop.loss_scale if fp16 else 1.0, window=loop.loss_scale_window, dynamic=fp16)
    eval_fn = ms.jit(loss_fn)
    opt_params = list(optimizer.exp_avg) + list(optimizer.exp_avg_sq)

    step, consumed, updates, skipped, consecutive, overflows = 0, 0, 0, 0, 0, 0
    history: list[dict[str, Any]] = []
    metrics_path = run_dir / "metrics.jsonl"
    latest = newest_checkpoint(ckpt_root) if loop.resume else None
    if latest is None and loop.load_checkpoint:
        latest = resolve_checkpoint(loop.load_checkpoint)
    if latest is not None:
        weights, opt_state, state = load_checkpoint(latest, tp=mesh.tp, tp_index=mesh.tp_index)
        _assign(params, weights, str(latest))
        _assign(opt_params, opt_state, str(latest))
        step, consumed, updates, skipped = state["step"], state["consumed_samples"], state["updates"], state["skipped_steps"]
        overflows = state.get("overflow_steps", 0)
        if fp16:
            scaler.load_state_dict(state)  # S and its good-step count: resume stays exact
        if consumed % mesh.dp:
            raise ValueError(f"{latest}: {consumed} samples consumed is not a multiple of data_parallel={mesh.dp}, "
                             "so the ranks cannot split the data position evenly; resume with a data_parallel "
                             "that divides it (e.g. 1)")
        history = [r for r in _read_jsonl(metrics_path) if r.get("step", 0) <= step]
        if not history and latest.parent != ckpt_root:  # continuing another run's checkpoint: its metrics too
            history = [r for r in _read_jsonl(latest.parent.parent / "metrics.jsonl") if r.get("step", 0) <= step]
        saved = state.get("layout", {})
        print(f"[train] resumed from {latest.name if latest.parent == ckpt_root else latest}: step {step}, {consumed} samples consumed (saved by dp="
              f"{saved.get('data_parallel', 1)} tp={saved.get('tensor_parallel', 1)}, now dp={mesh.dp} tp={mesh.tp})",
              file=sys.stderr)
    if lead:
        _write_jsonl(metrics_path, history)
    from tasks.tensorboard import open_run

    events = open_run(run_dir, history, meta, enabled=lead)  # TensorBoard: the same records, rewritten on resume
    peak = loop.peak_flops or measure_peak_flops()  # per rank: MFU divides by world × peak

    # under pure data parallel only rank 0 validates (the replicas are equal); tensor-parallel ranks all take part
    do_eval = valid is not None and (lead or mesh.tp > 1)
    if do_eval and step == 0:  # the starting point: shows what training (or continuing) changed
        v0 = evaluate_loss(eval_fn, valid(), loop.eval_batches)
        r0 = {"step": 0, "val_loss": v0, "val_ppl": math.exp(min(v0, 50))}
        history.append(r0)
        if lead:
            _append_jsonl(metrics_path, r0)
            events.write(r0)
        print(f"[train] step 0: val_loss {v0:.4f} (ppl {r0['val_ppl']:.1f})", file=sys.stderr, flush=True)

    # ---- fit
    per_step = loop.micro_batch_size * loop.gradient_accumulation * mesh.dp  # global samples per step
    it = batches(consumed)
    bar = _progress(loop, step) if lead else _NoBar()
    t_start, steps_here, last_loss, val_loss = time.perf_counter(), 0, float("nan"), None
    t_log, tok_log = time.perf_counter(), 0
    stopped = False
    while step < loop.max_steps:
        micro = [next(it) for _ in range(loop.gradient_accumulation)]
        lr = lr_at(step, lr=loop.lr, min_lr=loop.min_lr, warmup_steps=loop.warmup_steps,
                   max_steps=loop.max_steps, decay=loop.decay)
        scale = scaler.scale
        # fault hook: scale 0 -> grads / 0 -> non-finite
        loss, gnorm, finite = step_fn(micro, lr, updates + 1, 0.0 if step + 1 in loop.fault_steps else scale)
        if math.isfinite(loss):
            overflow = scaler.update(finite)  # fp16: a non-finite gradient while S > 1 halves S
        else:  # a non-finite forward is never a loss-scale overflow (S only scales the backward)
            finite, overflow, scaler.good_steps = False, False, 0
        step += 1
        steps_here += 1
        consumed += per_step
        tok_log += per_step * tokens_per_sample
        if finite:
            updates += 1
            consecutive = 0
            last_loss = loss
        elif overflow:
            overflows += 1
            print(f"[train] step {step}: gradient overflow at loss scale {scale:g}; update skipped, "
                  f"scale -> {scaler.scale:g}", file=sys.stderr)
        else:
            skipped += 1
            consecutive += 1
            print(f"[train] step {step}: non-finite loss/grad norm ({loss}, {gnorm}); update skipped "
                  f"({consecutive} in a row)", file=sys.stderr)
            if consecutive >= loop.max_nonfinite_steps:
                bar.close()
                good = newest_checkpoint(ckpt_root)
                raise NonFiniteError(
                    f"{consecutive} consecutive non-finite steps (limit pretrain.max_nonfinite_steps="
                    f"{loop.max_nonfinite_steps}) at step {step}; the last good checkpoint is "
                    f"{good or 'none (no checkpoint yet)'}; lower the learning rate or check the data"
                )
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        record: dict[str, Any] | None = None
        if step % loop.log_steps == 0 or step == loop.max_steps:
            now = time.perf_counter()
            tps = tok_log / max(now - t_log, 1e-9)
            eta = (loop.max_steps - step) * (now - t_start) / max(steps_here, 1)
            record = {"step": step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
                      "mfu": tps * flops_per_token / (peak * mesh.world), "peak_rss_bytes": peak_rss_bytes(), "eta_s": eta,
                      "consumed_samples": consumed, "skipped_steps": skipped}
            if fp16:
                record.update(loss_scale=scale, overflow_steps=overflows)
            t_log, tok_log = now, 0
        if do_eval and (step % loop.eval_steps == 0 or step == loop.max_steps):
            val_loss = evaluate_loss(eval_fn, valid(), loop.eval_batches)
            record = record or {"step": step, "loss": loss, "lr": lr}
            record.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
        if record is not None:
            history.append(record)
            if lead:
                _append_jsonl(metrics_path, record)
                events.write(record)
                bar.write(_format_record(record, loop.max_steps))
        if step % loop.save_steps == 0 or step == loop.max_steps:
            state = {"consumed_samples": consumed, "updates": updates, "skipped_steps": skipped,
                     "overflow_steps": overflows, "precision": loop.precision, **scaler.state_dict(),
                     "rng": {"data_seed": meta.get("seed"), "numpy": "order derived from seed+epoch"}, **meta}
            save_checkpoint(ckpt_root, step, _named_arrays(params), _named_arrays(opt_params), state,
                            loop.keep_checkpoint_max, mesh=mesh)
        if loop.stop_after is not None and steps_here >= loop.stop_after and step < loop.max_steps:
            stopped = True
            break
    bar.close()
    events.close()
    if mesh.dp > 1:
        digest = mesh.check_replicas(_named_arrays(params))
        print(f"[train] rank {mesh.rank}: parameters sha256 {digest} (equal on all {mesh.dp} data-parallel replicas)",
              file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - t_start
    initial_val = next((r["val_loss"] for r in history if r.get("step") == 0 and "val_loss" in r), None)
    return FitResult(steps=step, consumed_samples=consumed, final_loss=last_loss, val_loss=val_loss,
                     initial_val_loss=initial_val,
                     skipped_steps=skipped, tokens_per_s=steps_here * per_step * tokens_per_sample / max(elapsed, 1e-9),
                     history=history, stopped_early=stopped, overflow_steps=overflows, loss_scale=scaler.scale)


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
    from tqdm import tqdm

    return tqdm(total=loop.max_steps, initial=initial, desc="train", unit="step", file=sys.stderr,
                dynamic_ncols=True, mininterval=1.0)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    from tasks.artifacts import atomic_write_bytes

    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def _append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


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


__all__ = ["LoopConfig", "FitResult", "fit", "NonFiniteError", "plot_loss_curve", "evaluate_loss", "asdict"]
