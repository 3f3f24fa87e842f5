"""The one training loop, shared by pretraining and fine-tuning.

Reads top-down: `fit()` sets up (optimizer, compiled step, resume), then loops
step → log → validate → checkpoint, and returns a summary. The caller owns the
network, which parameters train, the loss and the batches:

    result = fit(net, params, loss_fn, cfg.pretrain.train, checkpoint=cfg.checkpoint,
                 batches=lambda start: iterator, valid=lambda: iterator, run_dir=Path(...), meta={...},
                 flops_per_token=..., tokens_per_sample=seq, mesh=mesh)

The `train` section travels whole (LitGPT's TrainArgs, torchtitan's job_config): the optimizer and its
parallel form come from it and the mesh (tasks/modeling/parallelize.py), the schedule from schedule.py.

`batches(start_sample)` yields (input_ids [B, T] int32, labels [B, T] int32, -100 = no loss)
starting at global sample `start_sample`, so a resumed run sees exactly the data
it would have seen. Checkpoints go to `run_dir/checkpoints`, metrics to
`run_dir/metrics.jsonl`. Everything is deterministic on CPU: a resumed run's
per-step losses equal an uninterrupted run's bit for bit.

MindSpore (with the step, the optimizer and TensorBoard's writer, which load it) is imported inside the run's
functions (lazy): the training stages' parents import this module.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from tasks.training.checkpoint import load_checkpoint, newest_checkpoint, save_checkpoint
from tasks.store.tensors import CheckpointError, assign
from tasks.training.hardware import peak_rss_bytes, resolve_peak_flops
from tasks.runtime.mesh import Mesh
from tasks.training.metrics import NoBar, append_jsonl, format_record, progress, read_jsonl, write_jsonl
from tasks.training.schedule import lr_schedule, training_steps

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]


class NonFiniteError(RuntimeError):
    """The run went non-finite (or applied no update): a retry from the same checkpoint would too."""

    permanent = True


@dataclass
class LoopConfig:
    """Run-time hooks of one `fit` call (what a YAML file never sets): the settings travel whole as the
    `train` section (tasks.config.schema.TrainSection) and the `checkpoint` section."""

    progress: bool = True
    fault_steps: list[int] = field(default_factory=list)
    """Test hook: steps whose gradients are made non-finite (exercises the skip path)."""
    stop_after: int | None = None
    """Stop (as if killed) after this many steps of this process, leaving the checkpoints."""


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

    def manifest_metrics(self) -> dict[str, Any]:
        """The run's results as every training stage's manifest writes them: one set of names (pretrain,
        continued pretraining and finetuning alike; scripts/demo.py and the model card read these)."""
        return {"steps": self.steps, "consumed_samples": self.consumed_samples, "final_train_loss": self.final_loss,
                "initial_val_loss": self.initial_val_loss, "val_loss": self.val_loss,
                "skipped_steps": self.skipped_steps, "overflow_steps": self.overflow_steps,
                "final_loss_scale": self.loss_scale, "tokens_per_s": self.tokens_per_s}


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


def _resume(checkpoint, fp16: bool, mesh, ckpt_root: Path, params, optimizer, opt_params, scaler,
            meta: dict[str, Any], metrics_path: Path) -> tuple[LoopState, list[dict[str, Any]]]:
    """Where training starts: the newest good checkpoint of this run (checkpoint.resume), else
    checkpoint.load_checkpoint, else step 0. Loads weights, moments (this rank's share under ZeRO-1), the
    loss scale and the counters into place, and returns the counters with the metrics history up to them."""
    st, history = LoopState(), []
    latest = newest_checkpoint(ckpt_root, good_only=True) if checkpoint.resume else None
    if latest is None and checkpoint.load_checkpoint:
        latest = resolve_checkpoint(checkpoint.load_checkpoint)
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
        history = [r for r in read_jsonl(metrics_path) if r.get("step", 0) <= st.step]
        if not history and latest.parent != ckpt_root:  # continuing another (checked compatible) run: its metrics too
            history = [r for r in read_jsonl(latest.parent.parent / "metrics.jsonl") if r.get("step", 0) <= st.step]
        saved = state.get("layout", {})
        print(f"[train] resumed from {latest.name if latest.parent == ckpt_root else latest}: step {st.step}, "
              f"{st.consumed} samples consumed (saved by dp={saved.get('data_parallel', 1)} "
              f"tp={saved.get('tensor_parallel', 1)}{', optimizer sharded' if 'optimizer_shard' in saved else ''}, "
              f"now dp={mesh.dp} tp={mesh.tp}{', optimizer sharded' if mesh.zero else ''})", file=sys.stderr)
    return st, history


def fit(net, params, loss_fn, train, *, checkpoint, batches: Batches, valid: Callable[[], Iterator] | None,
        run_dir: Path, meta: dict[str, Any], flops_per_token: float, tokens_per_sample: int, mesh=None,
        hooks: LoopConfig | None = None, kernels=None) -> FitResult:
    """Train by `train` (a tasks.config.schema.TrainSection: optimizer, schedule, loop, precision, fused_kernels, handed
    whole) and `checkpoint` (the checkpoint section: save_steps when train.loop has none, retention, resume,
    load_checkpoint); `hooks` are the run-time test hooks; `kernels` the build's kernel decision
    (tasks/modeling/build.py `Kernels`: the optimizer's in-place AdamW; None: MindSpore's own). With a distributed `mesh` (tasks/runtime/distributed.py) every rank calls this with its own slice of the
    model and `batches` yielding its own data shard; rank 0 writes the metrics, replica 0 the checkpoints.

    Raises NonFiniteError when the run cannot produce a trustworthy model: `max_nonfinite_steps` non-finite
    steps in a row (the message names the newest *good* checkpoint), no update applied at all, or a
    non-finite final validation loss. Nothing is published in those cases (the caller publishes after fit).
    """
    run = _Run(net, params, loss_fn, train, checkpoint, run_dir, meta, flops_per_token, tokens_per_sample,
               mesh or Mesh(), hooks or LoopConfig(), valid, kernels is not None and kernels.optimizer)
    run.start()
    return run.finish(stopped=run.loop(batches))


class _Run:
    """One `fit` call: setup (optimizer, compiled step, loss scale), then its loop's state and parts."""

    def __init__(self, net, params, loss_fn, train, checkpoint, run_dir: Path, meta: dict[str, Any], flops_per_token: float,
                 tokens_per_sample: int, mesh, hooks: LoopConfig, valid: Callable[[], Iterator] | None,
                 in_place: bool):
        from tasks.training.layerwise import train_step
        from tasks.training.optimizer import parallelize_optimizer
        from tasks.training.step import DynamicLossScale, validation_fn

        self.params, self.checkpoint, self.run_dir, self.meta, self.mesh, self.hooks, self.valid = \
            params, checkpoint, run_dir, meta, mesh, hooks, valid
        self.flops_per_token, self.tokens_per_sample = flops_per_token, tokens_per_sample
        lp, pr = train.loop, train.precision
        self.lp, self.o, self.pr, self.max_steps = lp, train.optimizer, pr, training_steps(lp, tokens_per_sample)
        self.save_steps = lp.save_steps or checkpoint.save_steps  # a hand-built TrainSection may leave it unset
        self.lr_of = lr_schedule(train, self.max_steps)
        self.lead = mesh.rank == 0
        run_dir.mkdir(parents=True, exist_ok=True)
        self.ckpt_root = run_dir / "checkpoints"
        self.optimizer = parallelize_optimizer(params, train, mesh, in_place)  # AdamW, or ZeRO-1's ShardedAdamW
        # layer at a time where it applies (one layer's activations held), else the whole-model graph
        self.step_fn, how = train_step(net, loss_fn, params, self.optimizer, accumulation=lp.gradient_accumulation,
                                       mesh=mesh, layerwise=getattr(train, "layerwise", False))
        if self.lead:
            print(f"[train] step: {how}", file=sys.stderr, flush=True)
        self.fp16 = fp16 = pr.dtype == "fp16"
        self.scaler = DynamicLossScale(pr.loss_scale if fp16 else 1.0, window=pr.loss_scale_window, dynamic=fp16)
        self.eval_fn = validation_fn(self.step_fn, loss_fn)
        self.opt_params = list(self.optimizer.exp_avg) + list(self.optimizer.exp_avg_sq)
        self.metrics_path = run_dir / "metrics.jsonl"
        self.per_step = lp.micro_batch_size * lp.gradient_accumulation * mesh.dp  # global samples per step

    def start(self) -> None:
        """Resume (the mirror image of the save in `loop`), open the metrics sinks, validate the starting point."""
        from tasks.training.adamw import UpdateGuard
        from tasks.store.tensorboard import open_run

        mesh, o = self.mesh, self.o
        self.st, self.history = _resume(self.checkpoint, self.fp16, mesh, self.ckpt_root, self.params, self.optimizer,
                                        self.opt_params, self.scaler, self.meta, self.metrics_path)
        if mesh.zero:
            self.optimizer.sync_master()  # the master share follows the (possibly loaded) weights
        if self.lead:
            write_jsonl(self.metrics_path, self.history)
        self.events = open_run(self.run_dir, self.history, self.meta, enabled=self.lead)  # TensorBoard, as history
        self.guard = UpdateGuard(UpdateGuard.max_abs(p.asnumpy() for p in self.params), beta1=o.beta1, beta2=o.beta2,
                                 weight_decay=o.weight_decay)
        self.peak = resolve_peak_flops(self.lp.peak_flops)  # per rank: MFU divides by world × peak
        if self.lead:
            print(f"[train] MFU denominator: {self.peak.describe()}", file=sys.stderr, flush=True)
        # under pure data parallel only rank 0 validates (the replicas are equal); tensor-parallel ranks all take part
        self.do_eval = self.valid is not None and (self.lead or mesh.tp > 1)
        if self.do_eval and self.st.step == 0:  # the starting point: shows what training (or continuing) changed
            v0 = evaluate_loss(self.eval_fn, self.valid(), self.lp.eval_batches)
            r0 = {"step": 0, "val_loss": v0, "val_ppl": _ppl(v0)}
            self.history.append(r0)
            if self.lead:
                append_jsonl(self.metrics_path, r0)
                self.events.write(r0)
            print(f"[train] step 0: val_loss {v0:.4f} (ppl {r0['val_ppl']:.1f})", file=sys.stderr, flush=True)

    def loop(self, batches: Batches) -> bool:
        """The loop: step → log → validate → save, to max_steps; True when stopped early (hooks.stop_after)."""
        st, lp = self.st, self.lp
        it = batches(st.consumed)
        self.bar = progress(self.hooks.progress, self.max_steps, st.step) if self.lead else NoBar()
        self.t_start, self.steps_here, self.last_loss, self.val_loss = time.perf_counter(), 0, float("nan"), None
        self.t_log, self.tok_log = time.perf_counter(), 0
        while st.step < self.max_steps:
            loss, gnorm, lr, scale = self._step([next(it) for _ in range(lp.gradient_accumulation)])
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
            self._record(loss, gnorm, lr, scale)
            if st.step % self.save_steps == 0 or st.step == self.max_steps:
                _save(self.ckpt_root, st, self.params, self.optimizer if self.mesh.zero else self.opt_params,
                      self.scaler, self.pr.dtype, self.checkpoint.keep_checkpoint_max, self.meta, self.mesh)
            stop_after = self.hooks.stop_after
            if stop_after is not None and self.steps_here >= stop_after and st.step < self.max_steps:
                return True
        return False

    def _step(self, micro: list) -> tuple[float, float, float, float]:
        """One train step and its counters (applied, overflowed, or skipped); (loss, grad norm, lr, loss scale)."""
        st, scaler, guard = self.st, self.scaler, self.guard
        lr = self.lr_of(st.step)
        scale = scaler.scale
        allow = guard.allows(lr, st.updates + 1)
        # fault hook: scale 0 -> grads / 0 -> non-finite
        loss, gnorm, finite = self.step_fn(micro, lr, st.updates + 1,
                                           0.0 if st.step + 1 in self.hooks.fault_steps else scale, allow=allow)
        if math.isfinite(loss):
            overflow = scaler.update(finite)  # fp16: a non-finite gradient while S > 1 halves S
        else:  # a non-finite forward is never a loss-scale overflow (S only scales the backward)
            finite, overflow, scaler.good_steps = False, False, 0
        st.step += 1
        self.steps_here += 1
        st.consumed += self.per_step
        self.tok_log += self.per_step * self.tokens_per_sample
        if finite and allow:
            guard.applied(lr, st.updates + 1)
            st.updates += 1
            st.consecutive = 0
            self.last_loss = loss
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
            if st.consecutive >= self.lp.max_nonfinite_steps:
                self.bar.close()
                raise NonFiniteError(
                    f"{st.consecutive} consecutive non-finite steps (limit train.loop.max_nonfinite_steps="
                    f"{self.lp.max_nonfinite_steps}) at step {st.step}; the last good checkpoint is "
                    f"{newest_checkpoint(self.ckpt_root, good_only=True) or 'none (no good checkpoint yet)'}; "
                    "lower the learning rate or check the data")
        return loss, gnorm, lr, scale

    def _record(self, loss: float, gnorm: float, lr: float, scale: float) -> None:
        """The step's metrics record (every log_steps), with a validation loss (every eval_steps), written out."""
        st, lp, max_steps = self.st, self.lp, self.max_steps
        record: dict[str, Any] | None = None
        if st.step % lp.log_steps == 0 or st.step == max_steps:
            now = time.perf_counter()
            tps = self.tok_log / max(now - self.t_log, 1e-9)
            eta = (max_steps - st.step) * (now - self.t_start) / max(self.steps_here, 1)
            record = {"step": st.step, "loss": loss, "lr": lr, "grad_norm": gnorm, "tokens_per_s": tps,
                      "mfu": tps * self.flops_per_token / (self.peak.flops * self.mesh.world),
                      "peak_rss_bytes": peak_rss_bytes(), "eta_s": eta, "consumed_samples": st.consumed,
                      "skipped_steps": st.skipped}
            if self.fp16:
                record.update(loss_scale=scale, overflow_steps=st.overflows)
            self.t_log, self.tok_log = now, 0
        if self.do_eval and (st.step % lp.eval_steps == 0 or st.step == max_steps):
            self.val_loss = evaluate_loss(self.eval_fn, self.valid(), lp.eval_batches)
            record = record or {"step": st.step, "loss": loss, "lr": lr}
            record.update(val_loss=self.val_loss, val_ppl=_ppl(self.val_loss))
        if record is not None:
            self.history.append(record)
            if self.lead:
                append_jsonl(self.metrics_path, record)
                self.events.write(record)
                self.bar.write(format_record(record, max_steps))

    def finish(self, stopped: bool) -> FitResult:
        """Close the sinks, check the replicas agree; the FitResult, or NonFiniteError for an untrustworthy run."""
        mesh, st = self.mesh, self.st
        self.bar.close()
        self.events.close()
        if mesh.dp > 1:
            digest = mesh.check_replicas(_named_arrays(self.params))
            print(f"[train] rank {mesh.rank}: parameters sha256 {digest} (equal on all {mesh.dp} data-parallel replicas)",
                  file=sys.stderr, flush=True)
            print(f"[train] rank {mesh.rank}: peak RSS {peak_rss_bytes()} bytes"
                  f"{' (optimizer state sharded)' if mesh.zero else ''}", file=sys.stderr, flush=True)
        if not stopped and self.steps_here == 0:  # resumed at max_steps (killed after the last checkpoint, before publishing)
            self.last_loss, self.val_loss = _final_from_history(self.history, st.step, self.last_loss, self.val_loss)
            if self.val_loss is None and self.do_eval:  # its validation record was lost with the kill: measure it again
                self.val_loss = evaluate_loss(self.eval_fn, self.valid(), self.lp.eval_batches)
        if not stopped:
            _check_trustworthy(st, self.val_loss, self.ckpt_root, self.fp16)
        elapsed = time.perf_counter() - self.t_start
        initial_val = next((r["val_loss"] for r in self.history if r.get("step") == 0 and "val_loss" in r), None)
        return FitResult(steps=st.step, consumed_samples=st.consumed, final_loss=self.last_loss, val_loss=self.val_loss,
                         initial_val_loss=initial_val, skipped_steps=st.skipped,
                         tokens_per_s=self.steps_here * self.per_step * self.tokens_per_sample / max(elapsed, 1e-9),
                         history=self.history, stopped_early=stopped, overflow_steps=st.overflows,
                         loss_scale=self.scaler.scale, updates=st.updates)


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


def _save(ckpt_root: Path, st: LoopState, params, opt_params, scaler, precision: str, keep: int,
          meta: dict[str, Any], mesh) -> None:
    """Checkpoint the loop: weights, moments, counters; marked good only with finite weights and no
    non-finite step since the previous checkpoint (resume and the error messages use good ones only).
    Under ZeRO-1 `opt_params` is the ShardedAdamW: every rank writes its own share of the moments."""
    opt_shard = opt_params.layout() if mesh.zero else None
    weights = _named_arrays(params)
    moments = opt_params.shard_state() if mesh.zero else _named_arrays(opt_params)
    state = {**st.to_state(), "precision": precision, **scaler.state_dict(),
             "rng": {"data_seed": meta.get("seed"), "numpy": "order derived from seed+epoch"}, **meta}
    if mesh.tp == 1 and not all(np.isfinite(a).all() for a in (*weights.values(), *moments.values())):
        # cannot happen while the UpdateGuard holds; never write a checkpoint a resume could pick up
        raise NonFiniteError(f"step {st.step}: the weights or optimizer moments are non-finite; not checkpointed. "
                             f"The last good checkpoint is {newest_checkpoint(ckpt_root, good_only=True) or 'none'}")
    save_checkpoint(ckpt_root, st.step, weights, moments, state, keep, mesh=mesh,
                    opt_shard=opt_shard)
    st.skipped_at_save = st.skipped


def _check_trustworthy(st: LoopState, val_loss: float | None, ckpt_root: Path, fp16: bool) -> None:
    """A finished run publishes only if it changed the model and its final validation loss is finite."""
    if st.updates == 0:
        why = ("every step overflowed in fp16 (the loss scale fell to its floor without a finite step); "
               "raise train.precision.loss_scale_window or train in fp32" if fp16 and st.overflows else
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


def run_outcome(result: FitResult, mesh, run_dir: Path) -> Path | None | bool:
    """What a training stage returns after `fit` when it does not publish: None when stopped on request
    (tests: checkpoints stay, no artifact), `run_dir` on ranks other than 0; True when this rank publishes."""
    if result.stopped_early:
        return None
    if mesh.rank != 0:
        return run_dir
    return True


__all__ = ["LoopConfig", "FitResult", "fit", "run_outcome", "NonFiniteError", "evaluate_loss"]
