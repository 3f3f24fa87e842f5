"""The one training loop, shared by pretraining and fine-tuning (torchtitan's `Trainer`, LitGPT's `fit`).

    result = fit(Trainee(net, params, loss_fn, flops_per_token, kernels), cfg.pretrain.train,
                 TrainData(batches, valid, tokens_per_sample=seq), Sinks(run_dir, meta),
                 checkpoint=cfg.checkpoint, mesh=mesh)

`Trainer.train()` is the loop: `resume`, validate the starting point, then `step` → `report` (log, and
`validate` every eval_steps) → `save` to max_steps; `finish` returns a `FitResult`
(tasks/training/outcome.py). The loop's counters are one `LoopState`: what `save` writes to a checkpoint's
state.json and `resume` reads back (tasks/training/resume.py), so a resumed run's per-step losses equal an
uninterrupted run's bit for bit (everything is deterministic on CPU).

What each argument group holds:
- `Trainee`: the network, the parameters that train, the loss, the model FLOPs per token, and the build's kernel
  decision (tasks/modeling/build.py `Kernels`: the optimizer's in-place AdamW; None: MindSpore's own).
- the `train` section, whole (tasks.config.schema.TrainSection; LitGPT's TrainArgs, torchtitan's job_config): the
  optimizer and its parallel form (tasks/training/optimizer.py), the schedule (schedule.py), the loop, precision.
- `TrainData`: `batches(start_sample)` yields (input_ids [B, T] int32, labels [B, T] int32, -100 = no loss) from
  global sample `start_sample`, so a resumed run sees exactly the data it would have; `valid()` the held-out ones.
- `Sinks`: the run dir (checkpoints/, metrics.jsonl, TensorBoard events), the metadata every checkpoint carries,
  and whether a progress bar shows.

With a distributed `mesh` (tasks/runtime/distributed.py) every rank runs this with its own slice of the model and
its own data shard; rank 0 writes the metrics, replica 0 the checkpoints. MindSpore (with the step, the
optimizer and TensorBoard's writer, which load it) is imported inside the methods: the training stages'
parents import this module."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from tasks.runtime.mesh import Mesh
from tasks.training.checkpoint import save_checkpoint
from tasks.training.hardware import peak_rss_bytes, resolve_peak_flops
from tasks.training.metrics import NoBar, append_jsonl, format_record, progress, read_jsonl, write_jsonl
from tasks.training.outcome import FitResult, NonFiniteError, check_trustworthy, final_from_history, last_good
from tasks.training.resume import layout_line, restore, start_checkpoint
from tasks.training.schedule import lr_schedule, training_steps

Batches = Callable[[int], Iterator[tuple[np.ndarray, np.ndarray]]]


@dataclass
class Trainee:
    """What trains: the network, the parameters that train, its loss `loss_fn(ids, labels)`, and its cost."""

    net: Any
    params: list
    loss_fn: Callable
    flops_per_token: float
    kernels: Any = None
    """The build's kernel decision (tasks/modeling/build.py `Kernels`); None: MindSpore's own optimizer."""


@dataclass
class TrainData:
    batches: Batches
    valid: Callable[[], Iterator] | None
    tokens_per_sample: int


@dataclass
class Sinks:
    run_dir: Path
    meta: dict[str, Any]
    """Saved into every checkpoint's state.json (model config, tokenizer digest, seed, ...) and checked on resume."""
    progress: bool = True


@dataclass
class Hooks:
    """Test hooks (what a YAML file never sets)."""

    fault_steps: list[int] = field(default_factory=list)
    """Steps whose gradients are made non-finite (exercises the skip path)."""
    stop_after: int | None = None
    """Stop (as if killed) after this many steps of this process, leaving the checkpoints."""


