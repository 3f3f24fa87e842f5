"""Hugging Face LlamaForCausalLM <-> our LLaMA: one two-way table of key templates.

    cfg = config_from_hf(json.loads(Path(hf_dir, "config.json").read_text()))
    native = hf_to_native(hf_tensors, cfg)          # {"layers.0.self_attn.q_proj.weight": float32 array, ...}
    hf = native_to_hf(native, cfg, dtype=np.float32) # {"model.layers.0.self_attn.q_proj.weight": ..., ...}
    hf_config = config_to_hf(cfg)                     # a LlamaConfig-style config.json dict

Both models store every projection as [out, in] and apply RoPE in the
rotate-half layout (q/k features split into halves, not interleaved pairs), so
no weight is permuted or transposed: conversion is a rename plus a dtype cast.
The logit-parity tests (tests/test_convert.py) are what proves this.

Every key on either side is used exactly once and every shape is checked;
a mismatch raises ConversionError naming the key. Tied embeddings: our model
has no lm_head.weight; HF files may omit it or carry a copy of the embedding.
Reading and writing files (safetensors, shards, tokenizer) is in tasks/stages/convert.py:
this module needs numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from model.config import ModelConfig

# (HF key, our key, shape as a function of the config). `{i}` is the layer index.
_Shape = Callable[[ModelConfig], tuple[int, ...]]
KEY_TABLE: list[tuple[str, str, _Shape]] = [
    ("model.embed_tokens.weight", "embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size)),
    (
        "model.layers.{i}.self_attn.q_proj.weight",
        "layers.{i}.self_attn.q_proj.weight",
        lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    ),
    (
        "model.layers.{i}.self_attn.k_proj.weight",
        "layers.{i}.self_attn.k_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    ),
    (
        "model.layers.{i}.self_attn.v_proj.weight",
        "layers.{i}.self_attn.v_proj.weight",
        lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    ),
    (
        "model.layers.{i}.self_attn.o_proj.weight",
        "layers.{i}.self_attn.o_proj.weight",
        lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    ),
    (
        "model.layers.{i}.mlp.gate_proj.weight",
        "layers.{i}.mlp.gate_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
    ),
    (
        "model.layers.{i}.mlp.up_proj.weight",
        "layers.{i}.mlp.up_proj.weight",
        lambda c: (c.intermediate_size, c.hidden_size),
    ),
    (
        "model.layers.{i}.mlp.down_proj.weight",
        "layers.{i}.mlp.down_proj.weight",
        lambda c: (c.hidden_size, c.intermediate_size),
    ),
    ("model.layers.{i}.input_layernorm.weight", "layers.{i}.input_layernorm.weight", lambda c: (c.hidden_size,)),
    (
        "model.layers.{i}.post_attention_layernorm.weight",
        "layers.{i}.post_attention_layernorm.weight",
        lambda c: (c.hidden_size,),
    ),
    ("model.norm.weight", "norm.weight", lambda c: (c.hidden_size,)),
    ("lm_head.weight", "lm_head.weight", lambda c: (c.vocab_size, c.hidden_size)),  # absent when tied
]
TIED_HF_KEY, EMBED_HF_KEY = "lm_head.weight", "model.embed_tokens.weight"
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class ConversionError(ValueError):
    """The checkpoint does not match the table or the config; the message names the key."""


def nonfinite(name: str, arr: Any) -> str | None:
    """None when every value of a float array is finite, else "tensor NAME holds N NaN/Inf values (of M)"
    (what convert and every loader refuse: such a model answers garbage, or NaN, to every prompt)."""
    try:
        ok = np.isfinite(arr)
    except TypeError:  # not a float array
        return None
    if ok.all():
        return None
    n = int(ok.size - np.count_nonzero(ok))
    return f"tensor {name} holds {n} NaN/Inf value{'' if n == 1 else 's'} (of {ok.size})"


def held_layers(names: Iterable[str], prefix: str) -> list[int]:
    """The layer indices a file's tensor names hold (`prefix`<i>.…: "model.layers." in HF files, "blk." in GGUF)."""
    held = set()
    for name in names:
        if name.startswith(prefix):
            index = name[len(prefix) :].split(".", 1)[0]
            if index.isdigit():
                held.add(int(index))
    return sorted(held)


