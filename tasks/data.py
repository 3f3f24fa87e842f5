"""The data stage: corpora → cleaned documents → SentencePiece tokenizer → packed MindRecord shards.

    path = run(cfg, ArtifactStore("artifacts"))                 # plain function, no Prefect inside
    path = run(cfg, store, tokenizer_model=base / "tokenizer.model")   # continued pretraining
    msllm data --pipeline tiny                                  # the CLI prints `path` last

A rerun with the same inputs and config is a cache hit (same key, nothing recomputed). The same
inputs and config give byte-identical payload files for any `num_workers` and chunk size.

Steps (each a public function, so an orchestrator can map the middle one over a Dask cluster):

    plan = plan_chunks(cfg, work_dir)          # read, clean, dedup, split, write chunk files + tokenizer sample
    train_tokenizer(cfg.data.tokenizer, plan.sample_path, out)   # or reuse a given tokenizer.model
    results = map(tokenize_chunk, chunk_specs(plan, tokenizer))  # pure, path in → path out, any order of execution
    written = finalize(results, out_dir, ...)  # cut blocks, write MindRecord shards (results in plan order)

`run()` drives the map with a spawn-context process pool (`data.num_workers`; MindSpore is never
imported in the workers, and is imported in the parent only by `finalize`), or with `map_fn`
when the caller supplies one: `data.dask_address` is for the flow, which passes a Dask map here.
The work directory (chunk text + int32 token streams, about 1.3x the corpus) lives inside the
build directory and is removed before the artifact is published.

Inputs (`data.sources`: files, directories, globs, in order; directories and globs expand sorted):
`.txt` (one document per blank-line separated paragraph, or per file: `data.txt_split`), `.jsonl`,
`.json` (an array of records, or JSON Lines) — each optionally `.gz` — with the text in
`data.text_field`; `.parquet` and `hf:NAME` (a dataset in the local Hugging Face cache, split
`train`) go through HF `datasets`. The text formats use our own streaming readers rather than HF's
builders: measured with datasets 5.2, the json builder accepts a truncated gzip silently, stops at
invalid UTF-8 without naming the file, and cannot replace or skip one bad document.

Cleaning, in order (each dropped document counted by reason in the manifest, nothing silently):
`binary` (a NUL character; a file whose first 8 KiB hold a NUL byte counts once and is listed in
`skipped_files`), `invalid_utf8` (with `clean.invalid_utf8: skip`; with `replace` the bad bytes
become U+FFFD and the document counts under `documents_repaired`), `mostly_invalid` (more than
half of the document's characters are U+FFFD after that repair: binary data without NUL bytes,
e.g. an image or an archive renamed `.txt`; random bytes come out ~80% U+FFFD, real text with a
few bad bytes far below 50%; such a document is not also counted as repaired), Unicode normalization
(`clean.normalize`), `empty`, `whitespace`, `too_short` (< `min_chars`), `too_long`
(> `max_chars`), `duplicate` (sha256 of the normalized text). Validation documents are then drawn
at random (seed `data.seed`), so no document — and no block — is in both splits.

Tokenizer (`tokenizer.model`, SentencePiece): trained on a deterministic sample of training
documents (`tokenizer.sample_documents` / `sample_chars`; one sentence per line, lines cut at
`max_sentence_length` bytes) with byte fallback, identity normalization (we normalize ourselves),
no dummy prefix and no whitespace folding, so `decode(encode(text)) == text` for any text
(newlines and tabs become byte pieces). Ids: unk 0, bos 1, eos 2, pad 3. `num_threads=1` keeps
training deterministic. A reused model is copied byte for byte; its size must equal the model's
vocab_size.

Stored schema (`DATA_SCHEMA_VERSION` 1) of the artifact directory:

    train/train-00000-of-0000N.mindrecord (+ .db)   data.num_shards shards, blocks dealt round robin
    valid/valid-00000-of-00001.mindrecord (+ .db)   one shard
    tokenizer.model                                 SentencePiece model
    tokenizer.json                                  {vocab_size, unk_id, bos_id, eos_id, pad_id,
                                                     pad_fill_id, model_type, byte_fallback, ...}
    manifest.json                                   written by the store: metrics (documents seen /
        kept / skipped by reason, tokens, blocks and tail tokens per split, MB, seconds), inputs with
        sha256, resolved config, every file's sha256, and `data` (schema version, seq_length, files
        and block counts per split, tokenizer info)

    MindRecord columns, one row per block:
      input_ids  int32 [seq_length + 1]   inputs = input_ids[:-1], targets = input_ids[1:]
      loss_mask  int32 [seq_length]       1 where target input_ids[i + 1] counts, 0 at padding

Each split is one stream `tokens(doc_1) + [eos] + tokens(doc_2) + [eos] + ...` (no BOS) cut into
blocks of seq_length + 1 tokens; consecutive blocks do not overlap. The last partial block is
dropped or padded with `pad_fill_id` (`data.tail`); both are counted. Read blocks with
`tasks.dataset.open_blocks`.
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import io
import itertools
import json
import multiprocessing as mp
import os
import shutil
import sys
import time
import unicodedata
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import numpy as np

from tasks.artifacts import ArtifactStore, atomic_write_json, code_version, raw_file_input, sha256_file

if TYPE_CHECKING:
    from tasks.config import CleanSection, DataSection, PipelineConfig, TokenizerSection

DATA_SCHEMA_VERSION = 1
SPLITS = ("train", "valid")
SKIP_REASONS = ("binary", "invalid_utf8", "mostly_invalid", "empty", "whitespace", "too_short", "too_long", "duplicate")
MAX_REPLACEMENT_FRACTION = 0.5  # a document with more U+FFFD than this (after repair) is `mostly_invalid`
COLUMNS = {"input_ids": "int32 [seq_length + 1]", "loss_mask": "int32 [seq_length]"}
_SNIFF_BYTES = 8192
_MR_PAGE_SIZE = 1 << 20  # MindRecord pads every blob page to this size; the default (32 MiB) bloats small shards
_MR_HEADER_SIZE = 1 << 20  # room for ~6000 page entries (a few GB per shard)
_WRITE_BATCH = 2048


class DataError(ValueError):
    """Bad input or settings for the data stage; the message names the file (or key) and the fix."""


# ----------------------------------------------------------------------------- sources


@dataclass(frozen=True)
class Source:
    """One input: a local file (`path`) of `kind` text|jsonl|json|parquet, or a cached hub dataset (`hf`)."""

    name: str  # how messages name it: the path, or hf:NAME
    kind: str
    path: Path | None = None
    gz: bool = False


_KINDS = {".txt": "text", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


def _kind_of(path: Path) -> tuple[str, bool] | None:
    name = path.name.lower()
    gz = name.endswith(".gz")
    base = name[:-3] if gz else name
    for ext, kind in _KINDS.items():
        if base.endswith(ext) and not (gz and kind == "parquet"):
            return kind, gz
    return None


def resolve_sources(cfg: PipelineConfig) -> tuple[list[Source], list[str]]:
    """Expand `data.sources` into files (in order, each once) plus the files a directory/glob skipped.

    Raises DataError for a missing path, an unsupported file named explicitly, or nothing to read.
    """
    sources: list[Source] = []
    ignored: list[str] = []
    seen: set[Path] = set()
    if not cfg.data.sources:
        raise DataError("data.sources: empty; list at least one corpus file, directory or glob")
    for i, src in enumerate(cfg.data.sources):
        where = f"data.sources[{i}]"
        if src.startswith("hf:"):
            if not src[3:].strip():
                raise DataError(f"{where}: '{src}' names no dataset; write hf:NAME")
            sources.append(Source(src, "hf"))
            continue
        p = cfg.resolve_path(src)
        if any(ch in src for ch in "*?["):
            tops, explicit = [Path(m) for m in sorted(glob.glob(str(p), recursive=True))], False
        elif p.exists():
            tops, explicit = [p], p.is_file()
        else:
            raise DataError(f"{where}: '{src}' does not exist (looked in {p}); fix the path in data.sources")
        matched = 0
        for top in tops:
            if top.is_dir():
                files = sorted(
                    f for f in top.rglob("*") if f.is_file() and not any(s.startswith(".") for s in f.relative_to(top).parts)
                )
            else:
                files = [top]
            for f in files:
                kind = _kind_of(f)
                if kind is None:
                    if explicit:
                        raise DataError(
                            f"{where}: '{f}' is not a supported corpus file; use .txt, .jsonl, .json (each optionally .gz) "
                            "or .parquet, or convert it"
                        )
                    ignored.append(str(f))
                    continue
                matched += 1
                rp = f.resolve()
                if rp not in seen:
                    seen.add(rp)
                    sources.append(Source(str(f), kind[0], f, kind[1]))
        if not matched:
            raise DataError(
                f"{where}: '{src}' matches no .txt/.jsonl/.json/.parquet file (looked in {p}); fix the path or the glob"
            )
    return sources, ignored


def source_inputs(sources: list[Source]) -> list[dict[str, Any]]:
    """Lineage inputs: raw files by sha256; hub datasets by their `datasets` fingerprint."""
    out = []
    for s in sources:
        if s.kind == "hf":
            ds = _load_hf(s)
            out.append({"kind": "hf", "name": s.name, "digest": getattr(ds, "_fingerprint", None) or s.name})
        else:
            out.append(raw_file_input(s.path))
    return out


# ----------------------------------------------------------------------------- readers


def _open(src: Source):
    return gzip.open(src.path, "rb") if src.gz else open(src.path, "rb")


@contextlib.contextmanager
def _reading(src: Source):
    """Turn decompression and OS errors into a DataError that names the file."""
    try:
        yield
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"{src.name}: corrupt or truncated gzip ({exc}); re-download or re-compress the file") from None
    except OSError as exc:
        raise DataError(f"{src.name}: cannot read ({exc}); check the file") from None


def _record_text(rec: Any, field_name: str, where: str) -> str:
    if not isinstance(rec, dict):
        raise DataError(f"{where}: expected a JSON object with a '{field_name}' field, got {type(rec).__name__}")
    if field_name not in rec:
        keys = ", ".join(sorted(map(str, rec))[:10])
        raise DataError(f"{where}: no '{field_name}' field (keys: {keys}); set data.text_field")
    text = rec[field_name]
    if text is None:
        return ""
    if not isinstance(text, str):
        raise DataError(f"{where}: field '{field_name}' is {type(text).__name__}, not a string; set data.text_field")
    return text


def _paragraphs(f) -> Iterator[bytes]:
    """Runs of non-blank lines (a blank line holds only ASCII whitespace), without the last line break."""
    para: list[bytes] = []
    for line in f:
        if line.strip():
            para.append(line)
        elif para:
            yield b"".join(para).rstrip(b"\r\n")
            para = []
    if para:
        yield b"".join(para).rstrip(b"\r\n")


def read_documents(src: Source, data: DataSection) -> Iterator[str]:
    """The documents of one source, as str. Invalid UTF-8 bytes arrive as lone surrogates
    (surrogateescape) so that cleaning can replace or skip them per document."""
    if src.kind == "parquet" or src.kind == "hf":
        yield from _read_hf(src, data.text_field)
        return
    with _reading(src), _open(src) as f:
        if src.kind == "text":
            if data.txt_split == "file":
                yield f.read().decode("utf-8", "surrogateescape")
            else:
                for raw in _paragraphs(f):
                    yield raw.decode("utf-8", "surrogateescape")
        elif src.kind == "jsonl":
            yield from _jsonl(f, src.name, data.text_field)
        else:  # json: an array of records (or JSON Lines in a .json file)
            raw = f.read().decode("utf-8", "surrogateescape")
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as exc:
                if exc.msg != "Extra data":
                    raise DataError(f"{src.name}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix the file") from None
                yield from _jsonl(io.BytesIO(raw.encode("utf-8", "surrogateescape")), src.name, data.text_field)
                return
            records = obj if isinstance(obj, list) else [obj]
            for i, rec in enumerate(records):
                yield _record_text(rec, data.text_field, f"{src.name}[{i}]")


def _jsonl(f, name: str, field_name: str) -> Iterator[str]:
    for lineno, raw in enumerate(f, 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw.decode("utf-8", "surrogateescape"))
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{name}:{lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix or delete that line "
                "(JSON Lines holds one object per line)"
            ) from None
        yield _record_text(rec, field_name, f"{name}:{lineno}")


def _load_hf(src: Source):
    import datasets

    try:
        if src.kind == "parquet":
            return datasets.load_dataset("parquet", data_files=[str(src.path)], split="train", streaming=True)
        return datasets.load_dataset(src.name[3:].strip(), split="train")
    except Exception as exc:  # noqa: BLE001  (re-raised with the source named)
        hint = "check the file" if src.kind == "parquet" else "load it once with network access, or use local files"
        raise DataError(f"{src.name}: cannot load with HF datasets ({type(exc).__name__}: {exc}); {hint}") from None


def _read_hf(src: Source, field_name: str) -> Iterator[str]:
    ds = _load_hf(src)
    it = iter(ds)
    i = 0
    while True:
        try:
            row = next(it)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001  (pyarrow errors; re-raised with the file named)
            raise DataError(f"{src.name}: cannot read row {i} ({type(exc).__name__}: {exc}); check the file") from None
        yield _record_text(row, field_name, f"{src.name} row {i}")
        i += 1


def _is_binary(src: Source) -> bool:
    if src.kind not in ("text", "jsonl", "json"):
        return False
    with _reading(src), _open(src) as f:
        return b"\x00" in f.read(_SNIFF_BYTES)


# ----------------------------------------------------------------------------- cleaning


@dataclass
class CleanStats:
    """What cleaning saw and dropped; every document seen is kept or counted under one reason."""

    seen: int = 0
    kept: int = 0
    bytes_seen: int = 0
    bytes_kept: int = 0
    skipped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SKIP_REASONS, 0))
    repaired: dict[str, int] = field(default_factory=lambda: {"invalid_utf8": 0, "normalized": 0})
    files: int = 0
    skipped_files: list[dict[str, str]] = field(default_factory=list)


class Cleaner:
    """Apply `data.clean` to documents one at a time; `kept` holds the surviving texts in order."""

    def __init__(self, clean: CleanSection, stats: CleanStats | None = None):
        self.c = clean
        self.stats = stats or CleanStats()
        self.kept: list[str] = []
        self.kept_bytes: list[int] = []
        self._hashes: set[bytes] = set()

    def _skip(self, reason: str) -> None:
        self.stats.skipped[reason] += 1

    def add(self, text: str) -> bool:
        s = self.stats
        s.seen += 1
        try:
            raw, valid = text.encode("utf-8"), True
        except UnicodeEncodeError:  # lone surrogates: undecodable input bytes or JSON \ud800 escapes
            try:
                raw = text.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = text.encode("utf-8", "surrogatepass")
            valid = False
        s.bytes_seen += len(raw)
        if "\x00" in text:
            self._skip("binary")
            return False
        if not valid:
            if self.c.invalid_utf8 == "skip":
                self._skip("invalid_utf8")
                return False
            text = raw.decode("utf-8", "replace")
        if text and text.count("\ufffd") > MAX_REPLACEMENT_FRACTION * len(text):
            self._skip("mostly_invalid")
            return False
        if not valid:
            s.repaired["invalid_utf8"] += 1
        if self.c.normalize != "none" and not unicodedata.is_normalized(self.c.normalize, text):
            text = unicodedata.normalize(self.c.normalize, text)
            s.repaired["normalized"] += 1
        if not text:
            self._skip("empty")
            return False
        if text.isspace():
            self._skip("whitespace")
            return False
        if len(text) < self.c.min_chars:
            self._skip("too_short")
            return False
        if self.c.max_chars is not None and len(text) > self.c.max_chars:
            self._skip("too_long")
            return False
        data = text.encode("utf-8")
        if self.c.dedup:
            h = hashlib.sha256(data).digest()
            if h in self._hashes:
                self._skip("duplicate")
                return False
            self._hashes.add(h)
        s.kept += 1
        s.bytes_kept += len(data)
        self.kept.append(text)
        self.kept_bytes.append(len(data))
        return True


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
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="doc", unit_scale=True, disable=not enabled, file=sys.stderr,
                dynamic_ncols=True, mininterval=0.5)


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
        k, key = (max(1, round(data.validation_fraction * n)) if data.validation_fraction > 0 else 0), "data.validation_fraction"
    if k >= n:
        raise DataError(f"{key}: {k} held-out documents of {n} kept leaves nothing to train on; lower it or add text")
    if k == 0:
        raise DataError("data.validation_fraction: 0 leaves no held-out split; set a fraction > 0 or validation_documents")
    mask = np.zeros(n, dtype=bool)
    mask[np.random.default_rng(data.seed).choice(n, size=k, replace=False)] = True
    return mask


def plan_chunks(cfg: PipelineConfig, work_dir: Path, *, sources: list[Source] | None = None,
                progress: bool = False, tokenizer_sample: bool = True) -> Plan:
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
            chunks.append({"split": split, "index": k, "documents": int(stop - start), "bytes": int(nbytes),
                           "text_path": f"{stem}.jsonl", "tokens_path": f"{stem}.tokens.npy"})
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


# ----------------------------------------------------------------------------- tokenizer

_SPM_OPTIONS = dict(
    byte_fallback=True, normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
    split_digits=True, allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=3,
    num_threads=1, input_sentence_size=0, shuffle_input_sentence=False, hard_vocab_limit=True, minloglevel=2,
    required_chars="\u2581",  # the space symbol: without it, text without spaces (CJK) decodes " " as "▁"
)


def train_tokenizer(tok: TokenizerSection, sample_path: Path, out: Path) -> Path:
    """Train SentencePiece (`tok.model_type`, `tok.vocab_size`) on the sample file; write `out`."""
    import sentencepiece as spm

    buf = io.BytesIO()
    try:
        # an iterator rather than input=PATH: the model would record the (temporary) path and differ per run
        with open(sample_path, encoding="utf-8", newline="\n") as f:
            spm.SentencePieceTrainer.train(
                sentence_iterator=(line.rstrip("\n") for line in f), model_writer=buf, model_type=tok.model_type,
                vocab_size=tok.vocab_size, character_coverage=tok.character_coverage,
                max_sentence_length=tok.max_sentence_length, **_SPM_OPTIONS,
            )
    except RuntimeError as exc:
        msg = str(exc).split("] ")[-1].strip()
        if "required_chars" in msg:
            hint = "lower data.tokenizer.character_coverage (e.g. 0.9995) or raise vocab_size"
        elif "too high" in msg or "too large" in msg or "Vocabulary size" in msg:
            hint = "the sample is too small for this vocab_size; lower data.tokenizer.vocab_size and model.vocab_size, or add text"
        else:
            hint = "check data.tokenizer"
        raise DataError(f"data.tokenizer: SentencePiece training failed ({msg}); {hint}") from None
    out.write_bytes(buf.getvalue())
    return out


def load_tokenizer(path: str | os.PathLike):
    """A SentencePieceProcessor; DataError naming the file when it is missing or not a model."""
    import sentencepiece as spm

    p = Path(path)
    if not p.is_file():
        raise DataError(f"{p}: tokenizer model not found; fix data.tokenizer.path")
    try:
        return spm.SentencePieceProcessor(model_file=str(p))
    except (RuntimeError, OSError) as exc:
        raise DataError(f"{p}: not a SentencePiece model ({exc}); point data.tokenizer.path at a tokenizer.model") from None


def tokenizer_info(sp, model_bytes: bytes, source: str) -> dict[str, Any]:
    """What downstream stages need to know about the tokenizer (written as tokenizer.json)."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb

        proto = pb.ModelProto()
        proto.ParseFromString(model_bytes)
        ts, ns = proto.trainer_spec, proto.normalizer_spec
        model_type = pb.TrainerSpec.ModelType.Name(ts.model_type).lower()
        extra = {"byte_fallback": ts.byte_fallback, "add_dummy_prefix": ns.add_dummy_prefix,
                 "normalization": ns.name, "character_coverage": round(ts.character_coverage, 6)}
    except ImportError:  # protobuf missing: report what the processor knows
        model_type, extra = "unknown", {}
    return {
        "type": "sentencepiece", "file": "tokenizer.model", "source": source, "model_type": model_type,
        "vocab_size": sp.get_piece_size(), "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(),
        "pad_id": sp.pad_id(), "pad_fill_id": sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id(), **extra,
        "document_format": "tokens(document) + [eos_id], documents concatenated; no bos",
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
    }


