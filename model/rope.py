"""Rotary position embedding's tables, in one place and numpy only: the MindSpore model (model/layers.py,
model/llama.py), the cached decoders (model/generate.py) and the ONNX graph writer (tasks/deploy/onnx_decoder.py,
which runs without MindSpore) all take their cos/sin from here, so a RoPE variant is written once.

    cos, sin = rope_tables(head_dim, max_seq_length, theta)   # [S, hd] each, float32, HF's rotate-half layout
"""

from __future__ import annotations

import numpy as np


def rope_tables(head_dim: int, max_seq_length: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [max_seq_length, head_dim] for rotate-half RoPE (HF layout): angles in float64, rounded once."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(max_seq_length, dtype=np.float64), inv_freq)  # [S, hd/2]
    angles = np.concatenate([freqs, freqs], axis=-1)  # [S, hd]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
