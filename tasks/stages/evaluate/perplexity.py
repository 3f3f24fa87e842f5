"""Perplexity and bits per byte: of documents (eval.perplexity_files, in lm-eval's rolling windows), of a data
artifact's held-out blocks, and of the base model a model's chain started from (`base_chain`) on those blocks."""

from __future__ import annotations

import gc
import gzip
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tasks.stages import MODEL_KINDS
from tasks.store.artifacts import ArtifactStore
from tasks.store.errors import ArtifactError
from tasks.store.reader import block_batches
from tasks.tokenizer import files_sha256, tokenizer_files


def read_documents(path: Path) -> list[str]:
    """The documents of a perplexity file: plain text (one document), or JSON Lines with a "text" field; gzip too."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        if path.name.removesuffix(".gz").endswith((".jsonl", ".json")):
            docs = []
            for n, line in enumerate(f, 1):
                if line.strip():
                    rec = json.loads(line)
                    if not isinstance(rec, dict) or not isinstance(rec.get("text"), str):
                        raise ValueError(f'{path}:{n}: expected a JSON object with a "text" string')
                    docs.append(rec["text"])
            return docs
        return [f.read()]


def _ppl_row(total_logprob: float, tokens: int, nbytes: int) -> dict[str, Any]:
    nll = -total_logprob
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "perplexity": math.exp(nll / tokens) if tokens else None,
        "bits_per_byte": nll / (math.log(2) * nbytes) if nbytes else None,
    }


def documents_perplexity(lm, docs: Iterable[str], progress: bool = False) -> dict[str, Any]:
    """Token perplexity and bits per byte of documents, each scored alone after the prefix token.

    Windows of max_length predictions, each with as much context as fits: the last window
    of a long document re-reads the tokens before it, as lm-eval's rolling loglikelihood
    does, so the total equals `loglikelihood_rolling` of each document (checked in tests).
    Bytes are the documents' UTF-8 bytes, as in lm-eval's bits_per_byte.
    """
    L = lm.max_length
    rows, spans, tokens, nbytes = [], [], 0, 0
    for text in docs:
        full = [lm.prefix_token_id] + lm.tok_encode(text, add_special_tokens=False)
        tokens += len(full) - 1
        nbytes += len(text.encode("utf-8"))
        a = 1  # predicting full[a:b] from full[s:b-1]
        while a < len(full):
            b = min(a + L, len(full))
            s = max(0, b - 1 - L)
            rows.append((full[s : b - 1], full[s + 1 : b]))
            spans.append(b - a)
            a = b
    scored = lm.scorer.score(rows, progress=progress, desc="perplexity")
    total = float(sum(lp[-n:].sum() for (lp, _), n in zip(scored, spans)))
    return _ppl_row(total, tokens, nbytes)


def heldout_perplexity(
    lm, data_artifact: Path, batch_size: int, progress: bool = False, max_blocks: int | None = None
) -> dict[str, Any]:
    """Perplexity and bits per byte on a data artifact's `valid` blocks (masked targets skipped); the first
    `max_blocks` of them (in shard order) when set."""
    from tasks.stages.evaluate.lm_adapter import token_byte_lengths  # lazy: MindSpore; the eval stage imports this

    token_bytes = token_byte_lengths(lm.sp)
    rows, masks = [], []
    for ids, labels in block_batches(data_artifact, "valid", batch_size, 10**9, seed=0, repeat=False):
        for r in range(len(ids)):
            keep = labels[r] != -100
            rows.append((ids[r], np.where(keep, labels[r], 0)))
            masks.append(keep)
        if max_blocks is not None and len(rows) >= max_blocks:
            rows, masks = rows[:max_blocks], masks[:max_blocks]
            break
    if not rows:
        raise ValueError(f"{data_artifact}: the valid split has no blocks; raise data.validation_fraction")
    scored = lm.scorer.score(rows, progress=progress, desc="held-out perplexity")
    total = float(sum(lp[k].sum() for (lp, _), k in zip(scored, masks)))
    tokens = int(sum(k.sum() for k in masks))
    nbytes = int(sum(token_bytes[t[k]].sum() for (_, t), k in zip(rows, masks)))
    return _ppl_row(total, tokens, nbytes)


def base_chain(store: ArtifactStore, model_artifact: Path) -> list[tuple[Path, str]]:
    """The models `model_artifact` descends from, nearest first, each with how its child came from it ("finetuned
    from", "continued from"): a merged finetune's base (its manifest's model input), a continued pretrain's
    init_from, and theirs, up to a model converted or trained from scratch. Stops where an input is no longer in
    the store; [] for a model with no base."""
    chain: list[tuple[Path, str]] = []
    seen, current = {store.inside(model_artifact)}, store.inside(model_artifact)
    while len(chain) < 64:
        m = store.read_manifest(current)
        ref = next(
            (
                i
                for i in m.get("inputs", [])
                if isinstance(i, dict) and i.get("kind") == "artifact" and i.get("stage") in MODEL_KINDS
            ),
            None,
        )
        if ref is None:
            break
        try:
            parent = store.lookup(ref["stage"], ref["key"])
        except ArtifactError:
            parent = None
        if parent is None or parent in seen:
            break
        chain.append((parent, "finetuned from" if m.get("stage") == "merged" else "continued from"))
        seen.add(parent)
        current = parent
    return chain


def base_perplexity(
    store: ArtifactStore, model_artifact: Path, data_artifact: Path, ev, progress: bool = False
) -> dict[str, Any] | None:
    """The held-out perplexity of the model `model_artifact`'s chain started from (base_chain's last) on the same
    blocks of `data_artifact`: {"model", "path", "chain", "held-out": row}, or {"model", "path", "chain",
    "skipped": why} when its tokenizer is not the data's; None for a model with no base."""
    from tasks.stages.evaluate.lm_adapter import MindSporeLM  # lazy: MindSpore, as above

    chain = base_chain(store, model_artifact)
    if not chain:
        return None
    base = chain[-1][0]
    names = [f"{model_artifact.parent.name}/{model_artifact.name}"]
    names += [f"{how} {p.parent.name}/{p.name}" for p, how in chain]
    out = {"model": f"{base.parent.name}/{base.name}", "path": str(base), "chain": " ← ".join(names)}
    if files_sha256(tokenizer_files(base)) != files_sha256(tokenizer_files(data_artifact)):
        return {**out, "skipped": f"its tokenizer is not the one {data_artifact.name} was tokenized with"}
    gc.collect()  # the evaluated model's graphs and weights, let go by the caller, before the base's load
    lm = MindSporeLM(
        pretrained=base, batch_size=ev.batch_size, progress=progress, fused_kernels=ev.fused_kernels, weights=ev.weights
    )
    row = heldout_perplexity(lm, data_artifact, ev.batch_size, progress, ev.heldout_blocks)
    return {**out, "held-out": row}
