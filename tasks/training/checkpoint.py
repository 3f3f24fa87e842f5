"""Training checkpoints: self-describing, atomic, checksummed, rotated.

Layout of one checkpoint (a directory, complete only once `state.json` exists):

    checkpoints/step_00000100/
        model.safetensors       trainable parameters, by MindSpore parameter name
        optimizer.safetensors   AdamW moments (adam_m.*, adam_v.*)
        state.json              step, consumed samples, RNG, model config, tokenizer, sha256 of both files

A run with tensor parallel tp > 1 stores one file pair per tensor-parallel rank,
`model.tp{i}-of-{tp}.safetensors` / `optimizer.tp{i}-of-{tp}.safetensors` (written by
data-parallel replica 0; the other replicas hold the same values), and state.json's
`layout` ({data_parallel, tensor_parallel}) says how. With optimizer sharding (ZeRO-1, dp > 1,
tp 1) every data-parallel rank writes its share of the flat moment buffers,
`optimizer.dp{i}-of-{dp}.safetensors` ({adam_m, adam_v}: [shard]), and `layout.optimizer_shard`
records the flat buffer's order (parameter names and shapes), its size and the share size; loading
concatenates the shares, drops the padding and cuts the per-parameter moments back out, bit for
bit, so any layout (sharded or not, any dp or tp) continues from it. `load_checkpoint(ckpt, tp=, tp_index=)`
reshards to any layout: it concatenates the slices along each parameter's split axis
(tasks/modeling/parallelize.py `split_axis`) and cuts the caller's slice, bit for bit. The data
position (`consumed_samples`) is global, so a resume under another data-parallel size
continues where the run stopped.

Tensors are stored with safetensors (no pickle anywhere; tasks/store/tensors.py); metadata in JSON.
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

from tasks.store.disk import atomic_write_json, fsync_dir, sha256_file
from tasks.store.tensors import CheckpointError, read_tensors, save_tensors

STATE = "state.json"


def shard_files(tp: int, tp_index: int) -> tuple[str, str]:
    """(model file, optimizer file) names of one tensor-parallel rank's slice."""
    if tp == 1:
        return "model.safetensors", "optimizer.safetensors"
    return f"model.tp{tp_index}-of-{tp}.safetensors", f"optimizer.tp{tp_index}-of-{tp}.safetensors"


def zero_files(dp: int) -> list[str]:
    """The optimizer files of a ZeRO-1 checkpoint, one per data-parallel rank."""
    return [f"optimizer.dp{i}-of-{dp}.safetensors" for i in range(dp)]