@dataclass
class LoopState:
    """The loop's state. The counters are what a checkpoint's state.json saves and a resume restores (mirror
    images); the last three belong to this process's run only."""

    step: int = 0
    consumed: int = 0
    updates: int = 0
    skipped: int = 0
    """Non-finite steps (loss, gradient, or an update refused by the UpdateGuard): faults, not fp16 overflows."""
    consecutive: int = 0
    overflows: int = 0
    skipped_at_save: int = 0
    """`skipped` when the previous checkpoint was written: a checkpoint is good only if none happened since."""
    steps_here: int = 0
    last_loss: float = float("nan")
    val_loss: float | None = None

    def to_state(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed,
            "updates": self.updates,
            "skipped_steps": self.skipped,
            "overflow_steps": self.overflows,
            "good": self.skipped == self.skipped_at_save,
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LoopState:
        skipped = state["skipped_steps"]
        return cls(
            step=state["step"],
            consumed=state["consumed_samples"],
            updates=state["updates"],
            skipped=skipped,
            overflows=state.get("overflow_steps", 0),
            skipped_at_save=skipped,
        )


class StepOut(NamedTuple):
    loss: float
    grad_norm: float
    lr: float
    loss_scale: float


def fit(
    model: Trainee,
    train,
    data: TrainData,
    sinks: Sinks,
    *,
    checkpoint,
    mesh: Mesh | None = None,
    hooks: Hooks | None = None,
) -> FitResult:
    """Train `model` by `train` (a tasks.config.schema.TrainSection) and `checkpoint` (the checkpoint section:
    save_steps when train.loop has none, retention, resume, load_checkpoint).

    Raises NonFiniteError when the run cannot produce a trustworthy model: `max_nonfinite_steps` non-finite
    steps in a row (the message names the newest *good* checkpoint), no update applied at all, or a
    non-finite final validation loss. Nothing is published in those cases (the caller publishes after fit).
    """
    return Trainer(model, train, data, sinks, checkpoint, mesh or Mesh(), hooks or Hooks()).train()


class Trainer:
    """One run: built once (optimizer, compiled step, loss scale), then `train()`."""

    def __init__(self, model: Trainee, train, data: TrainData, sinks: Sinks, checkpoint, mesh: Mesh, hooks: Hooks):
        from tasks.training.layerwise import train_step
        from tasks.training.optimizer import parallelize_optimizer
        from tasks.training.step import DynamicLossScale, validation_fn

        self.model, self.data, self.sinks, self.checkpoint = model, data, sinks, checkpoint
        self.mesh, self.hooks = mesh, hooks
        self.lp, self.precision = train.loop, train.precision
        self.max_steps = training_steps(train.loop, data.tokens_per_sample)
        self.save_steps = train.loop.save_steps or checkpoint.save_steps  # a hand-built TrainSection may leave it
        self.lr_of = lr_schedule(train, self.max_steps)
        self.per_step = train.loop.micro_batch_size * train.loop.gradient_accumulation * mesh.dp  # global samples
        self.lead = mesh.rank == 0
        self.ckpt_root = sinks.run_dir / "checkpoints"
        self.metrics_path = sinks.run_dir / "metrics.jsonl"
        sinks.run_dir.mkdir(parents=True, exist_ok=True)
        in_place = model.kernels is not None and model.kernels.optimizer
        self.optimizer = parallelize_optimizer(model.params, train, mesh, in_place)  # AdamW, or ZeRO-1's
        # layer at a time where it applies (one layer's activations held), else the whole-model graph
        self.step_fn, how = train_step(
            model.net,
            model.loss_fn,
            model.params,
            self.optimizer,
            accumulation=train.loop.gradient_accumulation,
            mesh=mesh,
            layerwise=getattr(train, "layerwise", True),
        )
        self.log(f"step: {how}")
        self.fp16 = self.precision.dtype == "fp16"
        self.scaler = DynamicLossScale(
            self.precision.loss_scale if self.fp16 else 1.0, window=self.precision.loss_scale_window, dynamic=self.fp16
        )
        self.eval_fn = validation_fn(self.step_fn, model.loss_fn)
        # under pure data parallel only rank 0 validates (the replicas are equal); tensor-parallel ranks all do
        self.do_eval = data.valid is not None and (self.lead or mesh.tp > 1)
        self.opt_settings = train.optimizer  # the update guard's betas and weight decay

    def train(self) -> FitResult:
        """The loop."""
        self.resume()
        if self.state.step == 0:
            self.validate_start()
        batches = self.data.batches(self.state.consumed)
        self.bar = progress(self.sinks.progress, self.max_steps, self.state.step) if self.lead else NoBar()
        self.meter = Throughput()
        while self.state.step < self.max_steps:
            out = self.step([next(batches) for _ in range(self.lp.gradient_accumulation)])
            self.report(out)
            if self.state.step % self.save_steps == 0 or self.state.step == self.max_steps:
                self.save()
            if self.stop_requested():
                return self.finish(stopped=True)
        return self.finish(stopped=False)

    def log(self, line: str, lead_only: bool = True) -> None:
        if self.lead or not lead_only:
            print(f"[train] {line}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------- resume and save (mirror images)

    def resume(self) -> None:
        """Start from the newest good checkpoint of this run, or checkpoint.load_checkpoint, or step 0; open the
        metrics sinks with the history up to that step; the update guard and the MFU denominator."""
        from tasks.store.tensorboard import open_run
        from tasks.training.adamw import UpdateGuard

        mesh, params = self.mesh, self.model.params
        self.state, self.history = LoopState(), []
        latest = start_checkpoint(self.checkpoint, self.ckpt_root)
        if latest is not None:
            state = restore(latest, mesh, params, self.optimizer, self.scaler, self.fp16, self.sinks.meta)
            self.state = LoopState.from_state(state)
            if self.state.consumed % mesh.dp:
                raise ValueError(
                    f"{latest}: {self.state.consumed} samples consumed is not a multiple of data_parallel="
                    f"{mesh.dp}, so the ranks cannot split the data position evenly; resume with a data_parallel "
                    "that divides it (e.g. 1)"
                )
            self.history = self._history_until(latest, self.state.step)
            print(f"[train] {layout_line(latest, self.ckpt_root, state, mesh)}", file=sys.stderr)
        if mesh.zero:
            self.optimizer.sync_master()  # the master share follows the (possibly loaded) weights
        if self.lead:
            write_jsonl(self.metrics_path, self.history)
        self.events = open_run(self.sinks.run_dir, self.history, self.sinks.meta, enabled=self.lead)
        o = self.opt_settings
        self.guard = UpdateGuard(
            UpdateGuard.max_abs(p.asnumpy() for p in params), beta1=o.beta1, beta2=o.beta2, weight_decay=o.weight_decay
        )
        self.peak = resolve_peak_flops(self.lp.peak_flops)  # per rank: MFU divides by world × peak
        self.log(f"MFU denominator: {self.peak.describe()}")

    def _history_until(self, latest: Path, step: int) -> list[dict[str, Any]]:
        """metrics.jsonl up to `step`; continuing another (checked compatible) run: its metrics."""
        history = [r for r in read_jsonl(self.metrics_path) if r.get("step", 0) <= step]
        if not history and latest.parent != self.ckpt_root:
            history = [r for r in read_jsonl(latest.parent.parent / "metrics.jsonl") if r.get("step", 0) <= step]
        return history

    def save(self) -> None:
        """Checkpoint the loop: weights, moments (under ZeRO-1 each rank its share), counters, loss scale; marked
        good only with finite weights and no non-finite step since the previous checkpoint."""
        st, mesh = self.state, self.mesh
        weights = _named_arrays(self.model.params)
        if mesh.zero:
            moments = self.optimizer.shard_state()
        else:
            moments = _named_arrays(list(self.optimizer.exp_avg) + list(self.optimizer.exp_avg_sq))
        state = {
            **st.to_state(),
            "precision": self.precision.dtype,
            **self.scaler.state_dict(),
            "rng": {"data_seed": self.sinks.meta.get("seed"), "numpy": "order derived from seed+epoch"},
            **self.sinks.meta,
        }
        if mesh.tp == 1 and not all(np.isfinite(a).all() for a in (*weights.values(), *moments.values())):
            # cannot happen while the UpdateGuard holds; never write a checkpoint a resume could pick up
            raise NonFiniteError(
                f"step {st.step}: the weights or optimizer moments are non-finite; not "
                f"checkpointed. The last good checkpoint is {last_good(self.ckpt_root)}"
            )
        save_checkpoint(
            self.ckpt_root,
            st.step,
            weights,
            moments,
            state,
            self.checkpoint.keep_checkpoint_max,
            mesh=mesh,
            opt_shard=self.optimizer.layout() if mesh.zero else None,
        )
        st.skipped_at_save = st.skipped

    # ------------------------------------------------------------------------- one step, its report

    def step(self, micro: list) -> StepOut:
        """One train step and its counters: applied, overflowed (fp16), or skipped."""
        st, scaler, guard = self.state, self.scaler, self.guard
        lr, scale = self.lr_of(st.step), scaler.scale
        allow = guard.allows(lr, st.updates + 1)
        faulted = st.step + 1 in self.hooks.fault_steps  # test hook: scale 0 -> grads / 0 -> non-finite
        loss, gnorm, finite = self.step_fn(micro, lr, st.updates + 1, 0.0 if faulted else scale, allow=allow)
        if math.isfinite(loss):
            overflow = scaler.update(finite)  # fp16: a non-finite gradient while S > 1 halves S
        else:  # a non-finite forward is never a loss-scale overflow (S only scales the backward)
            finite, overflow, scaler.good_steps = False, False, 0
        st.step += 1
        st.steps_here += 1
        st.consumed += self.per_step
        self.meter.tokens += self.per_step * self.data.tokens_per_sample
        if finite and allow:
            guard.applied(lr, st.updates + 1)
            st.updates += 1
            st.consecutive = 0
            st.last_loss = loss
        elif overflow:
            st.overflows += 1
            print(
                f"[train] step {st.step}: gradient overflow at loss scale {scale:g}; update skipped, "
                f"scale -> {scaler.scale:g}",
                file=sys.stderr,
            )
        else:
            self._skipped(loss, gnorm, lr, finite)
        return StepOut(loss, gnorm, lr, scale)

    def _skipped(self, loss: float, gnorm: float, lr: float, finite: bool) -> None:
        st = self.state
        st.skipped += 1
        st.consecutive += 1
        if not finite:
            why = f"non-finite loss/grad norm ({loss}, {gnorm})"
        else:
            bound = self.guard._next_bound(lr, st.updates + 1)
            why = f"the update at lr {lr:.3g} could make weights non-finite (|w| bound {bound:.3g})"
        print(f"[train] step {st.step}: {why}; update skipped ({st.consecutive} in a row)", file=sys.stderr)
        if st.consecutive >= self.lp.max_nonfinite_steps:
            self.bar.close()
            raise NonFiniteError(
                f"{st.consecutive} consecutive non-finite steps (limit train.loop.max_nonfinite_steps="
                f"{self.lp.max_nonfinite_steps}) at step {st.step}; the last good checkpoint is "
                f"{last_good(self.ckpt_root)}; lower the learning rate or check the data"
            )

    def report(self, out: StepOut) -> None:
        """The step's metrics record (every log_steps), with a validation loss (every eval_steps), written out."""
        st, lp = self.state, self.lp
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{out.loss:.4f}", lr=f"{out.lr:.2e}")
        last = st.step == self.max_steps
        record: dict[str, Any] | None = None
        if st.step % lp.log_steps == 0 or last:
            record = self._train_record(out)
        if self.do_eval and (st.step % lp.eval_steps == 0 or last):
            record = record or {"step": st.step, "loss": out.loss, "lr": out.lr}
            record.update(self.validate())
        if record is not None:
            self._write(record)

    def _train_record(self, out: StepOut) -> dict[str, Any]:
        st = self.state
        tps, elapsed = self.meter.window()
        record = {
            "step": st.step,
            "loss": out.loss,
            "lr": out.lr,
            "grad_norm": out.grad_norm,
            "tokens_per_s": tps,
            "mfu": tps * self.model.flops_per_token / (self.peak.flops * self.mesh.world),
            "peak_rss_bytes": peak_rss_bytes(),
            "eta_s": (self.max_steps - st.step) * elapsed / max(st.steps_here, 1),
            "consumed_samples": st.consumed,
            "skipped_steps": st.skipped,
        }
        if self.fp16:
            record.update(loss_scale=out.loss_scale, overflow_steps=st.overflows)
        return record

    def _write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        if self.lead:
            append_jsonl(self.metrics_path, record)
            self.events.write(record)
            self.bar.write(format_record(record, self.max_steps))

    # ------------------------------------------------------------------------- validation

    def validate(self) -> dict[str, float]:
        """The held-out loss now (token-weighted over train.loop.eval_batches batches), and its perplexity."""
        self.state.val_loss = evaluate_loss(self.eval_fn, self.data.valid(), self.lp.eval_batches)
        return {"val_loss": self.state.val_loss, "val_ppl": _ppl(self.state.val_loss)}

    def validate_start(self) -> None:
        """The starting point's validation record (step 0): shows what training (or continuing) changed."""
        if not self.do_eval:
            return
        r0 = {"step": 0, **self.validate()}
        self.state.val_loss = None
        self.history.append(r0)
        if self.lead:
            append_jsonl(self.metrics_path, r0)
            self.events.write(r0)
        print(f"[train] step 0: val_loss {r0['val_loss']:.4f} (ppl {r0['val_ppl']:.1f})", file=sys.stderr, flush=True)

    # ------------------------------------------------------------------------- the end

    def stop_requested(self) -> bool:
        """hooks.stop_after: stop (as if killed) after that many steps of this process, before the end."""
        stop_after = self.hooks.stop_after
        return stop_after is not None and self.state.steps_here >= stop_after and self.state.step < self.max_steps

    def finish(self, stopped: bool) -> FitResult:
        """Close the sinks, check the replicas agree; the FitResult, or NonFiniteError for an untrustworthy run."""
        st = self.state
        self.bar.close()
        self.events.close()
        if self.mesh.dp > 1:
            self._check_replicas()
        if not stopped and st.steps_here == 0:  # resumed at max_steps (killed after the last checkpoint)
            st.last_loss, st.val_loss = final_from_history(self.history, st.step, st.last_loss, st.val_loss)
            if st.val_loss is None and self.do_eval:  # its validation record was lost with the kill: measure again
                self.validate()
        if not stopped:
            check_trustworthy(st.step, st.updates, st.overflows, st.val_loss, self.ckpt_root, self.fp16)
        initial_val = next((r["val_loss"] for r in self.history if r.get("step") == 0 and "val_loss" in r), None)
        tokens = st.steps_here * self.per_step * self.data.tokens_per_sample
        return FitResult(
            steps=st.step,
            consumed_samples=st.consumed,
            final_loss=st.last_loss,
            val_loss=st.val_loss,
            initial_val_loss=initial_val,
            skipped_steps=st.skipped,
            tokens_per_s=tokens / max(self.meter.elapsed(), 1e-9),
            history=self.history,
            stopped_early=stopped,
            overflow_steps=st.overflows,
            loss_scale=self.scaler.scale,
            updates=st.updates,
        )

    def _check_replicas(self) -> None:
        mesh = self.mesh
        digest = mesh.check_replicas(_named_arrays(self.model.params))
        self.log(
            f"rank {mesh.rank}: parameters sha256 {digest} (equal on all {mesh.dp} data-parallel replicas)",
            lead_only=False,
        )
        sharded = " (optimizer state sharded)" if mesh.zero else ""
        self.log(f"rank {mesh.rank}: peak RSS {peak_rss_bytes()} bytes{sharded}", lead_only=False)


class Throughput:
    """Tokens per second over each log window, and the time since the loop started (for the ETA)."""

    def __init__(self):
        self.t_start = self.t_window = time.perf_counter()
        self.tokens = 0

    def window(self) -> tuple[float, float]:
        """(tokens/s since the previous window, seconds since the start); starts the next window."""
        now = time.perf_counter()
        tps = self.tokens / max(now - self.t_window, 1e-9)
        self.t_window, self.tokens = now, 0
        return tps, now - self.t_start

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start


def _named_arrays(params) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in params}


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