def check_vocab(cfg: PipelineConfig, vocab: int, tokenizer: str | None) -> None:
    """The model's vocab_size must equal the tokenizer's piece count (before any heavy compute)."""
    mc = cfg.model.resolve()
    if tokenizer is not None and vocab != mc.vocab_size:
        raise DataError(
            f"{tokenizer}: tokenizer has {vocab} pieces but model.vocab_size is {mc.vocab_size} "
            f"(preset '{cfg.model.preset}'); set model.vocab_size: {vocab} — continued pretraining must keep "
            "the base model's tokenizer — or use a tokenizer of the model's size"
        )
    if tokenizer is None and vocab != mc.vocab_size:
        raise DataError(
            f"data.tokenizer.vocab_size: {vocab} differs from model.vocab_size={mc.vocab_size}; make them equal"
        )


# ----------------------------------------------------------------------------- tokenize one chunk (a mapped task)

_SP_CACHE: dict[str, Any] = {}


def chunk_specs(plan: Plan, tokenizer: Path) -> list[dict[str, Any]]:
    """The inputs of `tokenize_chunk`, in plan order (plain JSON-able dicts of paths)."""
    return [{**c, "tokenizer": str(tokenizer)} for c in plan.chunks]


def tokenize_chunk(spec: dict[str, Any]) -> str:
    """Tokenize one chunk file and join its documents with EOS into one int32 token stream.

    Pure (the output depends only on the files named in `spec`), so it can run in any process or
    on any Dask worker sharing the file system. Writes `spec["tokens_path"]` (np.save, no pickle)
    and a summary JSON beside it; returns the summary's path.
    """
    import sentencepiece as spm

    tok = spec["tokenizer"]
    sp = _SP_CACHE.get(tok)
    if sp is None:
        sp = _SP_CACHE[tok] = spm.SentencePieceProcessor(model_file=tok)
    with open(spec["text_path"], encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    ids = sp.encode(docs, num_threads=1) if docs else []
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    n_text = int(lens.sum())
    stream = np.empty(n_text + len(ids), dtype=np.int32)
    eos_at = np.cumsum(lens + 1) - 1
    is_text = np.ones(len(stream), dtype=bool)
    is_text[eos_at] = False
    stream[is_text] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=n_text)
    stream[eos_at] = sp.eos_id()
    np.save(spec["tokens_path"], stream, allow_pickle=False)
    summary = {k: spec[k] for k in ("split", "index", "documents", "bytes", "tokens_path")}
    summary["tokens"] = int(len(stream))
    out = str(Path(spec["tokens_path"]).with_suffix("").with_suffix(".json"))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(summary, f)
    return out


