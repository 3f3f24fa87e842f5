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

import json
import os
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from model.convert import nonfinite
from tasks.store.disk import sha256_file
from tasks.store.errors import STORAGE_ERRNOS, as_os_error, storage_error
from tasks.store.published import verify_published


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


# safetensors dtypes numpy holds as they are; any other (BF16, F8_*) goes through the safetensors library
_NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U64": "<u8",
    "U32": "<u4",
    "U16": "<u2",
    "U8": "u1",
    "BOOL": "?",
}
_MAX_HEADER = 100 << 20  # the safetensors library's own limit on the JSON header


def read_tensors(
    path: Path, fix: str, convert: Callable[[str, np.ndarray], np.ndarray] | None = None
) -> dict[str, np.ndarray]:
    """A safetensors file's tensors; CheckpointError naming the file when it is truncated or not safetensors.
    `convert(name, array)`: what is kept of each tensor, called as soon as it is read (a weight matrix stored in 16 or
    8 bits: the float32 weights never exist all at once). It must treat rows independently: a tensor of more than
    CONVERT_CHUNK bytes is read and converted CONVERT_CHUNK bytes of rows at a time (an embedding of 128k x 2048 is
    1 GB of float32), its converted rows written into one array.

    Each tensor is read straight into its own array (the format: an 8-byte little-endian header length, the JSON
    header of dtype, shape and [begin, end) data offsets, the data), so reading holds the tensors once: the
    library's `load_file` holds the file's bytes beside the arrays and `safe_open` maps the file, both twice the
    weights in RSS while they read (SmolLM2-360M: 3.24 GB of VmHWM for 1.45 GB of weights; docs/MEMORY.md)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(_MAX_HEADER, size - 8):
                raise ValueError(f"header length {n} for a file of {size} bytes")
            header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            header.pop("__metadata__", None)
            if any(not isinstance(v, dict) or v.get("dtype") not in _NUMPY_DTYPES for v in header.values()):
                out = load_file(str(path))  # a dtype numpy lacks: the library's reader decides
                return {k: convert(k, v) for k, v in out.items()} if convert else out
            out, start, last_end = {}, 8 + n, 0
            for k, v in sorted(header.items(), key=lambda kv: kv[1].get("data_offsets", [0])[0]):
                dtype, shape, (begin, end) = np.dtype(_NUMPY_DTYPES[v["dtype"]]), v["shape"], v["data_offsets"]
                if not (
                    all(isinstance(d, int) and d >= 0 for d in shape)
                    and isinstance(begin, int)
                    and isinstance(end, int)
                    and 0 <= begin <= end
                    and start + end <= size
                    and end - begin == dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                ):
                    raise ValueError(
                        f"tensor {k!r}: offsets {begin}..{end} do not hold {v['dtype']} {shape} "
                        f"within the file's {size - start} data bytes"
                    )
                if begin < last_end:
                    raise ValueError(f"tensor {k!r} overlaps the tensor before it")
                last_end = end
                f.seek(start + begin)
                if convert is not None and len(shape) >= 2 and end - begin > CONVERT_CHUNK and shape[0] > 1:
                    out[k] = _converted_rows(f, k, shape, dtype, convert)
                    continue
                arr = np.empty(shape, dtype)
                if f.readinto(memoryview(arr.reshape(-1)).cast("B")) != end - begin:
                    raise ValueError(f"tensor {k!r} is cut short")
                out[k] = convert(k, arr) if convert else arr
            return out
    except Exception as exc:  # safetensors raises SafetensorError (not an OSError/ValueError) on bad bytes
        if type(exc).__name__ != "SafetensorError" and not isinstance(exc, (OSError, ValueError, KeyError, TypeError)):
            raise
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({exc}); it is truncated or corrupt: {fix}"
        ) from None


CONVERT_CHUNK = 8 << 20
"""Bytes of a big tensor `read_tensors` reads and converts at a time when it converts (whole rows)."""


def _converted_rows(f, name: str, shape: list[int], dtype: np.dtype, convert) -> np.ndarray:
    """A tensor read from `f` (at its data) CONVERT_CHUNK bytes of whole rows at a time, each block converted."""
    row_bytes = dtype.itemsize * int(np.prod(shape[1:], dtype=np.int64))
    step = max(1, CONVERT_CHUNK // max(row_bytes, 1))
    out, buf = None, np.empty([min(step, shape[0])] + list(shape[1:]), dtype)  # one read buffer for every block
    for r in range(0, shape[0], step):
        block = buf[: min(step, shape[0] - r)]
        if f.readinto(memoryview(block.reshape(-1)).cast("B")) != block.nbytes:
            raise ValueError(f"tensor {name!r} is cut short")
        conv = convert(name, block)
        if out is None:
            out = np.empty((shape[0],) + conv.shape[1:], conv.dtype)
        out[r : r + len(block)] = conv
    return out


def load_weights(path: Path, convert: Callable[[str, np.ndarray], np.ndarray] | None = None) -> dict[str, np.ndarray]:
    """Weights from a `model.safetensors` file or an artifact directory holding one, checked against its manifest
    and for NaN/Inf; `convert(name, array)`: what is kept of each tensor, as `read_tensors` (checked before it)."""
    p = Path(path)
    if p.is_dir() and (p / "state.json").is_file():
        raise CheckpointError(
            f"{path}: a training checkpoint, not a model artifact; read it with "
            "tasks.training.checkpoint.load_checkpoint"
        )
    if p.is_dir():
        p = p / "model.safetensors"
    if not p.is_file():
        raise CheckpointError(f"{path}: no model.safetensors found")
    verify_published(p)  # an artifact's weights are what its manifest published
    if convert is None:
        weights = read_tensors(p, "rebuild the artifact that wrote it")
        check_finite(weights, p)
        return weights

    def checked(name: str, arr: np.ndarray) -> np.ndarray:
        check_finite({name: arr}, p)
        return convert(name, arr)

    return read_tensors(p, "rebuild the artifact that wrote it", checked)


def check_finite(arrays: dict[str, np.ndarray], where: str | Path) -> None:
    """CheckpointError naming the first tensor holding NaN/Inf (such a model answers garbage to every prompt)."""
    for k, v in arrays.items():
        if bad := nonfinite(k, v):
            raise CheckpointError(
                f"{where}: {bad}; this model cannot run: rebuild it, or convert it again from a good source"
            )


def assign(params, arrays: dict[str, np.ndarray], what: str, *, strict: bool = True, take: bool = False) -> None:
    """Set `params` from `arrays` by name; every parameter must be there with its shape, and (strict)
    nothing else may be: a tensor the model lacks means the file belongs to another model. `take`: the arrays move
    into the parameters (popped from `arrays`; a float32 array becomes the parameter's memory, not a copy of it), so
    the weights are held once while they load, not twice."""
    import mindspore as ms  # lazy: the store imports without MindSpore (the CLI, the stages' parents)

    missing = [p.name for p in params if p.name not in arrays]
    if missing:
        raise CheckpointError(
            f"{what} lacks {missing[:3]}{'…' if len(missing) > 3 else ''}; it belongs to another "
            "model (compare its model.json / state.json with this pipeline's model section)"
        )
    if strict:
        names = {p.name for p in params}
        extra = sorted(k for k in arrays if k not in names)
        if extra:
            raise CheckpointError(
                f"{what} holds {len(extra)} tensor(s) this model does not have ({', '.join(extra[:3])}"
                f"{'…' if len(extra) > 3 else ''}); it belongs to another model (e.g. more layers); "
                "point at a checkpoint of this architecture"
            )
    for p in params:
        if tuple(arrays[p.name].shape) != tuple(p.shape):
            raise CheckpointError(f"{what}: {p.name} has shape {arrays[p.name].shape}, model wants {tuple(p.shape)}")
    for p in params:
        if not take:
            p.set_data(ms.Tensor(arrays[p.name]))
            continue
        a = arrays.pop(p.name)
        own = a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable and a.flags.owndata
        p.set_data(ms.Tensor.from_numpy(a) if own else ms.Tensor(a))
