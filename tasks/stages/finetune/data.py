"""The finetune stage's data: instruction / text records read, rendered, tokenised and packed into
examples; the train/validation split and the resumable batch stream `fit` reads.

Data (`finetune.sources`, tokenised with the base artifact's tokenizer.model):

- `format: instruction`: JSON Lines (or .jsonl.gz, or a .json list) of
  `{"prompt": ..., "response": ...}` or chat `{"messages": [{"role": "system"|"user"|"assistant",
  "content": ...}, ...]}`. Each example is rendered with tasks.prompts.TEMPLATE and the loss
  covers the response tokens only (prompt, template and padding labels are -100):

      ### Instruction:\\n{prompt}\\n\\n### Response:\\n{response}</s>

  A system message renders as `### System:\\n{content}\\n\\n`; each user turn as the
  instruction part, each assistant turn as a response (trained, closed by EOS).
  No BOS: examples start like a document after EOS in the pretraining stream.
  Each segment is tokenised on its own, so the prompt/response boundary is exact;
  `tasks.prompts.prompt_ids(sp, prompt)` gives generation the same prompt tokens. An example
  longer than `finetune.seq_length` + 1 tokens loses prompt tokens first (from the
  end of the prompt), then is cut on the right; one left without response tokens is
  dropped. Shorter ones are padded (labels -100). The manifest counts each case.
- `format: text`: .txt files (one document each) or JSON Lines with `data.text_field`,
  tokenised, joined with EOS and cut into blocks of seq_length + 1 (every token trained):
  domain adaptation.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config.rules import expand_source
from tasks.config.schema import ConfigError, PipelineConfig
from tasks.prompts import chat_example, encode_segments, record_messages, to_segments

IGNORE = -100
_DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".txt")


# ----------------------------------------------------------------------------- reading examples


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")


def read_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, record) for every JSON record of a .jsonl[.gz] or .json[.gz] file; `where` is `file:line`."""
    with _open_text(path) as f:
        if ".jsonl" in path.name:
            out = []
            for i, line in enumerate(f, 1):
                if line.strip():
                    try:
                        out.append((f"{path}:{i}", json.loads(line)))
                    except json.JSONDecodeError as exc:
                        raise ValueError(f"{path}:{i}: not valid JSON ({exc.msg})") from None
            return out
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    data = data if isinstance(data, list) else [data]
    return [(f"{path}[{i}]", r) for i, r in enumerate(data)]


# A segment is (text, kind): FIXED template text and PROMPT text carry no loss, RESPONSE text does.
# Only PROMPT segments shrink when an example is too long, so the response survives.
FIXED, PROMPT, RESPONSE = "fixed", "prompt", "response"