# ----------------------------------------------------------------------------- finalize: cut blocks, write shards


class _SplitWriter:
    """Cut one split's token stream into blocks and deal them round robin over MindRecord shards."""

    def __init__(self, out_dir: Path, split: str, num_shards: int, seq_length: int):
        from mindspore.mindrecord import FileWriter

        self.split, self.L, self.S = split, seq_length, num_shards
        (out_dir / split).mkdir(parents=True, exist_ok=True)
        self.files = [f"{split}/{split}-{s:05d}-of-{num_shards:05d}.mindrecord" for s in range(num_shards)]
        self.writers = []
        for rel in self.files:
            w = FileWriter(str(out_dir / rel), shard_num=1, overwrite=True)
            w.set_page_size(_MR_PAGE_SIZE)
            w.set_header_size(_MR_HEADER_SIZE)
            w.add_schema({"input_ids": {"type": "int32", "shape": [seq_length + 1]},
                          "loss_mask": {"type": "int32", "shape": [seq_length]}}, "packed token blocks")
            self.writers.append(w)
        self.pending: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(num_shards)]
        self.shard_blocks = [0] * num_shards
        self.carry = np.zeros(0, dtype=np.int32)
        self.blocks = 0
        self.tokens = self.documents = self.bytes = self.chunks = 0
        self.tail_dropped = self.tail_padded = 0

    def _put(self, blocks: np.ndarray, masks: np.ndarray) -> None:
        """Blocks [n, L+1] with masks [n, L], in stream order; block g goes to shard g % S."""
        for s in range(self.S):
            first = (s - self.blocks) % self.S
            if first < len(blocks):
                self.pending[s].append((blocks[first::self.S], masks[first::self.S]))
                self.shard_blocks[s] += len(blocks[first::self.S])
                if sum(len(b) for b, _ in self.pending[s]) >= _WRITE_BATCH:
                    self._flush(s)
        self.blocks += len(blocks)

    def _flush(self, s: int) -> None:
        if self.pending[s]:
            ids = np.concatenate([b for b, _ in self.pending[s]])
            masks = np.concatenate([m for _, m in self.pending[s]])
            _write_rows(self.writers[s], {"input_ids": ids, "loss_mask": masks})
            self.pending[s] = []

    def add(self, stream: np.ndarray) -> None:
        buf = np.concatenate([self.carry, stream]) if len(self.carry) else stream
        width = self.L + 1
        n = len(buf) // width
        if n:
            self._put(buf[: n * width].reshape(n, width), np.ones((n, self.L), dtype=np.int32))
        self.carry = buf[n * width:].copy()

    def close(self, tail: str, pad_id: int, out_dir: Path) -> dict[str, Any]:
        r = len(self.carry)
        if tail == "pad" and r >= 2:  # a one-token tail has no target to learn
            block = np.full(self.L + 1, pad_id, dtype=np.int32)
            block[:r] = self.carry
            mask = np.zeros(self.L, dtype=np.int32)
            mask[: r - 1] = 1
            self._put(block[None], mask[None])
            self.tail_padded = self.L + 1 - r
        else:
            self.tail_dropped = r
        if min(self.shard_blocks) == 0:
            if self.split == "train":
                fix = "lower data.num_shards or data.seq_length, or add text"
            else:
                fix = "raise data.validation_fraction (or validation_documents), lower data.seq_length, or set data.tail: pad"
            raise DataError(
                f"{self.split} split: {self.tokens} tokens make {self.blocks} block(s) of {self.L + 1} tokens, "
                f"too few for {self.S} shard(s); {fix}"
            )
        for s, w in enumerate(self.writers):
            self._flush(s)
            w.commit()
        _check_shards(out_dir, self.files, self.shard_blocks)
        return {"files": self.files, "blocks": self.blocks, "shard_blocks": self.shard_blocks, "tokens": self.tokens,
                "documents": self.documents, "bytes": self.bytes, "chunks": self.chunks,
                "tail_tokens_dropped": self.tail_dropped, "tail_tokens_padded": self.tail_padded}


