"""GGUF (llama.cpp's file format) <-> our LLaMA weights: read, dequantize, write, quantize.

    meta, cfg, weights = read_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")   # metadata dict, ModelConfig, fp32 arrays
    write_gguf(path, cfg, weights, tokenizer_meta, qtype="Q8_0")        # what llama.cpp-family runtimes load

Tensor names are llama.cpp's (`token_embd`, `blk.{i}.attn_q`, ..., `output_norm`, `output`). llama.cpp's
converter permutes the rows of attn_q / attn_k from the rotate-half RoPE layout (ours and Hugging Face's) into
interleaved pairs; reading undoes it and writing applies it, so the logits are the same as the source model's.
Quantized tensors (Q4_0, Q4_1, Q8_0, ...; whatever `gguf.quants` dequantizes) come back as float32.
A file is read only when its tensors are aligned, inside the data section and apart, its llama.* numbers make
a model and every weight is finite; otherwise GGUFError, one line naming the file and the tensor or key
(`tokenizer_problem` does the same for the tokenizer.ggml.* vocabulary).
Needs numpy and the `gguf` package only (no MindSpore, no tasks/).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType, quants

from model.config import ModelConfig
from model.convert import ConversionError, check_layer_count, key_pairs, nonfinite
from model.gguf_header import header_problem

ARCH = "llama"
# Weight types this reads (the dequantizer knows more; these are what llama-architecture files use and are tested).
READ_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
WRITE_TYPES = ("F32", "F16", "Q8_0")
# Metadata this reads: a value of these that gguf cannot decode (say, a token that is not UTF-8) is an error naming it.
USED_KEYS = ("general.architecture", "general.alignment", "general.name", f"{ARCH}.", "tokenizer.")

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
        for i in range(cfg.num_layers) if "{i}" in g else [None]:
            out.append((g.format(i=i), ours.format(i=i)))
    return out


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half rows -> llama.cpp's interleaved rows (what its converter does to attn_q / attn_k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_metadata(path: str | Path):
    """(GGUFReader, {key: value}); GGUFError for a file that is not a complete GGUF."""
    p = Path(path)
    try:
        why = header_problem(p)  # every claimed count against the bytes left, before gguf-py sizes anything
    except OSError as exc:
        raise GGUFError(f"{p}: cannot be read ({exc})") from None
    if why:
        raise GGUFError(f"{p}: {why}; the file is truncated, corrupt or crafted: download it again")
    try:
        reader = gguf.GGUFReader(str(p), "r")
    except (ValueError, IndexError, KeyError, OSError, EOFError) as exc:
        raise GGUFError(
            f"{p}: not a readable GGUF file ({type(exc).__name__}: {str(exc)[:160]}); "
            "the file is truncated or not GGUF: download it again"
        ) from None
    meta: dict[str, Any] = {}
    for k, f in reader.fields.items():
        try:
            meta[k] = f.contents()
        except Exception:  # a value gguf cannot decode: an error for a key we read, else metadata we do not need
            if k.startswith(USED_KEYS):
                raise GGUFError(_undecodable(p, k, f)) from None
    _check_layout(p, reader)
    return reader, meta


def _undecodable(p: Path, key: str, field) -> str:
    """The message for a metadata value gguf cannot decode: which element is not UTF-8, where it is a string."""
    array = bool(field.types) and field.types[0] == GGUFValueType.ARRAY
    for n, i in enumerate(field.data):
        try:
            str(field.parts[i].tobytes(), encoding="utf-8")
        except UnicodeDecodeError as exc:
            where = f"{key}[{n}]" if array else key
            return (
                f"{p}: metadata {where} is not valid UTF-8 (byte {exc.start}: "
                f"{field.parts[i].tobytes()[:40]!r}); the file is corrupt or was written by a broken "
                "converter: download or convert it again"
            )
        except (AttributeError, TypeError):
            break
    return f"{p}: metadata {key} cannot be decoded; the file is corrupt: download it again"


def _check_layout(p: Path, reader) -> None:
    """Every tensor's bytes lie in the data section, at an offset that is a multiple of general.alignment
    (default 32), and no two tensors share bytes (llama.cpp refuses such files too). A truncated file can
    still parse its header; a crafted one can point a tensor anywhere (an unaligned F32 tensor reads values
    across element boundaries: NaN, Inf, 3.4e38)."""
    size = p.stat().st_size
    start, align = int(reader.data_offset), int(reader.alignment)
    spans = []
    for t in reader.tensors:
        rel = int(t.data_offset) - start
        if rel < 0 or rel % align:
            raise GGUFError(
                f"{p}: tensor {t.name} has data offset {rel} (relative to the data section), not a "
                f"multiple of the alignment {align} (general.alignment); the file is corrupt or "
                "crafted: download or convert it again"
            )
        end = int(t.data_offset) + int(t.n_bytes)
        if end > size:
            raise GGUFError(
                f"{p}: tensor {t.name} ends at byte {end} but the file has "
                f"{size} bytes; the file is truncated: download it again"
            )
        spans.append((int(t.data_offset), end, len(spans), t.name))
    spans.sort()
    for a, b in zip(spans, spans[1:]):
        if b[0] < a[1]:
            (s1, e1, _, n1), (s0, e0, _, n0) = sorted((a, b), key=lambda x: -x[2])  # the one listed later first
            raise GGUFError(
                f"{p}: tensor {n1} (bytes {s1}-{e1}) overlaps tensor {n0} (bytes {s0}-{e0}); the file "
                "is corrupt or crafted: download or convert it again"
            )


def _f32(v) -> float:
    """A float32 metadata value as the decimal it was written from (1e-05, not 9.999999747378752e-06)."""
    return float(repr(np.float32(v)))


def config_from_meta(meta: dict[str, Any], where: str) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"{where}: general.architecture={arch!r}; only {ARCH!r} (LLaMA-style) models convert")
    fix = "the file's metadata is corrupt: download or convert it again"

    def value(key, default=None):
        v = meta.get(f"{ARCH}.{key}", default)
        if v is None:
            raise GGUFError(f"{where}: metadata {ARCH}.{key} is missing")
        return v

    def whole(key, default=None) -> int:
        v = value(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v <= 0:
            raise GGUFError(f"{where}: {ARCH}.{key}={_short(v)} must be a positive whole number; {fix}")
        return int(v)

    def positive(key, default) -> float:
        v = value(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float, np.number)) or not np.isfinite(v) or v <= 0:
            raise GGUFError(f"{where}: {ARCH}.{key}={_short(v)} must be a positive finite number; {fix}")
        return _f32(v)

    heads = whole("attention.head_count")
    hidden = whole("embedding_length")
    kv = whole("attention.head_count_kv", heads)
    if hidden % heads or (hidden // heads) % 2:
        raise GGUFError(
            f"{where}: {ARCH}.embedding_length={hidden} is not an even multiple of "
            f"{ARCH}.attention.head_count={heads} (the head size must be a whole, even number); {fix}"
        )
    if heads % kv:
        raise GGUFError(
            f"{where}: {ARCH}.attention.head_count={heads} is not a multiple of "
            f"{ARCH}.attention.head_count_kv={kv}; {fix}"
        )
    rot = meta.get(f"{ARCH}.rope.dimension_count")
    if rot is not None and rot != hidden // heads:
        raise GGUFError(
            f"{where}: {ARCH}.rope.dimension_count={_short(rot)} differs from the head size "
            f"{hidden // heads} (partial RoPE is not supported)"
        )
    if meta.get(f"{ARCH}.rope.scaling.type") not in (None, "none"):
        raise GGUFError(
            f"{where}: {ARCH}.rope.scaling.type={meta[f'{ARCH}.rope.scaling.type']!r} is not supported "
            "(only plain RoPE)"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if f"{ARCH}.vocab_size" not in meta and not isinstance(tokens, list):
        raise GGUFError(f"{where}: neither {ARCH}.vocab_size nor tokenizer.ggml.tokens is present")
    fields = dict(
        vocab_size=whole("vocab_size", len(tokens) if isinstance(tokens, list) else None),
        hidden_size=hidden,
        intermediate_size=whole("feed_forward_length"),
        num_layers=whole("block_count"),
        num_heads=heads,
        num_kv_heads=kv,
        max_seq_length=whole("context_length", 2048),
        rope_theta=positive("rope.freq_base", 10000.0),
        norm_eps=positive("attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings=False,
    )  # decided from the tensors by read_gguf
    try:
        return ModelConfig(**fields)
    except ValueError as exc:  # what the checks above missed, still one line naming the file
        raise GGUFError(f"{where}: the llama.* metadata makes no valid model ({exc}); {fix}") from None


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


SPECIAL_ID_KEYS = ("bos", "eos", "unknown", "padding")


def tokenizer_problem(meta: dict[str, Any], where: str) -> str | None:
    """What is wrong with a file's tokenizer.ggml.* vocabulary (one line naming the key and element), or None.

    The tokens must be distinct strings, token_type one entry per token, each merge "a b" with a, b and ab
    among the tokens (what a BPE tokenizer.json needs to load), and every special token id inside the vocabulary."""
    fix = (
        "the file's vocabulary is corrupt: download it again, or convert the model's Hugging Face directory "
        "with --from-hf"
    )
    key = "tokenizer.ggml.tokens"
    tokens = meta.get(key)
    if tokens is None:
        return f"{where}: metadata {key} is missing (the file carries no vocabulary); {fix}"
    if not isinstance(tokens, list):
        return f"{where}: metadata {key} is {_short(tokens)}, not an array of strings; {fix}"
    seen: dict[str, int] = {}
    for i, t in enumerate(tokens):
        if not isinstance(t, str):
            return f"{where}: {key}[{i}] is {_short(t)}, not a string; {fix}"
        if t in seen:
            return f"{where}: {key}[{i}] {_short(t)} repeats {key}[{seen[t]}]; {fix}"
        seen[t] = i
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None:
        if not isinstance(types, list) or len(types) != len(tokens):
            n = f"{len(types)} entries" if isinstance(types, list) else f"the value {_short(types)}"
            return f"{where}: tokenizer.ggml.token_type has {n}, {key} {len(tokens)}; {fix}"
        bad = next((i for i, k in enumerate(types) if isinstance(k, bool) or not isinstance(k, int)), None)
        if bad is not None:
            return f"{where}: tokenizer.ggml.token_type[{bad}] is {_short(types[bad])}, not a whole number; {fix}"
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        if not isinstance(merges, list):
            return f"{where}: metadata tokenizer.ggml.merges is {_short(merges)}, not an array of strings; {fix}"
        for i, m in enumerate(merges):
            if not isinstance(m, str):
                return f"{where}: tokenizer.ggml.merges[{i}] is {_short(m)}, not a string; {fix}"
            parts = m.split(" ", 1)  # as llama.cpp and hf_files_from_gguf split it
            if len(parts) != 2 or not all(parts):
                return f"{where}: tokenizer.ggml.merges[{i}] {_short(m)} is not two tokens joined by one space; {fix}"
            for t in (*parts, parts[0] + parts[1]):
                if t not in seen:
                    what = f"{_short(t)}" if t in parts else f"its result {_short(t)}"
                    return f"{where}: tokenizer.ggml.merges[{i}] {_short(m)}: {what} is not in {key}; {fix}"
    for name in SPECIAL_ID_KEYS:
        k = f"tokenizer.ggml.{name}_token_id"
        i = meta.get(k)
        if i is not None and (isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens)):
            return f"{where}: {k}={_short(i)} is outside the vocabulary ({len(tokens)} tokens); {fix}"
    tmpl = meta.get("tokenizer.chat_template")
    if tmpl is not None and not isinstance(tmpl, str):
        return f"{where}: metadata tokenizer.chat_template is {_short(tmpl)}, not a string; {fix}"
    return None


def read_gguf(
    path: str | Path, opened: tuple[Any, dict[str, Any]] | None = None
) -> tuple[dict[str, Any], ModelConfig, dict[str, np.ndarray], dict[str, str]]:
    """(metadata, config, our float32 weights by parameter name, {tensor: source type}) of a llama GGUF file.

    opened: what `read_metadata(path)` returned, when the caller already read it (the file is parsed once)."""
    p = Path(path)
    reader, meta = opened or read_metadata(p)
    cfg = config_from_meta(meta, str(p))
    by_name = {t.name: t for t in reader.tensors}
    cfg.tie_embeddings = "output.weight" not in by_name
    try:
        check_layer_count(cfg.num_layers, by_name, "blk.", f"{p}: llama.block_count", "download or convert it again")
    except ConversionError as exc:
        raise GGUFError(str(exc)) from None
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
        if bad := nonfinite(g, arr):
            raise GGUFError(f"{p}: {bad}; the file is corrupt or crafted: download or convert it again")
        if g.endswith("attn_q.weight"):
            arr = _unpermute(arr, cfg.num_heads)
        elif g.endswith("attn_k.weight"):
            arr = _unpermute(arr, cfg.num_kv_heads)
        weights[ours] = np.ascontiguousarray(arr)
        types[g] = kind
    return meta, cfg, weights, types


def _shape_table(cfg: ModelConfig) -> list[tuple[str, str, tuple[int, ...]]]:
    return key_pairs(cfg)


def write_gguf(
    path: str | Path,
    cfg: ModelConfig,
    weights: dict[str, np.ndarray],
    tokenizer_meta: dict[str, Any],
    qtype: str = "F16",
    name: str = "msllm",
    extra_meta: dict[str, Any] | None = None,
) -> dict[str, str]:
    """Write a llama GGUF: 1-D tensors (norms) in F32, matrices in `qtype` (F32, F16 or Q8_0; a matrix whose row
    length is not a multiple of Q8_0's block stays F16). Returns {tensor: written type}.

    tokenizer_meta: the tokenizer.ggml.* (and tokenizer.chat_template) keys, built by the caller.
    """
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
    w.add_file_type(
        {
            "F32": gguf.LlamaFileType.ALL_F32,
            "F16": gguf.LlamaFileType.MOSTLY_F16,
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
        }[qtype]
    )
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
