"""Read a data artifact's packed blocks for training and evaluation (MindSpore `MindDataset`).

    for batch in open_blocks(data_dir, "train", batch_size=8, num_shards=2, shard_id=rank, seed=0,
                             start_sample=step * 8 * 2):
        batch["input_ids"]   # int32 [B, seq_length + 1]: inputs = [:, :-1], targets = [:, 1:]
        batch["loss_mask"]   # int32 [B, seq_length]: 1 where the target counts, 0 at padding
        batch["index"]       # int64 [B]: global block ids (for checks and debugging)
    num_blocks(data_dir, "valid")

The sample order is ours, computed with numpy, so it is exact and cheap to resume: epoch `e`
visits the split's blocks in `permutation(n)` drawn from `default_rng([seed, e])` (or in order with
`shuffle=False`); rank r of `num_shards` takes `perm[r::num_shards]`, cut to `n // num_shards` so
every rank sees the same count (the few leftover blocks differ each epoch). The ranks together
read every block of an epoch at most once, exactly once when `num_shards` divides `n`. With
`repeat=True` the epochs follow one another without a gap, so a batch may span two epochs.

`start_sample` counts samples consumed by all ranks together (global batch size × steps) and must
be a multiple of `num_shards`; the stream resumed there equals the rest of the uninterrupted one.
The indices go to `MindDataset` through a `SubsetSampler` (MindSpore returns rows in sampler
order), a window of batches at a time. Files are checked against the manifest's sha256 on open
(`verify=True`); a bad file raises `DataError` (tasks/store/data_schema.py) naming it.

`block_batches` turns those blocks into the (input_ids, labels) batches that training, evaluation and export's
held-out check read. MindSpore (`mindspore.dataset`) loads inside the readers only (lazy): the stage modules'
parent side imports this module."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tasks.store.artifacts import ArtifactStore
from tasks.store.data_schema import DATA_SCHEMA_VERSION, SPLITS, DataError
from tasks.store.errors import ArtifactError
from tasks.store.published import verify_published

_WINDOW = 16384  # samples per MindDataset pipeline (a new one per window; cheap)
_VERIFIED: set[tuple] = set()  # (path, size, mtime_ns) of files already checked in this process


def _stamp(p: Path) -> tuple | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return (str(p.resolve()), st.st_size, st.st_mtime_ns)


def data_info(data_artifact: str | Path) -> dict[str, Any]:
    """The manifest's `data` section (schema version checked), with `root` added."""
    root = Path(data_artifact)
    try:
        m = ArtifactStore.read_manifest(root)
    except ArtifactError as exc:
        raise DataError(str(exc)) from None
    info = m.get("data")
    if m.get("stage") != "data" or not isinstance(info, dict):
        raise DataError(
            f"{root}: not a data artifact (stage {m.get('stage')!r}); pass the directory `msllm data` printed"
        )
    if info.get("schema_version") != DATA_SCHEMA_VERSION:
        raise DataError(
            f"{root}: data schema version {info.get('schema_version')} but this code reads {DATA_SCHEMA_VERSION}; "
            "rerun `msllm data --pipeline NAME` to rebuild it"
        )
    return {**info, "root": str(root)}


def _inside(root: Path, rel: str) -> Path:
    """A shard path from the manifest, which must stay inside the artifact directory: the pretrain key
    covers this artifact's files, so reading any other file would train on data the key does not name."""
    base = Path(root).resolve()
    p = (base / rel).resolve()
    if base not in p.parents:
        raise DataError(
            f"{root}/manifest.json: shard path {rel!r} points outside the artifact ({p}); the manifest is "
            "corrupt or crafted: rerun the data stage (`msllm data`)"
        )
    return p


def _split(info: dict[str, Any], split: str) -> dict[str, Any]:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    return info["splits"][split]


def num_blocks(data_artifact: str | Path, split: str) -> int:
    """Blocks (rows) in a split."""
    return int(_split(data_info(data_artifact), split)["blocks"])