def check_layer_count(claimed: int, names: Iterable[str], prefix: str, claim: str, fix: str) -> None:
    """A layer count read from a file (config.json's num_hidden_layers, GGUF's llama.block_count) against the layers
    its tensors hold, before anything is sized by the claim: a crafted count of 10^9 beside one layer's tensors
    must be one error, not 10^9 expected keys built in memory. `claim` names where the count was read."""
    held = held_layers(names, prefix)
    if len(held) != claimed or (held and held[-1] != claimed - 1):
        which = f"{len(held)} ({prefix}{held[0]} … {prefix}{held[-1]})" if held else "none"
        raise ConversionError(f"{claim}={claimed} layers, but the tensors hold {which}; the two disagree: {fix}")


def key_pairs(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    """The table expanded for cfg: (HF key, our key, shape), lm_head left out when embeddings are tied."""
    out = []
    for hf, ours, shape in KEY_TABLE:
        if hf == TIED_HF_KEY and cfg.tie_embeddings:
            continue
        layers = range(cfg.num_layers) if "{i}" in hf else [None]
        for i in layers:
            out.append((hf.format(i=i), ours.format(i=i), tuple(shape(cfg))))
    return out


def _convert(
    src: dict[str, np.ndarray], pairs: list[tuple[str, str, tuple[int, ...]]], dtype: np.dtype, what: str
) -> dict[str, np.ndarray]:
    """Rename src by pairs (src key -> dst key), checking presence, shape and dtype; every key used once."""
    missing = [s for s, _, _ in pairs if s not in src]
    if missing:
        raise ConversionError(f"{what}: missing keys: {', '.join(missing)}")
    unused = sorted(set(src) - {s for s, _, _ in pairs})
    if unused:
        raise ConversionError(f"{what}: unused keys: {', '.join(unused)}")
    out = {}
    for s, d, shape in pairs:
        arr = src[s]
        if tuple(arr.shape) != shape:
            raise ConversionError(f"{what}: {s}: shape {tuple(arr.shape)} expected {shape}")
        if str(arr.dtype) not in FLOAT_DTYPES:
            raise ConversionError(f"{what}: {s}: dtype {arr.dtype} is not one of {', '.join(FLOAT_DTYPES)}")
        out[d] = np.ascontiguousarray(arr.astype(dtype))
    return out


def hf_to_native(hf_tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict[str, np.ndarray]:
    """HF LlamaForCausalLM tensors (fp32/bf16/fp16) -> our parameter names, float32.

    With tied embeddings an lm_head.weight in the file is accepted only as an exact copy
    of model.embed_tokens.weight (some exporters write the shared tensor twice).
    """
    hf = dict(hf_tensors)
    if cfg.tie_embeddings and TIED_HF_KEY in hf:
        head = hf.pop(TIED_HF_KEY)
        embed = hf.get(EMBED_HF_KEY)
        if embed is not None and not (head.shape == embed.shape and np.array_equal(head, embed)):
            raise ConversionError(
                f"HF checkpoint: {TIED_HF_KEY}: differs from {EMBED_HF_KEY} but tie_word_embeddings is true"
            )
    return _convert(hf, key_pairs(cfg), np.dtype(np.float32), "HF checkpoint")


def native_to_hf(tensors: dict[str, np.ndarray], cfg: ModelConfig, dtype: Any = np.float32) -> dict[str, np.ndarray]:
    """Our parameters -> HF LlamaForCausalLM keys, cast to dtype (np.float32, np.float16 or ml_dtypes.bfloat16).

    Tied models get no lm_head.weight, as transformers' save_pretrained writes them.
    """
    pairs = [(n, h, s) for h, n, s in key_pairs(cfg)]
    return _convert(tensors, pairs, np.dtype(dtype), "model weights")


# ----------------------------------------------------------------------------- config.json

_SUPPORTED_ROPE = (None, "default")


def _rope_theta(hf: dict[str, Any]) -> float:
    """rope_theta from config.json, old style (rope_theta + rope_scaling) or new (rope_parameters)."""
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for where, d in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(d, dict):
            raise ConversionError(f"config.json: {where} must be an object (or null), got {_short(d)}")
        kind = d.get("rope_type", d.get("type"))
        if kind not in _SUPPORTED_ROPE:
            raise ConversionError(
                f"config.json: {where}.rope_type={_short(kind)} is not supported (only plain RoPE, "
                f"rope_type 'default'); this checkpoint needs rope scaling we do not implement"
            )
    where = "rope_parameters.rope_theta" if "rope_theta" in params else "rope_theta"
    return _positive_float(params.get("rope_theta", hf.get("rope_theta", 10000.0)), where)


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _positive_int(hf: dict[str, Any], key: str, default: Any = None) -> int:
    v = hf.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConversionError(f"config.json: {key} must be a positive integer, got {_short(v)}")
    return v


def _positive_float(v: Any, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ConversionError(f"config.json: {key} must be a positive number, got {_short(v)}")
    return float(v)


def _flag(hf: dict[str, Any], key: str, default: bool) -> bool:
    v = hf.get(key, default)
    if not isinstance(v, bool):
        raise ConversionError(f"config.json: {key} must be true or false, got {_short(v)}")
    return v


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """A LlamaForCausalLM config.json dict -> ModelConfig; an unsupported or malformed field raises
    ConversionError naming it."""
    if not isinstance(hf, dict):
        raise ConversionError(f"config.json must hold a JSON object, got {_short(hf)}")
    if hf.get("model_type", "llama") != "llama":
        raise ConversionError(f"config.json: model_type={_short(hf.get('model_type'))}; only 'llama' is supported")
    for field, want in (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False)):
        if field in hf and hf[field] != want:
            raise ConversionError(f"config.json: {field}={_short(hf[field])} is not supported (needs {want!r})")
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if field not in hf:
            raise ConversionError(f"config.json: missing {field}")
    heads = _positive_int(hf, "num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    try:
        cfg = ModelConfig(
            vocab_size=_positive_int(hf, "vocab_size"),
            hidden_size=_positive_int(hf, "hidden_size"),
            intermediate_size=_positive_int(hf, "intermediate_size"),
            num_layers=_positive_int(hf, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_positive_int({"num_key_value_heads": kv}, "num_key_value_heads"),
            max_seq_length=_positive_int(hf, "max_position_embeddings", 2048),
            rope_theta=_rope_theta(hf),
            norm_eps=_positive_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps"),
            tie_embeddings=_flag(hf, "tie_word_embeddings", False),
            init_std=_positive_float(hf.get("initializer_range", 0.02), "initializer_range"),
        )
    except ConversionError:
        raise
    except ValueError as exc:  # the sizes do not fit together (heads into hidden_size, kv heads into heads, ...)
        raise ConversionError(f"config.json: {exc}") from None
    if hf.get("head_dim") not in (None, cfg.head_dim):
        raise ConversionError(
            f"config.json: head_dim={_short(hf['head_dim'])} differs from hidden_size / num_attention_heads "
            f"= {cfg.head_dim}; not supported"
        )
    return cfg


def config_to_hf(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """ModelConfig -> a LlamaForCausalLM config.json dict (token ids are added by the caller)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_length,
        "rope_theta": cfg.rope_theta,  # read by transformers < 5
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
        "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "dtype": dtype,
        "use_cache": True,
    }