def pack_example(
    tokens: list[int], trained: list[bool], seq_length: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """(input_ids [T], labels [T], truncated): labels[t] = tokens[t+1] where that token is trained, else -100.

    Labels are aligned with the inputs (causal_lm_loss does not shift); padding and
    anything past seq_length + 1 tokens carry no loss.
    """
    t = np.asarray(tokens, np.int64)
    keep = np.asarray(trained, bool)
    ids = np.full(seq_length, pad_id, np.int32)
    labels = np.full(seq_length, IGNORE, np.int32)
    n = min(len(t) - 1, seq_length)
    if n > 0:
        ids[:n] = t[:n]
        labels[:n] = np.where(keep[1 : n + 1], t[1 : n + 1], IGNORE)
    return ids, labels, len(t) - 1 > seq_length


@dataclass
class Examples:
    """Packed examples of one split: input_ids and labels, both [n, seq_length] int32."""

    ids: np.ndarray
    labels: np.ndarray

    def __len__(self) -> int:
        return len(self.ids)

    def take(self, idx: np.ndarray) -> Examples:
        return Examples(self.ids[idx], self.labels[idx])


@dataclass
class FinetuneData:
    train: Examples
    valid: Examples | None
    stats: dict[str, Any] = field(default_factory=dict)


def instruction_examples(
    files: list[Path], sp, seq_length: int, eos_id: int, pad_id: int
) -> tuple[Examples, dict[str, Any]]:
    ids, labels, shortened, truncated, dropped, lengths = [], [], 0, 0, 0, []
    for path in files:
        for where, rec in read_records(path):
            segments = to_segments(rec, where)  # validates the record either way
            if sp.chat_template is not None:  # the model's own template (a tokenizer.json model's)
                tokens, trained = chat_example(sp, record_messages(rec, where), where)
                short = False
                lengths.append(len(tokens))
            else:
                lengths.append(len(encode_segments(sp, segments, eos_id)[0]))
                tokens, trained, short = encode_segments(sp, segments, eos_id, max_tokens=seq_length + 1)
            x, y, cut = pack_example(tokens, trained, seq_length, pad_id)
            if not (y != IGNORE).any():
                dropped += 1  # no response token left inside seq_length
                continue
            shortened += short
            truncated += cut
            ids.append(x)
            labels.append(y)
    if not ids:
        raise ValueError(
            f"no usable instruction examples in {[str(f) for f in files]} (dropped {dropped} whose "
            f"response did not fit finetune.seq_length={seq_length})"
        )
    stats = {
        "examples": len(ids),
        "shortened_prompts": shortened,
        "truncated_responses": truncated,
        "dropped_examples": dropped,
        "mean_tokens": round(float(np.mean(lengths)), 1),
        "max_tokens": int(np.max(lengths)),
    }
    return Examples(np.stack(ids), np.stack(labels)), stats


def read_documents(path: Path, text_field: str) -> list[str]:
    if path.suffix == ".txt":
        return [path.read_text(encoding="utf-8")]
    docs = []
    for where, rec in read_records(path):
        text = rec.get(text_field) if isinstance(rec, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"{where}: no string field {text_field!r} (set data.text_field)")
        docs.append(text)
    return docs


def text_examples(
    files: list[Path], sp, seq_length: int, eos_id: int, text_field: str
) -> tuple[Examples, dict[str, Any]]:
    """Documents joined with EOS, cut into blocks of seq_length + 1 tokens (the tail is dropped); all trained."""
    docs = [d for f in files for d in read_documents(f, text_field)]
    stream = np.fromiter((t for ids in sp.encode_batch(docs) for t in (*ids, eos_id)), np.int64)
    n = len(stream) // (seq_length + 1)
    if n == 0:
        raise ValueError(f"finetune.sources hold {len(stream)} tokens, fewer than one block of {seq_length + 1}")
    blocks = stream[: n * (seq_length + 1)].reshape(n, seq_length + 1).astype(np.int32)
    return (
        Examples(np.ascontiguousarray(blocks[:, :-1]), np.ascontiguousarray(blocks[:, 1:])),
        {"documents": len(docs), "examples": n, "tokens": int(len(stream))},
    )


def split(n: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, valid) indices: a seeded random `fraction` held out (at least one when fraction > 0 and n > 1)."""
    n_valid = 0 if fraction <= 0 or n < 2 else min(n - 1, max(1, round(n * fraction)))
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[n_valid:]), np.sort(perm[:n_valid])


def example_batches(
    ex: Examples,
    batch_size: int,
    seed: int,
    start_sample: int = 0,
    repeat: bool = True,
    shuffle: bool = True,
    pad_id: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids [B, T], labels [B, T]) from global sample `start_sample` on.

    Sample k is example order_e[k mod n] of epoch e = k // n, where order_e is a
    permutation drawn from (seed, e), so any start position reproduces the stream a
    run from 0 would have seen (the `batches(start_sample)` contract of `fit`).
    Without repeat the last partial batch is filled with rows that carry no loss,
    keeping the batch shape (and the compiled graph) fixed.
    """
    n, t = ex.ids.shape
    orders: dict[int, np.ndarray] = {}

    def order(epoch: int) -> np.ndarray:
        if epoch not in orders:
            orders.clear()
            orders[epoch] = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        return orders[epoch]

    s = start_sample
    while repeat or s < n:
        stop = s + batch_size if repeat else min(s + batch_size, n)
        idx = np.array([order(k // n)[k % n] for k in range(s, stop)])
        ids, labels = ex.ids[idx], ex.labels[idx]
        if len(idx) < batch_size:
            ids = np.concatenate([ids, np.full((batch_size - len(idx), t), pad_id, np.int32)])
            labels = np.concatenate([labels, np.full((batch_size - len(idx), t), IGNORE, np.int32)])
        yield ids, labels
        s = stop


def load_data(cfg: PipelineConfig, sp, seq_length: int) -> FinetuneData:
    ft = cfg.finetune
    files = source_files(cfg)
    eos = sp.eos_id()
    pad = sp.pad_id() if sp.pad_id() >= 0 else eos
    if ft.format == "instruction":
        allx, stats = instruction_examples(files, sp, seq_length, eos, pad)
    else:
        allx, stats = text_examples(files, sp, seq_length, eos, cfg.data.text_field)
    tr, va = split(len(allx), ft.validation_fraction, ft.seed)
    stats.update(
        train_examples=len(tr), valid_examples=len(va), train_label_tokens=int((allx.labels[tr] != IGNORE).sum())
    )
    return FinetuneData(allx.take(tr), allx.take(va) if len(va) else None, stats)


def source_files(cfg: PipelineConfig) -> list[Path]:
    """finetune.sources expanded (files, directories, globs) to a sorted, de-duplicated file list."""
    if not cfg.finetune.sources:
        raise ConfigError(
            [f"pipelines.{cfg.name}.finetune.sources: empty; list the instruction (.jsonl) or text files"]
        )
    files: list[Path] = []
    for i, src in enumerate(cfg.finetune.sources):
        found = []
        for p in expand_source(cfg, src):
            if p.is_dir():
                found += sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(_DATA_SUFFIXES))
            elif p.is_file():
                found.append(p)
        if not found:
            raise ConfigError(
                [
                    f"pipelines.{cfg.name}.finetune.sources[{i}]: '{src}' matches no data file "
                    f"({', '.join(_DATA_SUFFIXES)}); fix the path"
                ]
            )
        for p in found:
            if not p.name.endswith(_DATA_SUFFIXES):
                raise ConfigError(
                    [
                        f"pipelines.{cfg.name}.finetune.sources[{i}]: {p.name}: unsupported file type; "
                        f"use one of {', '.join(_DATA_SUFFIXES)}"
                    ]
                )
            if cfg.finetune.format == "instruction" and p.suffix == ".txt":
                raise ConfigError(
                    [
                        f"pipelines.{cfg.name}.finetune.sources[{i}]: {p.name} is plain text but "
                        "finetune.format is 'instruction'; set format: text or pass JSON Lines"
                    ]
                )
        files += found
    return sorted({p.resolve() for p in files})