def rank_order(
    n: int, epoch: int, *, seed: int, num_shards: int = 1, shard_id: int = 0, shuffle: bool = True
) -> np.ndarray:
    """Global block ids rank `shard_id` reads in `epoch`, in order (length n // num_shards)."""
    perm = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    return perm[shard_id::num_shards][: n // num_shards]


def sample_indices(
    n: int, start: int, count: int, *, seed: int, num_shards: int = 1, shard_id: int = 0, shuffle: bool = True
) -> np.ndarray:
    """Block ids at rank-local stream positions [start, start + count), across epoch boundaries."""
    per = n // num_shards
    out, pos = [], start
    while pos < start + count:
        epoch, i = divmod(pos, per)
        take = min(per - i, start + count - pos)
        out.append(
            rank_order(n, epoch, seed=seed, num_shards=num_shards, shard_id=shard_id, shuffle=shuffle)[i : i + take]
        )
        pos += take
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def open_blocks(
    data_artifact: str | Path,
    split: str,
    *,
    batch_size: int,
    num_shards: int = 1,
    shard_id: int = 0,
    seed: int = 0,
    start_sample: int = 0,
    repeat: bool = True,
    epoch_repeat: bool | None = None,
    shuffle: bool | None = None,
    drop_last: bool | None = None,
    verify: bool = True,
    num_parallel_workers: int = 2,
) -> Iterator[dict[str, np.ndarray]]:
    """Batches of one rank's slice of a split; see the module docstring for the order.

    repeat (alias epoch_repeat): endless epochs; False = the rest of the epoch `start_sample` is in.
    shuffle: default True for train, False for valid. drop_last: default True when repeating
    (never a short batch), False for a single pass (the last batch may be short).
    """
    if epoch_repeat is not None:
        repeat = epoch_repeat
    shuffle = (split == "train") if shuffle is None else shuffle
    drop_last = repeat if drop_last is None else drop_last
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not 0 <= shard_id < num_shards:
        raise ValueError(f"shard_id {shard_id} must be in [0, num_shards={num_shards})")
    if start_sample < 0 or start_sample % num_shards:
        raise ValueError(
            f"start_sample {start_sample} must be a non-negative multiple of num_shards={num_shards} "
            "(it counts the samples all ranks consumed)"
        )
    info = data_info(data_artifact)
    root = Path(info["root"])
    sp = _split(info, split)
    n = int(sp["blocks"])
    per = n // num_shards
    if per == 0:
        raise DataError(
            f"{root}: the {split} split has {n} block(s), fewer than num_shards={num_shards}; "
            "use fewer ranks or rebuild with a smaller data.seq_length"
        )
    files = [str(_inside(root, f)) for f in sp["files"]]
    if verify:
        rels = [f for rel in sp["files"] for f in (rel, rel + ".db")]
        stamps = [_stamp(root / rel) for rel in rels]
        todo = [rel for rel, st in zip(rels, stamps) if st not in _VERIFIED]
        if todo:
            verify_files(root, todo)
            _VERIFIED.update(st for rel, st in zip(rels, stamps) if rel in todo and st is not None)
    else:  # no checksum pass, but a stat: MindSpore's reader can crash the process on a truncated shard
        check_sizes(root, [f for rel in sp["files"] for f in (rel, rel + ".db")])
    return _batches(
        files,
        n,
        start_sample // num_shards,
        batch_size=batch_size,
        num_shards=num_shards,
        shard_id=shard_id,
        seed=seed,
        repeat=repeat,
        shuffle=shuffle,
        drop_last=drop_last,
        workers=num_parallel_workers,
    )


def _batches(
    files: list[str],
    n: int,
    pos: int,
    *,
    batch_size: int,
    num_shards: int,
    shard_id: int,
    seed: int,
    repeat: bool,
    shuffle: bool,
    drop_last: bool,
    workers: int,
) -> Iterator[dict[str, np.ndarray]]:
    import mindspore.dataset as ds

    per = n // num_shards
    end = None if repeat else (pos // per + 1) * per  # single pass: to the end of the epoch `pos` is in
    window = (min(_WINDOW, n) // batch_size) * batch_size  # a SubsetSampler takes at most n indices
    if window == 0:  # fewer blocks than one batch: read them once, assemble batches in memory
        yield from _small_split(
            files,
            n,
            pos,
            end,
            batch_size=batch_size,
            num_shards=num_shards,
            shard_id=shard_id,
            seed=seed,
            shuffle=shuffle,
            drop_last=drop_last,
        )
        return
    workers = max(1, min(workers, os.cpu_count() or 1))
    while end is None or pos < end:
        count = window if end is None else min(window, end - pos)
        if end is not None and count < batch_size and drop_last:
            return
        idx = sample_indices(n, pos, count, seed=seed, num_shards=num_shards, shard_id=shard_id, shuffle=shuffle)
        try:
            pipe = ds.MindDataset(
                files,
                columns_list=["input_ids", "loss_mask"],
                sampler=ds.SubsetSampler(idx.tolist()),
                num_parallel_workers=workers,
            )
            pipe = pipe.batch(batch_size, drop_remainder=drop_last)
            it = pipe.create_tuple_iterator(num_epochs=1, output_numpy=True)
            k = 0
            try:
                for ids, mask in it:
                    b = len(ids)
                    yield {"input_ids": ids, "loss_mask": mask, "index": idx[k : k + b].astype(np.int64)}
                    k += b
            finally:
                it.stop()  # release the pipeline's threads when the consumer stops early
        except RuntimeError as exc:
            raise DataError(
                f"{', '.join(files)}: MindRecord read failed ({_first_line(exc)}); the files may be truncated or "
                "corrupt: rerun the data stage or check them with verify=True"
            ) from None
        pos += count


def _small_split(
    files: list[str],
    n: int,
    pos: int,
    end: int | None,
    *,
    batch_size: int,
    num_shards: int,
    shard_id: int,
    seed: int,
    shuffle: bool,
    drop_last: bool,
) -> Iterator[dict[str, np.ndarray]]:
    import mindspore.dataset as ds

    try:
        rows = list(
            ds.MindDataset(files, columns_list=["input_ids", "loss_mask"], shuffle=False).create_tuple_iterator(
                num_epochs=1, output_numpy=True
            )
        )
    except RuntimeError as exc:
        raise DataError(
            f"{', '.join(files)}: MindRecord read failed ({_first_line(exc)}); rerun the data stage"
        ) from None
    ids, mask = np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])
    while end is None or pos < end:
        count = batch_size if end is None else min(batch_size, end - pos)
        if count < batch_size and drop_last:
            return
        idx = sample_indices(n, pos, count, seed=seed, num_shards=num_shards, shard_id=shard_id, shuffle=shuffle)
        yield {"input_ids": ids[idx], "loss_mask": mask[idx], "index": idx.astype(np.int64)}
        pos += count


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip() and not set(ln.strip()) <= set("-=")]
    return "; ".join(lines[:3])[:300]