def save_checkpoint(
    ckpt_root: Path,
    step: int,
    weights: dict[str, np.ndarray],
    optimizer: dict[str, np.ndarray],
    state: dict[str, Any],
    keep: int,
    mesh=None,
    opt_shard: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `step` atomically and rotate; with a distributed `mesh` every rank must call it.

    `opt_shard` (ZeRO-1: ShardedAdamW.layout()): `optimizer` is this rank's share of the flat moments."""
    if mesh is not None and mesh.distributed:
        return _save_distributed(ckpt_root, step, weights, optimizer, state, keep, mesh, opt_shard)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    tmp = ckpt_root / f".tmp-{name}-{uuid.uuid4().hex[:6]}"
    tmp.mkdir()
    try:
        files = {
            "model.safetensors": save_tensors(tmp / "model.safetensors", weights),
            "optimizer.safetensors": save_tensors(tmp / "optimizer.safetensors", optimizer),
        }
        layout = {"data_parallel": 1, "tensor_parallel": 1}
        return _publish(ckpt_root, tmp, step, {**state, "layout": layout}, files, keep)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _publish(ckpt_root: Path, tmp: Path, step: int, state: dict[str, Any], files: dict[str, str], keep: int) -> Path:
    final = ckpt_root / f"step_{step:08d}"
    atomic_write_json(tmp / STATE, {**state, "step": step, "files": files, "complete": True})
    fsync_dir(tmp)
    if final.exists():  # a re-run of the same step (after resume): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_dir(ckpt_root)
    rotate(ckpt_root, keep)
    return final


def _save_distributed(
    ckpt_root: Path, step: int, weights, optimizer, state, keep: int, mesh, opt_shard: dict[str, Any] | None = None
) -> Path:
    """Replica 0's tensor-parallel ranks write their slices into one temp dir; rank 0 publishes it.

    Three barriers: the temp dir is fresh before anyone writes, every slice is on disk before
    rank 0 writes state.json (the completeness mark) and renames the dir into place.
    """
    tmp = ckpt_root / f".tmp-step_{step:08d}-dist"
    if mesh.rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # left by a crashed attempt
            shutil.rmtree(tmp)
        tmp.mkdir()
    mesh.barrier()
    if opt_shard is not None:  # ZeRO-1 (tp 1): replica 0 writes the weights, every rank its optimizer share
        digests = {}
        if mesh.writes_checkpoint:
            digests["model.safetensors"] = save_tensors(tmp / "model.safetensors", weights)
        ofile = zero_files(mesh.dp)[mesh.dp_index]
        digests[ofile] = save_tensors(tmp / ofile, optimizer)
        atomic_write_json(tmp / f".files-dp{mesh.dp_index}.json", digests)
    elif mesh.writes_checkpoint:
        mfile, ofile = shard_files(mesh.tp, mesh.tp_index)
        digests = {mfile: save_tensors(tmp / mfile, weights), ofile: save_tensors(tmp / ofile, optimizer)}
        atomic_write_json(tmp / f".files-tp{mesh.tp_index}.json", digests)
    mesh.barrier()
    final = ckpt_root / f"step_{step:08d}"
    if mesh.rank == 0:
        files: dict[str, str] = {}
        parts = (
            [f".files-dp{i}.json" for i in range(mesh.dp)]
            if opt_shard is not None
            else [f".files-tp{i}.json" for i in range(mesh.tp)]
        )
        for name in parts:
            part = tmp / name
            files.update(json.loads(part.read_text()))
            part.unlink()
        layout = mesh.layout()
        if opt_shard is not None:
            layout["optimizer_shard"] = opt_shard
        _publish(ckpt_root, tmp, step, {**state, "layout": layout}, files, keep)
    mesh.barrier()  # nobody reads or writes checkpoints while rank 0 renames and rotates
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


def is_good(ckpt: Path) -> bool:
    """Finite weights and no non-finite step since the previous checkpoint (state.json `good`; the
    trainer refuses to write non-finite weights at all). Checkpoints from before the flag count as good."""
    try:
        return bool(read_state(ckpt).get("good", True))
    except CheckpointError:
        return False


def newest_checkpoint(ckpt_root: Path, good_only: bool = False) -> Path | None:
    """The newest complete checkpoint (with `good_only`, the newest good one: what resumes use)."""
    ck = complete_checkpoints(ckpt_root)
    if good_only:
        ck = [c for c in ck if is_good(c)]
    return ck[-1] if ck else None


def rotate(ckpt_root: Path, keep: int) -> None:
    """Keep the `keep` newest complete checkpoints, and always the newest good one (a streak of
    non-finite steps must never rotate away the checkpoint a resume would use)."""
    ck = complete_checkpoints(ckpt_root)
    good = newest_checkpoint(ckpt_root, good_only=True)
    for old in ck[: max(0, len(ck) - max(1, keep))]:
        if old == good:
            continue
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_root.glob(".tmp-step_*"):
        shutil.rmtree(stale, ignore_errors=True)


def layout_of(state: dict[str, Any]) -> dict[str, int]:
    return state.get("layout") or {"data_parallel": 1, "tensor_parallel": 1}


def load_checkpoint(
    ckpt: Path, tp: int = 1, tp_index: int = 0
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """(weights, optimizer, state) for tensor-parallel rank `tp_index` of `tp`, whatever layout saved it.

    Every file read is checked against the sha256 in state.json. The saved slices are
    merged and re-cut only when the saved tensor-parallel size differs from `tp`.
    """
    from tasks.modeling.parallelize import shard, unshard  # lazy: MindSpore; the pretrain stage's parent imports this

    state = read_state(ckpt)
    saved_tp = int(layout_of(state)["tensor_parallel"])

    def read(fname: str) -> dict[str, np.ndarray]:
        digest = state["files"].get(fname)
        if digest is None:
            raise CheckpointError(f"{ckpt}: state.json lists no {fname}; the checkpoint is incomplete")
        if sha256_file(ckpt / fname) != digest:
            raise CheckpointError(
                f"{ckpt / fname}: sha256 mismatch (corrupt); delete {ckpt} to resume from an older one"
            )
        return read_tensors(ckpt / fname, f"delete {ckpt} to resume from an older checkpoint")

    zero = layout_of(state).get("optimizer_shard")
    if zero is not None:  # ZeRO-1 shares -> full per-parameter moments (then cut like a tp=1 checkpoint)
        shares = [read(f) for f in zero_files(int(zero["data_parallel"]))]
        bad = [
            k for k in ("adam_m", "adam_v") for s in shares if k not in s or s[k].shape != (int(zero["shard_numel"]),)
        ]
        if bad:
            raise CheckpointError(
                f"{ckpt}: an optimizer share lacks {bad[0]} of {zero['shard_numel']} elements; "
                f"the checkpoint is corrupt: delete {ckpt} to resume from an older one"
            )
        weights, opt = read("model.safetensors"), unflatten_moments(shares, zero)
        return (weights, opt, state) if tp == 1 else (shard(weights, tp, tp_index), shard(opt, tp, tp_index), state)
    if saved_tp == tp:
        mfile, ofile = shard_files(tp, tp_index)
        return read(mfile), read(ofile), state
    pairs = [shard_files(saved_tp, i) for i in range(saved_tp)]
    weights = unshard([read(m) for m, _ in pairs])
    opt = unshard([read(o) for _, o in pairs])
    return shard(weights, tp, tp_index), shard(opt, tp, tp_index), state


def _chunks(layout: dict) -> list[tuple[int, int]]:
    """(parameter count, element count) of each chunk of a ZeRO-1 flat buffer (one chunk when unrecorded)."""
    return [tuple(x) for x in layout.get("chunks") or [[len(layout["params"]), int(layout["numel"])]]]


def unflatten_moments(shards: list[dict], layout: dict) -> dict:
    """Full per-parameter moments (`adam_m.<name>`, `adam_v.<name>`) from the dp flat shares of a ZeRO-1 checkpoint:
    each chunk is the ranks' pieces of it in rank order, less its padding (tasks/training/zero.py ShardedAdamW)."""
    dp = len(shards)
    out = {}
    for key in ("adam_m", "adam_v"):
        pos, p = 0, 0
        for count, numel in _chunks(layout):
            piece = -(-numel // dp)
            flat = np.concatenate([s[key][pos : pos + piece] for s in shards])[:numel]
            pos += piece
            o = 0
            for name, shape in layout["params"][p : p + count]:
                n = int(np.prod(shape)) if shape else 1
                out[f"{key}.{name}"] = flat[o : o + n].reshape(shape).copy()
                o += n
            p += count
    return out


def flatten_moments(opt: dict, layout: dict) -> list[dict]:
    """The inverse of `unflatten_moments`: per-parameter moments -> the dp zero-padded flat shares of `layout`."""
    dp = int(layout["data_parallel"])
    out = [{} for _ in range(dp)]
    for key in ("adam_m", "adam_v"):
        pieces: list[list[np.ndarray]] = [[] for _ in range(dp)]
        p = 0
        for count, numel in _chunks(layout):
            piece = -(-numel // dp)
            flat = np.concatenate([opt[f"{key}.{name}"].reshape(-1) for name, _ in layout["params"][p : p + count]])
            flat = np.concatenate([flat.astype(np.float32), np.zeros(dp * piece - numel, np.float32)])
            for r in range(dp):
                pieces[r].append(flat[r * piece : (r + 1) * piece])
            p += count
        for r in range(dp):
            out[r][key] = np.concatenate(pieces[r])
    return out
