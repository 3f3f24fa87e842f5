"""Tensor files: safetensors read and written atomically, weights loaded by name (no pickle anywhere).

    sha = save_tensors(path, {"w": array})          # temp file beside it, fsync, rename; returns its sha256
    arrays = read_tensors(path, fix="rerun X")      # CheckpointError naming the file when it is not safetensors
    weights = load_weights(artifact_dir)            # model.safetensors of a model artifact, checked vs its manifest
                                                    # and finite (CheckpointError naming a NaN/Inf tensor)
    assign(net.trainable_params(), weights, what)   # every parameter by name and shape (MindSpore imported here only)

The store's model artifacts, the training checkpoints (tasks/training/checkpoint.py), the convert and finetune
stages and the server's adapters all read and write weights through these functions. A training checkpoint
directory (state.json, any parallel layout) is read with `tasks.training.checkpoint.load_checkpoint`.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from model.convert import nonfinite
from tasks.store.disk import sha256_file
from tasks.store.published import verify_published
from tasks.store.errors import STORAGE_ERRNOS, as_os_error, storage_error


class CheckpointError(RuntimeError):
    """A checkpoint or weights file is incomplete, corrupt, or belongs to another model or tokenizer."""

    permanent = True


def save_tensors(path: Path, tensors: dict[str, np.ndarray]) -> str:
    """Write a safetensors file atomically; returns its sha256.

    A storage fault (no space, quota, read-only, ...) is one ArtifactError line naming `path` (permanent: the
    supervisor does not retry it): safetensors raises its own SafetensorError carrying Rust's "(os error 28)",
    which is neither an OSError nor names the file."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        try:
            save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp))
        except Exception as exc:
            if type(exc).__name__ != "SafetensorError" or (os_exc := as_os_error(exc, path)) is None:
                raise
            raise os_exc from None
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:
            raise storage_error(exc, path) from None
        raise
    finally:
        if tmp.exists():
            tmp.unlink()
    return sha256_file(path)


def read_tensors(path: Path, fix: str) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; CheckpointError naming the file when it is truncated or not safetensors."""
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises SafetensorError (not an OSError/ValueError) on bad bytes
        if type(exc).__name__ != "SafetensorError" and not isinstance(exc, (OSError, ValueError)):
            raise
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); it is truncated or corrupt: "
                              f"{fix}") from None


def load_weights(path: Path) -> dict[str, np.ndarray]:
    """Weights from a `model.safetensors` file or an artifact directory holding one, checked against its manifest."""
    p = Path(path)
    if p.is_dir() and (p / "state.json").is_file():
        raise CheckpointError(f"{path}: a training checkpoint, not a model artifact; read it with "
                              "tasks.training.checkpoint.load_checkpoint")
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise CheckpointError(f"{path}: no model.safetensors found")
    verify_published(p)  # an artifact's weights are what its manifest published
    weights = read_tensors(p, "rebuild the artifact that wrote it")
    check_finite(weights, p)
    return weights


def check_finite(arrays: dict[str, np.ndarray], where: str | Path) -> None:
    """CheckpointError naming the first tensor holding NaN/Inf (such a model answers garbage to every prompt)."""
    for k, v in arrays.items():
        if bad := nonfinite(k, v):
            raise CheckpointError(f"{where}: {bad}; this model cannot run: rebuild it, or convert it again from a "
                                  "good source")


def assign(params, arrays: dict[str, np.ndarray], what: str, *, strict: bool = True) -> None:
    """Set `params` from `arrays` by name; every parameter must be there with its shape, and (strict)
    nothing else may be: a tensor the model lacks means the file belongs to another model."""
    import mindspore as ms  # lazy: the store imports without MindSpore (the CLI, the stages' parents)

    missing = [p.name for p in params if p.name not in arrays]
    if missing:
        raise CheckpointError(f"{what} lacks {missing[:3]}{'…' if len(missing) > 3 else ''}; it belongs to another "
                              "model (compare its model.json / state.json with this pipeline's model section)")
    if strict:
        names = {p.name for p in params}
        extra = sorted(k for k in arrays if k not in names)
        if extra:
            raise CheckpointError(f"{what} holds {len(extra)} tensor(s) this model does not have ({', '.join(extra[:3])}"
                                  f"{'…' if len(extra) > 3 else ''}); it belongs to another model (e.g. more layers); "
                                  "point at a checkpoint of this architecture")
    for p in params:
        if tuple(arrays[p.name].shape) != tuple(p.shape):
            raise CheckpointError(f"{what}: {p.name} has shape {arrays[p.name].shape}, model wants {tuple(p.shape)}")
        p.set_data(ms.Tensor(arrays[p.name]))
