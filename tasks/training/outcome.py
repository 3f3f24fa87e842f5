"""What a training run returns (`FitResult`), and when it must not publish (`NonFiniteError`): a run that
applied no update, or whose final validation loss is not finite, produces no model."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.training.checkpoint import newest_checkpoint


class NonFiniteError(RuntimeError):
    """The run went non-finite (or applied no update): a retry from the same checkpoint would too."""

    permanent = True


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
        return {
            "steps": self.steps,
            "consumed_samples": self.consumed_samples,
            "final_train_loss": self.final_loss,
            "initial_val_loss": self.initial_val_loss,
            "val_loss": self.val_loss,
            "skipped_steps": self.skipped_steps,
            "overflow_steps": self.overflow_steps,
            "final_loss_scale": self.loss_scale,
            "tokens_per_s": self.tokens_per_s,
        }


def last_good(ckpt_root: Path) -> str:
    """The newest good checkpoint, as the error messages name it."""
    return str(newest_checkpoint(ckpt_root, good_only=True) or "none (no good checkpoint yet)")


def check_trustworthy(
    step: int, updates: int, overflows: int, val_loss: float | None, ckpt_root: Path, fp16: bool
) -> None:
    """A finished run publishes only if it changed the model and its final validation loss is finite."""
    if updates == 0:
        why = (
            "every step overflowed in fp16 (the loss scale fell to its floor without a finite step); "
            "raise train.precision.loss_scale_window or train in fp32"
            if fp16 and overflows
            else "every step was non-finite or refused; lower the learning rate or check the data"
        )
        raise NonFiniteError(f"no update was applied in {step} steps: {why}. Nothing is published")
    if val_loss is not None and not math.isfinite(val_loss):
        raise NonFiniteError(
            f"the final validation loss is {val_loss} after {step} steps; the model is not usable and is not "
            f"published. The last good checkpoint is {last_good(ckpt_root)}; lower the learning rate"
        )


def final_from_history(
    history: list[dict[str, Any]], step: int, loss: float, val_loss: float | None
) -> tuple[float, float | None]:
    """The final train loss and validation loss of a run that resumed with nothing left to train: the
    metrics records of its last step (a kill may have torn or lost them: then what was passed in)."""
    for r in reversed(history):
        if r.get("step") == step and isinstance(r.get("val_loss"), (int, float)) and val_loss is None:
            val_loss = float(r["val_loss"])
        if not math.isfinite(loss) and isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]):
            loss = float(r["loss"])
    return loss, val_loss


def run_outcome(result: FitResult, mesh, run_dir: Path) -> Path | None | bool:
    """What a training stage returns after `fit` when it does not publish: None when stopped on request
    (tests: checkpoints stay, no artifact), `run_dir` on ranks other than 0; True when this rank publishes."""
    if result.stopped_early:
        return None
    if mesh.rank != 0:
        return run_dir
    return True
