"""Training checkpoints: self-describing, atomic, checksummed, rotated.

Layout of one checkpoint (a directory, complete only once `state.json` exists):

    checkpoints/step_00000100/
        model.safetensors       trainable parameters, by MindSpore parameter name
        optimizer.safetensors   AdamW moments (adam_m.*, adam_v.*)
        state.json              step, consumed samples, RNG, model config, tokenizer, sha256 of both files

Tensors are stored with safetensors (no pickle anywhere); metadata in JSON.
A checkpoint is written into `.tmp-step_*`, fsynced and renamed, so a crash
leaves either the previous set or a complete new one. Rotation keeps the
`keep` newest complete checkpoints and never deletes the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from tasks.artifacts import _fsync_dir, atomic_write_json, sha256_file

STATE = "state.json"


class CheckpointError(RuntimeError):
    pass


def _fsync_file(p: Path) -> None:
    with open(p, "rb") as f:
        os.fsync(f.fileno())


def save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> str:
    """Write a safetensors file atomically; returns its sha256."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
    _fsync_file(tmp)
    os.replace(tmp, path)
    return sha256_file(path)


def save_checkpoint(ckpt_root: Path, step: int, weights: dict[str, np.ndarray], optimizer: dict[str, np.ndarray],
                    state: dict[str, Any], keep: int) -> Path:
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final = ckpt_root / name
    tmp = ckpt_root / f".tmp-{name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        files = {
            "model.safetensors": save_tensors(tmp / "model.safetensors", weights),
            "optimizer.safetensors": save_tensors(tmp / "optimizer.safetensors", optimizer),
        }
        atomic_write_json(tmp / STATE, {**state, "step": step, "files": files, "complete": True})
        _fsync_dir(tmp)
        if final.exists():  # a re-run of the same step (after resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(ckpt_root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    rotate(ckpt_root, keep)
    return final


def read_state(ckpt: Path) -> dict[str, Any]:
    try:
        state = json.loads((ckpt / STATE).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{ckpt}: no readable {STATE} ({exc}); the checkpoint is incomplete") from None
    if not state.get("complete"):
        raise CheckpointError(f"{ckpt}: incomplete checkpoint")
    return state


def complete_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    if not ckpt_root.is_dir():
        return []
    out = []
    for d in sorted(ckpt_root.glob("step_*")):
        try:
            read_state(d)
            out.append(d)
        except CheckpointError:
            continue
    return out


def newest_checkpoint(ckpt_root: Path) -> Path | None:
    ck = complete_checkpoints(ckpt_root)
    return ck[-1] if ck else None


def rotate(ckpt_root: Path, keep: int) -> None:
    ck = complete_checkpoints(ckpt_root)
    for old in ck[: max(0, len(ck) - max(1, keep))]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def load_checkpoint(ckpt: Path) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """(weights, optimizer, state), each file checked against the sha256 in state.json."""
    state = read_state(ckpt)
    for fname, digest in state["files"].items():
        if sha256_file(ckpt / fname) != digest:
            raise CheckpointError(f"{ckpt / fname}: sha256 mismatch (corrupt); delete {ckpt} to resume from an older one")
    return load_file(str(ckpt / "model.safetensors")), load_file(str(ckpt / "optimizer.safetensors")), state


def load_weights(path: Path) -> dict[str, np.ndarray]:
    """Weights from a `model.safetensors` file, a checkpoint dir or an artifact dir."""
    p = Path(path)
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise CheckpointError(f"{path}: no model.safetensors found")
    return load_file(str(p))