_FAST_WRITE = True


def _write_rows(w, columns: dict[str, np.ndarray]) -> None:
    """`FileWriter.write_raw_data` for int32 array columns, without its per-row Python checks and blob
    merging (3x faster at seq 128). The C writer receives the same bytes as through the public path:
    per row and blob field, an 8-byte big-endian length, then the array's bytes (test_data.py checks
    that both paths write identical files). Falls back to the public path if MindSpore's internals move."""
    n = len(next(iter(columns.values())))
    inner = getattr(w, "_writer", None)
    c_writer = getattr(inner, "_writer", None)
    fields = list(getattr(getattr(w, "_header", None), "blob_fields", None) or [])
    if not _FAST_WRITE or c_writer is None or sorted(fields) != sorted(columns) or not hasattr(inner, "is_open"):
        w.write_raw_data([{k: v[i] for k, v in columns.items()} for i in range(n)])
        return
    if not inner.is_open:
        inner.open(w._paths, w._overwrite)
    if not inner.get_shard_header():
        inner.set_shard_header(w._header)
    parts = []
    for f in fields:
        a = np.ascontiguousarray(columns[f], dtype="<i4").reshape(n, -1).view(np.uint8)
        parts.append(np.broadcast_to(np.frombuffer(a.shape[1].to_bytes(8, "big"), dtype=np.uint8), (n, 8)))
        parts.append(a)
    rows = np.concatenate(parts, axis=1)
    import mindspore._c_mindrecord as cm

    if c_writer.write_raw_data({}, [r.tobytes() for r in rows], True, False) != cm.MSRStatus.SUCCESS:
        raise DataError(f"{w._paths[0]}: MindRecord write failed; check free disk space")


