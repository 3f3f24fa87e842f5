"""Choosing the next token from logits: greedy, or temperature + top-k + top-p sampling. numpy only.

    tok = sample_next(logits_row, temperature=0.8, top_k=40, top_p=0.95, rng=np.random.default_rng(1))

The one sampling rule of both generators: `model.generate.Generator` (MindSpore) and
`tasks.deploy.onnx_generate.OnnxGenerator` (onnxruntime), so they draw the same tokens from the same
logits and seed. It imports numpy alone because the export stage copies it, as `sampling.py`, into every
export artifact beside `onnx_generate.py`, which runs where neither MindSpore nor this project is installed.
"""

from __future__ import annotations

import numpy as np


def sample_next(
    logits: np.ndarray,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    rng: np.random.Generator | None = None,
) -> int:
    """The next token id from one row of logits [V].

    temperature 0 (or below) is greedy argmax. Otherwise logits / temperature, keep
    the top_k largest, then the smallest set of most likely tokens whose probability
    reaches top_p (the most likely token is always kept), renormalise and sample.
    """
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # first index where cum >= top_p, inclusive
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))
