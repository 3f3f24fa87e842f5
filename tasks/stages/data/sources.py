"""Step 1: find and read the inputs (`data.sources`): files, directories, globs, `hf:NAME`; streaming text readers."""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.stages.data.schema import _SNIFF_BYTES
from tasks.store.artifacts import raw_file_input
from tasks.store.data_schema import DataError

if TYPE_CHECKING:
    from tasks.config.schema import DataSection, PipelineConfig

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
                    f
                    for f in top.rglob("*")
                    if f.is_file() and not any(s.startswith(".") for s in f.relative_to(top).parts)
                )
            else:
                files = [top]
            for f in files:
                kind = _kind_of(f)
                if kind is None:
                    if explicit:
                        raise DataError(
                            f"{where}: '{f}' is not a supported corpus file; use .txt, .jsonl, .json (each optionally "
                            ".gz) "
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
                    raise DataError(
                        f"{src.name}:{exc.lineno}: not valid JSON ({exc.msg}, column {exc.colno}); fix the file"
                    ) from None
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
    import datasets  # lazy: ~1 s, for parquet and hf: sources only

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