def _check_shards(out_dir: Path, files: list[str], expected: list[int]) -> None:
    """Read back each shard's row count: MindRecord can write files it cannot read (header overflow)."""
    import mindspore.dataset as ds

    for rel, n in zip(files, expected):
        try:
            got = ds.MindDataset(str(out_dir / rel), columns_list=["loss_mask"], shuffle=False).get_dataset_size()
        except RuntimeError as exc:
            raise DataError(f"{rel}: written but unreadable ({str(exc).strip()[:200]}); raise data.num_shards") from None
        if got != n:
            raise DataError(f"{rel}: holds {got} rows, expected {n}; raise data.num_shards and rerun")


def finalize(results: Iterable[str | os.PathLike], out_dir: Path, *, seq_length: int, num_shards: int,
             tail: str, pad_id: int, on_chunk: Callable[[dict], None] | None = None) -> dict[str, dict[str, Any]]:
    """Concatenate the chunks' token streams per split (results in plan order: train chunks by index,
    then valid), cut blocks of seq_length + 1 and write the MindRecord shards under `out_dir`.
    Streams: each chunk is written as it arrives. Returns {split: files, blocks, tokens, ...}."""
    out_dir = Path(out_dir)
    writers: dict[str, _SplitWriter] = {}
    done: dict[str, dict[str, Any]] = {}
    last: tuple[int, int] = (-1, -1)
    for path in results:
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        split = summary["split"]
        order = (SPLITS.index(split), summary["index"])
        if order <= last:
            raise ValueError(f"finalize: chunk results out of plan order ({split} {summary['index']} after {last})")
        last = order
        if split not in writers:
            for prev in list(writers):
                done[prev] = writers.pop(prev).close(tail, pad_id, out_dir)
            writers[split] = _SplitWriter(out_dir, split, num_shards if split == "train" else 1, seq_length)
        w = writers[split]
        stream = np.load(summary["tokens_path"], allow_pickle=False)
        w.add(stream)
        w.tokens += int(len(stream))
        w.documents += summary["documents"]
        w.bytes += summary["bytes"]
        w.chunks += 1
        if on_chunk is not None:
            on_chunk(summary)
    for split in list(writers):
        done[split] = writers.pop(split).close(tail, pad_id, out_dir)
    missing = [s for s in SPLITS if s not in done]
    if missing:
        raise DataError(f"finalize: no chunks for split(s) {missing}; the plan must hold train and valid documents")
    return done