def check_sizes(artifact: Path, rel_paths: Iterable[str]) -> None:
    """Each named payload file exists with the size the manifest records (a stat, no hashing); DataError naming the
    first that does not. `open_blocks(verify=False)` runs it: a truncated MindRecord shard made MindSpore's reader
    die with a segmentation fault (the whole process, no exception) in a pytest run, where a stat names the file."""
    artifact = Path(artifact)
    listed = {f["path"]: f for f in ArtifactStore.read_manifest(artifact)["files"]}
    for rel in rel_paths:
        fp, size = artifact / rel, listed.get(rel, {}).get("size")
        try:
            actual = fp.stat().st_size
        except FileNotFoundError:
            raise DataError(f"{fp}: missing (listed in the manifest); rerun the data stage") from None
        if size is not None and actual != size:
            raise DataError(
                f"{fp}: {actual} bytes, the manifest records {size}: truncated or corrupt; rerun the data "
                "stage (or restore the file)"
            )


def verify_files(artifact: Path, rel_paths: Iterable[str]) -> dict[str, Any]:
    """sha256 of the named payload files against the manifest; DataError naming the first bad file."""
    artifact = Path(artifact)
    manifest = ArtifactStore.read_manifest(artifact)
    listed = {f["path"]: f for f in manifest["files"]}
    for rel in rel_paths:
        fp = artifact / rel
        entry = listed.get(rel)
        if entry is None:
            raise DataError(f"{fp}: not listed in {artifact}/manifest.json; rerun the data stage")
        if not fp.is_file():
            raise DataError(f"{fp}: missing (listed in the manifest); rerun the data stage")
        try:
            verify_published(fp)  # the store's one check of published bytes
        except ArtifactError as exc:
            raise DataError(f"{exc} (or restore the file)") from None
    return manifest


def block_batches(
    data_artifact: Path,
    split: str,
    batch_size: int,
    seq_length: int,
    seed: int,
    start_sample: int = 0,
    repeat: bool = True,
    num_shards: int = 1,
    shard_id: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [B, T], labels [B, T]) from a data artifact's packed blocks; labels -100 where masked."""
    for b in open_blocks(
        data_artifact,
        split,
        batch_size=batch_size,
        num_shards=num_shards,
        shard_id=shard_id,
        seed=seed,
        start_sample=start_sample,
        repeat=repeat,
        shuffle=(split == "train"),
    ):
        ids = b["input_ids"][:, : seq_length + 1].astype(np.int32)
        mask = b["loss_mask"][:, :seq_length]
        labels = np.where(mask > 0, ids[:, 1:], -100).astype(np.int32)
        yield np.ascontiguousarray(ids[:, :-1]), labels
