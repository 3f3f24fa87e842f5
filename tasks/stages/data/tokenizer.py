"""Step 4: train a SentencePiece tokenizer (or reuse a tokenizer.model / tokenizer.json), and tokenize one chunk (the
mapped task)."""

from __future__ import annotations

import io
import itertools
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.stages.data.plan import Plan
from tasks.store.data_schema import DataError
from tasks.tokenizer import load_tokenizer as _load
from tasks.tokenizer_error import TokenizerError

if TYPE_CHECKING:
    from tasks.config.schema import PipelineConfig, TokenizerSection

# ----------------------------------------------------------------------------- tokenizer

_SPM_OPTIONS = dict(
    byte_fallback=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    split_digits=True,
    allow_whitespace_only_pieces=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=3,
    num_threads=1,
    input_sentence_size=0,
    shuffle_input_sentence=False,
    hard_vocab_limit=True,
    minloglevel=2,
    required_chars="\u2581",  # the space symbol: without it, text without spaces (CJK) decodes " " as "▁"
)


def train_tokenizer(tok: TokenizerSection, sample_path: Path, out: Path) -> Path:
    """Train SentencePiece (`tok.model_type`, `tok.vocab_size`) on the sample file; write `out`."""
    import sentencepiece as spm  # lazy: sentencepiece, only when a tokenizer is trained

    buf = io.BytesIO()
    try:
        # an iterator rather than input=PATH: the model would record the (temporary) path and differ per run
        with open(sample_path, encoding="utf-8", newline="\n") as f:
            spm.SentencePieceTrainer.train(
                sentence_iterator=(line.rstrip("\n") for line in f),
                model_writer=buf,
                model_type=tok.model_type,
                vocab_size=tok.vocab_size,
                character_coverage=tok.character_coverage,
                max_sentence_length=tok.max_sentence_length,
                **_SPM_OPTIONS,
            )
    except RuntimeError as exc:
        msg = str(exc).split("] ")[-1].strip()
        if "required_chars" in msg:
            hint = "lower data.tokenizer.character_coverage (e.g. 0.9995) or raise vocab_size"
        elif "too high" in msg or "too large" in msg or "Vocabulary size" in msg:
            hint = (
                "the sample is too small for this vocab_size; lower data.tokenizer.vocab_size and model.vocab_size, "
                "or add text"
            )
        else:
            hint = "check data.tokenizer"
        raise DataError(f"data.tokenizer: SentencePiece training failed ({msg}); {hint}") from None
    out.write_bytes(buf.getvalue())
    return out


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of a file or directory (tokenizer.model or tokenizer.json); DataError naming it when it is
    missing or unreadable."""
    p = Path(path)
    if not p.exists():
        raise DataError(
            f"{p}: tokenizer not found; fix data.tokenizer.path (a tokenizer.model, a tokenizer.json or "
            "a directory holding one)"
        )
    try:
        return _load(p)
    except TokenizerError as exc:
        raise DataError(f"{exc} (data.tokenizer.path)") from None


def tokenizer_info(tok, source: str) -> dict[str, Any]:
    """What downstream stages need to know about the tokenizer (written as tokenizer_info.json)."""
    extra = tok.model_proto() if tok.kind == "sentencepiece" else {}
    return {
        **tok.info(),
        "source": source,
        **extra,
        "document_format": "prompt_ids(document) + [eos_id], documents concatenated",
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

_TOKENIZERS: dict[str, Any] = {}  # per worker process, by path


def document_ids(tok, docs: list[str]) -> list[list[int]]:
    """Each document's ids before its EOS: as the tokenizer starts a document (`prompt_ids`) minus a SentencePiece
    model's leading EOS, which the previous document's EOS already is."""
    if tok.kind == "sentencepiece":
        return tok.encode_batch(docs)
    return [tok.prompt_ids(d) for d in docs]


def chunk_specs(plan: Plan, tokenizer: Path) -> list[dict[str, Any]]:
    """The inputs of `tokenize_chunk`, in plan order (plain JSON-able dicts of paths)."""
    return [{**c, "tokenizer": str(tokenizer)} for c in plan.chunks]


def tokenize_chunk(spec: dict[str, Any]) -> str:
    """Tokenize one chunk file and join its documents with EOS into one int32 token stream.

    Pure (the output depends only on the files named in `spec`), so it can run in any process or
    on any Dask worker sharing the file system. Writes `spec["tokens_path"]` (np.save, no pickle)
    and a summary JSON beside it; returns the summary's path.
    """
    where = spec["tokenizer"]
    tok = _TOKENIZERS.get(where)
    if tok is None:
        tok = _TOKENIZERS[where] = _load(where)
    with open(spec["text_path"], encoding="utf-8") as f:
        docs = [json.loads(line) for line in f]
    ids = document_ids(tok, docs)
    lens = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    n_text = int(lens.sum())
    stream = np.empty(n_text + len(ids), dtype=np.int32)
    eos_at = np.cumsum(lens + 1) - 1
    is_text = np.ones(len(stream), dtype=bool)
    is_text[eos_at] = False
    stream[is_text] = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=n_text)
    stream[eos_at] = tok.eos_id()
    np.save(spec["tokens_path"], stream, allow_pickle=False)
    summary = {k: spec[k] for k in ("split", "index", "documents", "bytes", "tokens_path")}
    summary["tokens"] = int(len(stream))
    out = str(Path(spec["tokens_path"]).with_suffix("").with_suffix(".json"))
    with open(out, "w", encoding="utf-8") as f:
        json.dump(summary, f)
    return out