# ----------------------------------------------------------------------------- run


def _key_config(cfg: PipelineConfig, reused_tokenizer: bool) -> dict[str, Any]:
    """The data section minus settings that do not change the output bytes (workers, chunking)."""
    section = cfg.section("data")
    for k in ("num_workers", "chunk_documents", "chunk_bytes", "executor", "dask_address"):
        section.pop(k, None)
    if reused_tokenizer:  # identified by its sha256 among the inputs, not by where it lies
        section["tokenizer"] = {"reused": True}
    return section


@contextlib.contextmanager
def _pool_map(num_workers: int, n_tasks: int):
    """`map` in this process, or an ordered map over spawned worker processes (a dead worker raises
    BrokenProcessPool instead of hanging; spawn, not fork: never fork a process holding MindSpore threads)."""
    if num_workers <= 1 or n_tasks <= 1:
        yield map
        return
    with ProcessPoolExecutor(min(num_workers, n_tasks), mp_context=mp.get_context("spawn")) as pool:
        try:
            yield pool.map
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise


def stage_key(cfg: PipelineConfig, store: ArtifactStore, tokenizer_model: Path | None = None):
    """(key, inputs, (sources, ignored files, tokenizer path)): the content key, before any heavy work.

    Also checks the model's vocab size against the tokenizer (the reused one, or the one to train).
    """
    d = cfg.data
    sources, ignored = resolve_sources(cfg)
    tok_path = Path(tokenizer_model) if tokenizer_model else (cfg.resolve_path(d.tokenizer.path) if d.tokenizer.path else None)
    if tok_path is not None:
        base = load_tokenizer(tok_path)
        check_vocab(cfg, base.get_piece_size(), str(tok_path))
        if base.eos_id() < 0:
            raise DataError(f"{tok_path}: tokenizer has no EOS piece to join documents with; use another tokenizer.model")
    else:
        check_vocab(cfg, d.tokenizer.vocab_size, None)
    inputs = source_inputs(sources) + ([raw_file_input(tok_path)] if tok_path else [])
    key = store.key("data", _key_config(cfg, tok_path is not None), inputs, code_version("data"))
    return key, inputs, (sources, ignored, tok_path)


