"""The LLaMA decoder's math, written once, in numpy float64: the definition every other path is held equal to.

    logits, cache = forward(ids, weights, config)                      # [T, V]; cache: per layer (k, v) [nkv, T, hd]
    logits, cache = forward(more_ids, weights, config, cache=cache)    # the next tokens, attending to the cache
    y, (k, v) = decoder_layer(x, layer_weights(weights, 0), config, positions)   # one layer on [T, H]

`weights` are a LlamaForCausalLM's parameters by name ([out, in] projections, as model artifacts store them).
The paths that compute this math for speed, each with its own kernels and layouts, are held equal to it by
tests/test_decoder_paths.py on the same random layer and inputs, within the float32 bound of their reductions:
the training cells (model/llama.py) and their fused kernels (model/fused_cells.py, model/train_kernels.cc), the
written-out layer forward and backward of the layer-at-a-time step (tasks/training/layer_grad.py; the backward against
this forward's central differences along a random direction), the KV-cache decoders and the
fused decode kernel (model/generate.py, model/decode_kernel.cc), and the ONNX graph writer
(tasks/deploy/onnx_decoder.py). A new attention, norm or position encoding is written here first, then in each of
those, and the test says which path does not follow yet.

Pre-norm blocks: x + attention(RMSNorm(x)), then + SwiGLU MLP(RMSNorm(.)); RMSNorm x / sqrt(mean(x²) + eps) * w;
rotate-half RoPE from model/rope.py's tables on queries and keys, queries scaled by head_dim^-0.5; grouped-query
attention (query head h reads kv head h // (heads / kv heads)) with causal masking over cache + new positions;
the LM head tied to the embedding or not. Batch 1, numpy only (no MindSpore).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from model.rope import rope_tables

LAYER_WEIGHTS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


Act = Callable[[np.ndarray, str], np.ndarray]


def _in(act: Act | None, x: np.ndarray, name: str) -> np.ndarray:
    return x if act is None else act(x, name)


def layer_weights(weights: Mapping[str, np.ndarray], i: int) -> dict[str, np.ndarray]:
    """Layer i's weights by their name inside the layer (LAYER_WEIGHTS), float64."""
    return {n: np.asarray(weights[f"layers.{i}.{n}"], np.float64) for n in LAYER_WEIGHTS}


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def rope(x: np.ndarray, positions: np.ndarray, config: Any) -> np.ndarray:
    """Rotate x [heads, T, hd] by its positions' angles (rotate-half layout)."""
    cos, sin = (
        t.astype(np.float64)[positions]
        for t in rope_tables(config.head_dim, int(positions.max()) + 1, config.rope_theta)
    )
    half = config.head_dim // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def attention(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    config: Any,
    positions: np.ndarray,
    cache: tuple[np.ndarray, np.ndarray] | None = None,
    act: Act | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """Attention of x [T, H] at `positions` over the cache's keys/values [nkv, P, hd] (positions 0..P-1) and its own;
    returns ([T, H], the cache with its keys/values appended)."""
    t, nh, nkv, hd = x.shape[0], config.num_heads, config.num_kv_heads, config.head_dim
    q = (_in(act, x, "self_attn.q_proj.weight") @ w["self_attn.q_proj.weight"].T).reshape(t, nh, hd).transpose(1, 0, 2)
    k = (_in(act, x, "self_attn.k_proj.weight") @ w["self_attn.k_proj.weight"].T).reshape(t, nkv, hd).transpose(1, 0, 2)
    v = (_in(act, x, "self_attn.v_proj.weight") @ w["self_attn.v_proj.weight"].T).reshape(t, nkv, hd).transpose(1, 0, 2)
    q, k = rope(q, positions, config) * hd**-0.5, rope(k, positions, config)
    if cache is not None:
        k, v = np.concatenate([cache[0], k], axis=1), np.concatenate([cache[1], v], axis=1)
    key_pos = np.arange(k.shape[1])
    out = np.empty((nh, t, hd))
    for h in range(nh):
        g = h // (nh // nkv)
        scores = q[h] @ k[g].T  # [T, S]
        scores = np.where(key_pos[None, :] > positions[:, None], -np.inf, scores)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        out[h] = (p / p.sum(-1, keepdims=True)) @ v[g]
    o = "self_attn.o_proj.weight"
    return _in(act, out.transpose(1, 0, 2).reshape(t, nh * hd), o) @ w[o].T, (k, v)


def mlp(x: np.ndarray, w: Mapping[str, np.ndarray], act: Act | None = None) -> np.ndarray:
    gate = _in(act, x, "mlp.gate_proj.weight") @ w["mlp.gate_proj.weight"].T
    up = _in(act, x, "mlp.up_proj.weight") @ w["mlp.up_proj.weight"].T
    return _in(act, gate / (1.0 + np.exp(-gate)) * up, "mlp.down_proj.weight") @ w["mlp.down_proj.weight"].T


def decoder_layer(
    x: np.ndarray,
    w: Mapping[str, np.ndarray],
    config: Any,
    positions: np.ndarray,
    cache: tuple[np.ndarray, np.ndarray] | None = None,
    act: Act | None = None,
) -> tuple[np.ndarray, tuple[np.ndarray, np.ndarray]]:
    """One pre-norm block on x [T, H]: (y [T, H], the layer's cache with these positions' keys/values appended)."""
    a, cache = attention(rms_norm(x, w["input_layernorm.weight"], config.norm_eps), w, config, positions, cache, act)
    x = x + a
    return x + mlp(rms_norm(x, w["post_attention_layernorm.weight"], config.norm_eps), w, act), cache


def forward(
    ids,
    weights: Mapping[str, np.ndarray],
    config: Any,
    cache: list[tuple[np.ndarray, np.ndarray]] | None = None,
    act: Act | None = None,
) -> tuple[np.ndarray, list]:
    """Logits [T, V] of token ids [T] that follow the cache's positions (none: from position 0), and the cache.
    `act(x, name)`, where given, is what each weight matrix `name` (a LAYER_WEIGHTS name or "lm_head") multiplies
    instead of x [T, in]: a path that rounds its activations (Q8_0's int8 blocks) is defined by it."""
    start = 0 if not cache else cache[0][0].shape[1]
    positions = np.arange(start, start + len(ids))
    embed = np.asarray(weights["embed_tokens.weight"], np.float64)
    x = embed[np.asarray(ids)]
    out = []
    for i in range(config.num_layers):
        x, layer_cache = decoder_layer(
            x, layer_weights(weights, i), config, positions, cache[i] if cache else None, act
        )
        out.append(layer_cache)
    x = rms_norm(x, np.asarray(weights["norm.weight"], np.float64), config.norm_eps)
    head = embed if config.tie_embeddings else np.asarray(weights["lm_head.weight"], np.float64)
    return _in(act, x, "lm_head") @ head.T, out
