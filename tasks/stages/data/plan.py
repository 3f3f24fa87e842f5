"""Step 3: read, clean, dedup and split the corpus into chunk files and the tokenizer sample."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.runtime.progress import progress_bar
from tasks.stages.data.cleaning import Cleaner, CleanStats
from tasks.stages.data.sources import Source, _is_binary, read_documents, resolve_sources
from tasks.store.data_schema import DataError

if TYPE_CHECKING:
    from tasks.config.schema import DataSection, PipelineConfig

# ----------------------------------------------------------------------------- plan: read, clean, split, chunk


@dataclass
class Plan:
    """The cleaned corpus on disk: chunk files per split, the tokenizer sample, and what cleaning counted."""

    chunks: list[dict[str, Any]]  # JSON-able: split, index, documents, bytes, text_path, tokens_path
    sample_path: Path
    sample_documents: int
    stats: CleanStats
    documents: dict[str, int]
    seconds: float


def _progress_bar(enabled: bool, desc: str, total: int | None = None):
    return progress_bar(total=total, desc=desc, unit="doc", unit_scale=True, enabled=enabled)


def _postfix(bar, nbytes: int, tokens: int | None = None) -> None:
    if bar.disable:
        return
    dt = max(bar.format_dict["elapsed"], 1e-3)
    text = f"{nbytes / 1e6 / dt:.2f} MB/s"
    if tokens is not None:
        text += f", {tokens / dt / 1e3:.0f}k tok/s"
    bar.set_postfix_str(text, refresh=False)


def _validation_mask(n: int, data: DataSection) -> np.ndarray:
    if data.validation_documents is not None:
        k, key = data.validation_documents, "data.validation_documents"
    else:
        k, key = (
            (max(1, round(data.validation_fraction * n)) if data.validation_fraction > 0 else 0),
            "data.validation_fraction",
        )
    if k >= n:
        raise DataError(f"{key}: {k} held-out documents of {n} kept leaves nothing to train on; lower it or add text")
    if k == 0:
        raise DataError(
            "data.validation_fraction: 0 leaves no held-out split; set a fraction > 0 or validation_documents"
        )
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(data.seed).choice(n, size=k, replace=False)] = True
    return mask


def plan_chunks(
    cfg: PipelineConfig,
    work_dir: Path,
    *,
    sources: list[Source] | None = None,
    progress: bool = False,
    tokenizer_sample: bool = True,
) -> Plan:
    """Read and clean every source, hold out validation documents, and write the corpus as chunk
    files (`work_dir/<split>-NNNNN.jsonl`, one JSON string per line) of at most `data.chunk_documents`
    documents / `data.chunk_bytes` bytes, plus (unless `tokenizer_sample=False`) the tokenizer
    training sample `work_dir/tokenizer_sample.txt`. Raises DataError."""
    t0 = time.perf_counter()
    d = cfg.data
    sources = sources if sources is not None else resolve_sources(cfg)[0]
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    cleaner = Cleaner(d.clean)
    st = cleaner.stats
    with _progress_bar(progress, "read+clean") as bar:
        for src in sources:
            st.files += 1
            if _is_binary(src):
                st.seen += 1
                st.skipped["binary"] += 1
                st.skipped_files.append({"path": src.name, "reason": "binary (NUL bytes in the first 8 KiB)"})
                print(f"data: skipping {src.name}: binary, not text (NUL bytes)", file=sys.stderr)
                continue
            for text in read_documents(src, d):
                cleaner.add(text)
                bar.update(1)
                if st.seen % 512 == 0:
                    _postfix(bar, st.bytes_seen)
        _postfix(bar, st.bytes_seen)
    n = len(cleaner.kept)
    if n == 0:
        reasons = ", ".join(f"{k} {v}" for k, v in st.skipped.items() if v) or "no documents at all"
        raise DataError(
            f"data.sources: no documents left after cleaning ({st.seen} seen: {reasons}) in "
            f"{', '.join(s.name for s in sources)}; check the files, data.text_field and data.clean"
        )
    valid = _validation_mask(n, d)
    chunks: list[dict[str, Any]] = []
    documents = {}
    for split, want in (("train", False), ("valid", True)):
        idx = np.flatnonzero(valid == want)
        documents[split] = int(len(idx))
        start = 0
        while start < len(idx):
            stop, nbytes = start, 0
            while stop < len(idx) and stop - start < d.chunk_documents and (stop == start or nbytes < d.chunk_bytes):
                nbytes += cleaner.kept_bytes[idx[stop]]
                stop += 1
            k = sum(c["split"] == split for c in chunks)
            stem = work_dir / f"{split}-{k:05d}"
            with open(f"{stem}.jsonl", "w", encoding="utf-8") as f:
                for j in idx[start:stop]:
                    f.write(json.dumps(cleaner.kept[j], ensure_ascii=False))
                    f.write("\n")
            chunks.append(
                {
                    "split": split,
                    "index": k,
                    "documents": int(stop - start),
                    "bytes": int(nbytes),
                    "text_path": f"{stem}.jsonl",
                    "tokens_path": f"{stem}.tokens.npy",
                }
            )
            start = stop
    sample_path = work_dir / "tokenizer_sample.txt"
    n_sample = 0
    if tokenizer_sample:
        n_sample = _write_tokenizer_sample(sample_path, [cleaner.kept[j] for j in np.flatnonzero(~valid)], d)
    return Plan(chunks, sample_path, n_sample, st, documents, time.perf_counter() - t0)


def _write_tokenizer_sample(path: Path, train_docs: list[str], d: DataSection) -> int:
    """A deterministic sample of training documents, one sentence (line) per line."""
    tok = d.tokenizer
    order = np.random.default_rng(d.seed + 1).permutation(len(train_docs))
    chosen, chars = [], 0
    for j in order:
        if len(chosen) >= tok.sample_documents or (chosen and chars >= tok.sample_chars):
            break
        chosen.append(int(j))
        chars += len(train_docs[j])
    limit = tok.max_sentence_length
    with open(path, "w", encoding="utf-8") as f:
        for j in sorted(chosen):
            for line in train_docs[j].split("\n"):
                if not line.strip():
                    continue
                b = line.encode("utf-8")
                if len(b) > limit:  # SentencePiece would skip the whole line; keep its start
                    line = b[:limit].decode("utf-8", "ignore")
                f.write(line.rstrip("\r"))
                f.write("\n")
    return len(chosen)
