"""Where a training run starts: the checkpoint it resumes (or continues) from, checked against this run, and
loaded into place. The mirror image of the trainer's `save` (tasks/training/trainer.py).

    latest = start_checkpoint(checkpoint_section, run_dir / "checkpoints")   # None: step 0
    state = restore(latest, mesh, params, optimizer, scaler, fp16, meta)         # weights, moments, S; state.json
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tasks.store.tensors import CheckpointError, assign
from tasks.training.checkpoint import load_checkpoint, newest_checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint dir (has state.json), or the newest good one under a checkpoints/ or run dir."""
    p = Path(path)
    if (p / "state.json").is_file():
        return p
    for root in (p, p / "checkpoints"):
        found = newest_checkpoint(root, good_only=True)
        if found is not None:
            return found
    raise ValueError(
        f"checkpoint.load_checkpoint: {p} holds no good training checkpoint (a step_* dir with state.json and "
        "finite weights); point it at one, or at a run's checkpoints/ dir"
    )


def start_checkpoint(checkpoint, ckpt_root: Path) -> Path | None:
    """The newest good checkpoint of this run (checkpoint.resume), else checkpoint.load_checkpoint, else None."""
    latest = newest_checkpoint(ckpt_root, good_only=True) if checkpoint.resume else None
    if latest is None and checkpoint.load_checkpoint:
        latest = resolve_checkpoint(checkpoint.load_checkpoint)
    return latest


def check_compatible(state: dict[str, Any], meta: dict[str, Any], ckpt: Path) -> None:
    """A checkpoint continues this run only if it has the same model config and tokenizer (both sides named)."""
    saved, want = state.get("model"), meta.get("model")
    if saved is not None and want is not None and saved != want:
        diff = sorted(k for k in set(saved) | set(want) if saved.get(k) != want.get(k))
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs this run {want.get(k)!r}" for k in diff[:4])
        raise CheckpointError(
            f"{ckpt}: model config differs from this run's ({detail}); load a checkpoint of this architecture or "
            "change the model section to match it"
        )
    saved_tok, want_tok = state.get("tokenizer_sha256"), meta.get("tokenizer_sha256")
    if saved_tok and want_tok and saved_tok != want_tok:
        raise CheckpointError(
            f"{ckpt}: trained with tokenizer sha256 {saved_tok[:12]}… but this run's data artifact uses "
            f"{want_tok[:12]}…; the token ids mean different pieces. Tokenize the data with the checkpoint's "
            "tokenizer (data.tokenizer.path) or start from scratch"
        )


def restore(latest: Path, mesh, params, optimizer, scaler, fp16: bool, meta: dict[str, Any]) -> dict[str, Any]:
    """Load `latest` into place: weights, the moments (this rank's share under ZeRO-1, from the full moments of
    any layout) and the loss scale (fp16: S and its good-step count, so a resume stays exact). Returns its
    state.json."""
    weights, opt_state, state = load_checkpoint(latest, tp=mesh.tp, tp_index=mesh.tp_index)
    check_compatible(state, meta, latest)
    assign(params, weights, str(latest))
    if mesh.zero:
        optimizer.load_full(opt_state, str(latest))
    else:
        assign(list(optimizer.exp_avg) + list(optimizer.exp_avg_sq), opt_state, str(latest))
    if fp16:
        scaler.load_state_dict(state)
    return state


def layout_line(latest: Path, ckpt_root: Path, state: dict[str, Any], mesh) -> str:
    """The resume's log line: where from, and the layout that saved it beside this run's."""
    saved = state.get("layout", {})
    shard = ", optimizer sharded"
    return (
        f"resumed from {latest.name if latest.parent == ckpt_root else latest}: step {state['step']}, "
        f"{state['consumed_samples']} samples consumed (saved by dp={saved.get('data_parallel', 1)} "
        f"tp={saved.get('tensor_parallel', 1)}{shard if 'optimizer_shard' in saved else ''}, "
        f"now dp={mesh.dp} tp={mesh.tp}{shard if mesh.zero else ''})"
    )