def run(cfg: PipelineConfig, store: ArtifactStore, tokenizer_model: Path | None = None, progress: bool = True,
        map_fn: Callable[[Callable, list], Iterable] | None = None) -> Path:
    """Build (or find cached) the data artifact of `cfg`; returns its directory.

    `tokenizer_model` overrides `data.tokenizer.path` (continued pretraining passes the base model's).
    `map_fn(tokenize_chunk, specs)` replaces the local process pool (e.g. a Dask client's map); it
    must yield the results in the order of `specs`.
    """
    t0 = time.perf_counter()
    d = cfg.data
    log = (lambda msg: print(f"data: {msg}", file=sys.stderr, flush=True)) if progress else (lambda msg: None)
    key, inputs, (sources, ignored, tok_path) = stage_key(cfg, store, tokenizer_model)
    code = code_version("data")
    hit = store.lookup("data", key)
    if hit is not None:
        log(f"cache hit {hit}")
        return hit
    config = cfg.section("data")
    if tok_path is not None:
        config["tokenizer"]["path"] = str(tok_path)
    with store.build("data", key, pipeline=cfg.name, config=config, inputs=inputs, code=code) as b:
        work = b.dir / "_work"
        plan = plan_chunks(cfg, work, sources=sources, progress=progress, tokenizer_sample=tok_path is None)
        st = plan.stats
        log(f"{st.seen} documents ({st.bytes_seen / 1e6:.1f} MB) from {st.files} file(s): kept {st.kept}, "
            f"skipped {sum(st.skipped.values())} {({k: v for k, v in st.skipped.items() if v})}")
        t_tok = time.perf_counter()
        tok_file = b.dir / "tokenizer.model"
        if tok_path is not None:
            shutil.copyfile(tok_path, tok_file)
            source = "reused"
        else:
            log(f"training a {d.tokenizer.model_type} tokenizer, vocab {d.tokenizer.vocab_size}, "
                f"on {plan.sample_documents} documents")
            train_tokenizer(d.tokenizer, plan.sample_path, tok_file)
            source = "trained"
        sp = load_tokenizer(tok_file)
        check_vocab(cfg, sp.get_piece_size(), str(tok_file) if tok_path else None)
        info = tokenizer_info(sp, tok_file.read_bytes(), source)
        atomic_write_json(b.dir / "tokenizer.json", info)
        t_tokenize = time.perf_counter()
        specs = chunk_specs(plan, tok_file)
        kept = sum(plan.documents.values())
        with _progress_bar(progress, "tokenize+write", total=kept) as bar:
            counts = {"bytes": 0, "tokens": 0}

            def on_chunk(s: dict) -> None:
                counts["bytes"] += s["bytes"]
                counts["tokens"] += s["tokens"]
                bar.update(s["documents"])
                _postfix(bar, counts["bytes"], counts["tokens"])

            with contextlib.ExitStack() as stack:
                mapper = map_fn or stack.enter_context(_pool_map(d.num_workers, len(specs)))
                written = finalize(mapper(tokenize_chunk, specs), b.dir, seq_length=d.seq_length,
                                   num_shards=d.num_shards, tail=d.tail, pad_id=info["pad_fill_id"], on_chunk=on_chunk)
        shutil.rmtree(work)
        t_end = time.perf_counter()
        per = {k: {s: written[s][k] for s in SPLITS} for k in ("documents", "tokens", "blocks", "tail_tokens_dropped",
                                                               "tail_tokens_padded")}
        b.metrics.update({
            "documents_seen": st.seen,
            "documents_kept": st.kept,
            "documents_skipped": dict(st.skipped),
            "documents_skipped_total": sum(st.skipped.values()),
            "documents_repaired": dict(st.repaired),
            "files": st.files,
            "files_skipped": len(st.skipped_files),
            "raw_text_mb": round(st.bytes_seen / 1e6, 3),
            "kept_text_mb": round(st.bytes_kept / 1e6, 3),
            **per,
            "tokenizer_sample_documents": plan.sample_documents,
            "seconds": {"read_clean": round(plan.seconds, 3), "tokenizer": round(t_tokenize - t_tok, 3),
                        "tokenize_write": round(t_end - t_tokenize, 3), "total": round(t_end - t0, 3)},
            "mb_per_s": round(st.bytes_seen / 1e6 / max(t_end - t0, 1e-9), 3),
        })
        b.extra["data"] = {
            "schema_version": DATA_SCHEMA_VERSION,
            "seq_length": d.seq_length,
            "block_length": d.seq_length + 1,
            "columns": COLUMNS,
            "tail": d.tail,
            "splits": {s: {k: written[s][k] for k in ("files", "blocks", "shard_blocks", "tokens", "documents")}
                       for s in SPLITS},
            "tokenizer": info,
            "tokenizer_source_path": str(tok_path) if tok_path else None,
            "skipped_files": st.skipped_files,
            "ignored_files": ignored,
        }
    log(f"train {per['blocks']['train']} blocks / valid {per['blocks']['valid']} blocks of {d.seq_length + 1} tokens "
        f"in {time.perf_counter() - t0:.1f}s")
    return b.path


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
        if fp.stat().st_size != entry["size"] or sha256_file(fp) != entry["sha256"]:
            raise DataError(f"{fp}: sha256 differs from the manifest (truncated or corrupt); rerun the data stage "
                            "(`msllm data`) or restore the file")
    return manifest
