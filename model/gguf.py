"""GGUF (llama.cpp's file format) <-> our LLaMA weights: read, dequantize, write, quantize.

    meta, cfg, weights = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # metadata dict, ModelConfig, fp32 arrays
    write_gguf(path, cfg, weights, tokenizer_meta, qtype="Q8_0")        # what llama.cpp-family runtimes load

Tensor names are llama.cpp's (`token_embd`, `blk.{i}.attn_q`, ..., `output_norm`, `output`). llama.cpp's
converter permutes the rows of attn_q / attn_k from the rotate-half RoPE layout (ours and Hugging Face's) into
interleaved pairs; reading undoes it and writing applies it, so the logits are the same as the source model's.
Quantized tensors (Q4_0, Q4_1, Q8_0, ...; whatever `gguf.quants` dequantizes) come back as float32.
Needs numpy and the `gguf` package only (no MindSpore, no tasks/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig

ARCH = "llama"
# Weight types this reads (the dequantizer knows more; these are what llama-architecture files use and are tested).
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
WRITE_TYPES = ("F32", "F16", "Q8_0")

# (GGUF name, our name); {i} is the layer index.
TENSORS = [
    ("token_embd.weight", "embed_tokens.weight"),
    ("blk.{i}.attn_q.weight", "layers.{i}.self_attn.q_proj.weight"),
    ("blk.{i}.attn_k.weight", "layers.{i}.self_attn.k_proj.weight"),
    ("blk.{i}.attn_v.weight", "layers.{i}.self_attn.v_proj.weight"),
    ("blk.{i}.attn_output.weight", "layers.{i}.self_attn.o_proj.weight"),
    ("blk.{i}.ffn_gate.weight", "layers.{i}.mlp.gate_proj.weight"),
    ("blk.{i}.ffn_up.weight", "layers.{i}.mlp.up_proj.weight"),
    ("blk.{i}.ffn_down.weight", "layers.{i}.mlp.down_proj.weight"),
    ("blk.{i}.attn_norm.weight", "layers.{i}.input_layernorm.weight"),
    ("blk.{i}.ffn_norm.weight", "layers.{i}.post_attention_layernorm.weight"),
    ("output_norm.weight", "norm.weight"),
    ("output.weight", "lm_head.weight"),  # absent when the embeddings are tied
]


class GGUFError(ValueError):
    """The file is not a GGUF this reads (architecture, tensor type, truncation); the message names what."""


def _pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    out = []
    for g, ours in TENSORS:
        if g == "output.weight" and cfg.tie_embeddings:
            continue
        for i in (range(cfg.num_layers) if "{i}" in g else [None]):
            out.append((g.format(i=i), ours.format(i=i)))
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half rows -> llama.cpp's interleaved rows (what its converter does to attn_q / attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(path: str | Path):
    """(GGUFReader, {key: value}); GGUFError for a file that is not a complete GGUF."""
    import gguf

    p = Path(path)
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError) as exc:
        raise GGUFError(f"{p}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:160]}); "
                        "the file is truncated or not GGUF: download it again") from None
    meta: dict[str, Any] = {}
    for k, f in reader.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:  # a value type gguf cannot decode: keep going, it is metadata we do not need
            continue
    # a truncated file can still parse its header: every tensor's bytes must lie inside the file
    size = p.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise GGUFError(f"{p}: tensor {t.name} ends at byte {t.data_offset + t.n_bytes} but the file has "
                            f"{size} bytes; the file is truncated: download it again")
    return reader, meta


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(repr(np.float32(v)))


def config_from_meta(meta: dict[str, Any], where: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{where}: general.architecture={arch!r}; only {ARCH!r} (LLaMA-style) models convert")

    def need(key):
        v = meta.get(f"{ARCH}.{key}")
        if v is None:
            raise GGUFError(f"{where}: metadata {ARCH}.{key} is missing")
        return v

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv = meta.get(f"{ARCH}.attention.head_count_kv")
    rot = meta.get(f"{ARCH}.rope.dimension_count")
    if rot is not None and int(rot) != hidden // heads:
        raise GGUFError(f"{where}: {ARCH}.rope.dimension_count={rot} differs from the head size {hidden // heads} "
                        "(partial RoPE is not supported)")
    if meta.get(f"{ARCH}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(f"{where}: {ARCH}.rope.scaling.type={meta[f'{ARCH}.rope.scaling.type']!r} is not supported "
                        "(only plain RoPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = meta.get(f"{ARCH}.vocab_size", len(tokens) if tokens is not None else None)
    if vocab is None:
        raise GGUFError(f"{where}: neither {ARCH}.vocab_size nor tokenizer.ggml.tokens is present")
    return ModelConfig(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")), num_heads=heads, num_kv_heads=int(kv) if kv is not None else heads,
        max_seq_length=int(meta.get(f"{ARCH}.context_length", 2048)),
        rope_theta=_f32(meta.get(f"{ARCH}.rope.freq_base", 10000.0)),
        norm_eps=_f32(meta.get(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings=False,  # decided from the tensors by read_gguf
    )


def read_gguf(path: str | Path, opened: tuple[Any, dict[str, Any]] | None = None
              ) -> tuple[dict[str, Any], ModelConfig, dict[str, np.ndarray], dict[str, str]]:
    """(metadata, config, our float32 weights by parameter name, {tensor: source type}) of a llama GGUF file.

    opened: what `read_metadata(path)` returned, when the caller already read it (the file is parsed once)."""
    from gguf import GGMLQuantizationType as Q, quants

    p = Path(path)
    reader, meta = opened or read_metadata(p)
    cfg = config_from_meta(meta, str(p))
    by_name = {t.name: t for t in reader.tensors}
    cfg.tie_embeddings = "output.weight" not in by_name
    pairs = _pairs(cfg)
    missing = [g for g, _ in pairs if g not in by_name]
    if missing:
        raise GGUFError(f"{p}: missing tensors: {', '.join(missing[:6])}{' …' if len(missing) > 6 else ''}")
    extra = sorted(set(by_name) - {g for g, _ in pairs} - {"rope_freqs.weight"})
    if extra:
        raise GGUFError(f"{p}: tensors this llama reader does not use: {', '.join(extra[:6])}")
    weights: dict[str, np.ndarray] = {}
    types: dict[str, str] = {}
    shapes = {ours: s for _, ours, s in _shape_table(cfg)}
    for g, ours in pairs:
        t = by_name[g]
        kind = Q(t.tensor_type).name
        if kind not in READ_TYPES:
            raise GGUFError(f"{p}: tensor {g} has type {kind}; this reads {', '.join(READ_TYPES)}")
        if kind == "F32":
            arr = np.asarray(t.data, np.float32)
        elif kind == "F16":
            arr = np.asarray(t.data).view(np.float16).astype(np.float32)
        else:
            arr = quants.dequantize(np.asarray(t.data), Q(t.tensor_type)).astype(np.float32)
        want = shapes[ours]
        if arr.size != int(np.prod(want)):
            raise GGUFError(f"{p}: tensor {g}: {arr.size} values, expected shape {want} from the metadata")
        arr = arr.reshape(want)
        if g.endswith("attn_q.weight"):
            arr = _unpermute(arr, cfg.num_heads)
        elif g.endswith("attn_k.weight"):
            arr = _unpermute(arr, cfg.num_kv_heads)
        weights[ours] = np.ascontiguousarray(arr)
        types[g] = kind
    return meta, cfg, weights, types


def _shape_table(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    from model.convert import key_pairs

    return key_pairs(cfg)


def write_gguf(path: str | Path, cfg: ModelConfig, weights: dict[str, np.ndarray], tokenizer_meta: dict[str, Any],
               qtype: str = "F16", name: str = "msllm", extra_meta: dict[str, Any] | None = None) -> dict[str, str]:
    """Write a llama GGUF: 1-D tensors (norms) in F32, matrices in `qtype` (F32, F16 or Q8_0; a matrix whose row
    length is not a multiple of Q8_0's block stays F16). Returns {tensor: written type}.

    tokenizer_meta: the tokenizer.ggml.* (and tokenizer.chat_template) keys, built by the caller.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q, quants

    if qtype not in WRITE_TYPES:
        raise GGUFError(f"GGUF type {qtype!r}: choose one of {', '.join(WRITE_TYPES)}")
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name(name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_seq_length)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(float(cfg.rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.norm_eps))
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for k, v in {**tokenizer_meta, **(extra_meta or {})}.items():
        _add_kv(w, k, v)
    written: dict[str, str] = {}
    for g, ours in _pairs(cfg):
        arr = np.asarray(weights[ours], np.float32)
        if g.endswith("attn_q.weight"):
            arr = _permute(arr, cfg.num_heads)
        elif g.endswith("attn_k.weight"):
            arr = _permute(arr, cfg.num_kv_heads)
        kind = "F32" if arr.ndim == 1 or qtype == "F32" else qtype
        if kind == "Q8_0" and arr.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0]:
            kind = "F16"
        if kind == "F32":
            w.add_tensor(g, np.ascontiguousarray(arr))
        elif kind == "F16":
            w.add_tensor(g, np.ascontiguousarray(arr.astype(np.float16)))
        else:
            w.add_tensor(g, quants.quantize(arr, Q.Q8_0), raw_dtype=Q.Q8_0)
        written[g] = kind
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def _add_kv(w, key: str, value: Any) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if value >= 0 else w.add_int32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        raise GGUFError(f"metadata {key}: cannot write a {type(value).__name__}")
