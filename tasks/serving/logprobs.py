"""Logprobs of a sequence's tokens, as the engine reports them.

Logprobs (`Sampling.logprobs` = how many alternatives per position, 0..20; None: none): the
log-softmax of the backend's fp32 logits, in float64, before temperature, top-k or top-p (as vLLM
reports them by default), as `LogProb(token, logprob, top)` entries: one per generated token, and
with `Sampling.echo_from` set, one per prompt token from that index on (a prompt position needs the
logits of the whole prompt: one extra full forward, `backend.prompt_logits`). The first token of a
sequence has nothing before it: its logprob is None.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np


class LogProb(NamedTuple):
    """One position: the token there, its logprob (None: nothing precedes it) and the `top` most likely
    alternatives [(id, logprob), ...], most likely first."""

    token: int
    logprob: float | None
    top: list[tuple[int, float]]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p over the last axis, in float64, of fp32 logits (no temperature: the model's own distribution)."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def _top(lp: np.ndarray, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    k = min(k, lp.size)
    idx = np.argpartition(-lp, k - 1)[:k]
    idx = idx[np.lexsort((idx, -lp[idx]))]  # most likely first; ties by id
    return [(int(i), float(lp[i])) for i in idx]


def logprob_entry(logits: np.ndarray, token: int, k: int) -> LogProb:
    lp = log_softmax(logits)
    return LogProb(int(token), float(lp[token]), _top(lp, k))


def prompt_logprobs(backend, ids: Sequence[int], start: int, k: int) -> list[LogProb]:
    """Entries for ids[start:], each scored by the logits of the position before it (one full forward)."""
    out = [LogProb(int(ids[0]), None, [])] if start == 0 else []
    if len(ids) > 1 and len(ids) > max(start, 1):
        lp = log_softmax(backend.prompt_logits(list(ids)))  # [T, V]
        for p in range(max(start, 1), len(ids)):
            row = lp[p - 1]
            out.append(LogProb(int(ids[p]), float(row[ids[p]]), _top(row, k)))
    return out
