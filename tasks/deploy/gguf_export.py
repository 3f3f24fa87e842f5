"""GGUF files for llama.cpp-family runtimes (llama.cpp, Ollama, LM Studio, llama-cpp-python), written and verified.

    report = export_gguf(out_dir, info, weights, tokenizer, types=["F16", "Q8_0"], reference=net, prompts=ids)

Each file (`model.f16.gguf`, `model.q8_0.gguf`) holds the llama.* metadata, the tokenizer (tokenizer.ggml.*:
a SentencePiece model as llama.cpp's `llama` vocabulary with scores and token types; a byte-level BPE
tokenizer.json as its `gpt2` vocabulary with merges and its pre-tokenizer name; the chat template) and the
weights (model/gguf.py). The check reads each file back with the `gguf` package's reader (see `export_gguf`): the
weights must equal the type's rounding done in memory bit for bit, the logits of the read-back weights must stay within
a bound derived from the type's rounding and the logits' scale (the quantization's effect is reported), and the
tokenizer read back must encode the check texts to the same ids.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

from model.config import ModelConfig
from model.gguf import TENSORS, read_gguf, write_gguf
from tasks.deploy.checks import check_finite_logits
from tasks.store.tensors import assign
from tasks.tokenizer import hf_files_from_gguf, load_tokenizer
from tasks.tokenizer_error import TokenizerError

FILES = {"F16": "model.f16.gguf", "Q8_0": "model.q8_0.gguf"}
RUNTIMES = "llama.cpp (llama-cli, llama-server), Ollama, LM Studio, llama-cpp-python and other GGML runtimes"


# ----------------------------------------------------------------------------- tokenizer metadata


def _sp_meta(tok) -> dict[str, Any]:
    """llama.cpp's `llama` (SentencePiece) vocabulary: pieces, scores, token types (1 normal, 2 unknown,
    3 control, 6 byte)."""
    sp = tok.sp
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": bool(tok.model_proto().get("add_dummy_prefix", False)),
    }
    return meta


def _hf_meta(tok) -> dict[str, Any]:
    """llama.cpp's `gpt2` (byte-level BPE) vocabulary from a tokenizer.json."""
    spec = json.loads(tok.tok.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or not tok._byte_level():
        raise TokenizerError(
            f"{tok.path}: a {model.get('type')} tokenizer.json that is not byte-level BPE; GGUF "
            "export writes byte-level BPE (gpt2) and SentencePiece vocabularies only"
        )
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [p.get("type") for p in parts]
    if kinds == ["Digits", "ByteLevel"] and parts[0].get("individual_digits"):
        pre_name = "smollm"  # llama.cpp: digits one by one, then GPT-2's regex
    elif kinds == ["ByteLevel"] and parts[0].get("use_regex", True):
        pre_name = "gpt-2"
    else:
        raise TokenizerError(
            f"{tok.path}: pre-tokenizer {kinds} has no llama.cpp equivalent this exporter knows "
            "(known: ByteLevel, Digits + ByteLevel)"
        )
    n = tok.vocab_size
    tokens = [tok.tok.id_to_token(i) or f"[PAD{i}]" for i in range(n)]
    special = {t.content for t in tok.tok.get_added_tokens_decoder().values() if t.special}
    merges = model.get("merges", [])
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    meta = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre_name,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.add_bos_token": tok.encode_own("a") != tok.encode("a"),
    }
    return meta


def tokenizer_meta(tok) -> dict[str, Any]:
    meta = _sp_meta(tok) if tok.kind == "sentencepiece" else _hf_meta(tok)
    for name, key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        i = getattr(tok, f"{name}_id")()
        if i >= 0:
            meta[f"tokenizer.ggml.{key}_token_id"] = int(i)
    if tok.chat_template:
        meta["tokenizer.chat_template"] = tok.chat_template
    return meta


# ----------------------------------------------------------------------------- write + verify


def _q8_0_round(arr: np.ndarray) -> np.ndarray:
    return quants.dequantize(quants.quantize(arr, Q.Q8_0), Q.Q8_0).reshape(arr.shape)


def rounded_weights(weights: dict[str, np.ndarray], written: dict[str, str]) -> dict[str, np.ndarray]:
    """The weights as the file stores them (F32 as is, F16 cast, Q8_0 quantized and dequantized), in memory."""
    out = {}
    for k, v in weights.items():
        kind = written.get(_gguf_name(k), "F32")
        out[k] = v if kind == "F32" else v.astype(np.float16).astype(np.float32) if kind == "F16" else _q8_0_round(v)
    return out


# Relative rounding of one weight: F16 keeps an 11-bit significand (2^-11); Q8_0 rounds each block of 32 to 1/127 of
# its largest magnitude, at most half a step (2^-8 of the block's scale). The logits may move by a few times that
# through 30 layers of sums; a wrong layout (say, Q/K rows in the wrong order) moves them by the logits' own scale.
WEIGHT_RTOL = {"F16": 2.0**-11, "Q8_0": 2.0**-8}
HEADROOM = 16


def export_gguf(
    out: Path,
    info: dict[str, Any],
    weights: dict[str, np.ndarray],
    tok,
    types: list[str],
    forward: Callable[[dict[str, np.ndarray], list[int]], np.ndarray],
    prompts: list[list[int]],
    texts: list[str],
) -> dict[str, Any]:
    """Write and verify one GGUF file per type; returns the report (files, diffs, tokenizer check, failures).

    Checks: (1) every tensor read back from the file (gguf's reader, dequantized) equals, bit for bit, the same
    rounding done in memory, so the file adds nothing to the type's own error; (2) the logits of the read-back
    weights stay within HEADROOM × the type's relative weight rounding × the logits' scale of MindSpore's fp32
    logits (the quantization's effect, reported); (3) the tokenizer rebuilt from the file's metadata encodes the
    check texts to the same ids. forward(weights, ids) -> logits [T, V] runs MindSpore's model on given weights.
    """
    cfg = ModelConfig.from_dict(info["model"])
    tmeta = tokenizer_meta(tok)
    ref = [forward(weights, p) for p in prompts]
    for r in ref:
        check_finite_logits(r, weights.items(), "MindSpore")  # names the tensor, not "max |Δlogit| nan > nan"
    scale = max(float(np.abs(r).max()) for r in ref)
    report: dict[str, Any] = {"runtimes": RUNTIMES, "files": {}, "failures": []}
    for t in types:
        path = out / FILES[t]
        written = write_gguf(path, cfg, weights, tmeta, qtype=t, name=info.get("name", "llama"))
        meta, _, back, _ = read_gguf(path)
        expect = rounded_weights(weights, written)
        differ = sorted(k for k in weights if not np.array_equal(back[k], expect[k]))
        diff = max(float(np.abs(forward(back, p) - r).max()) for p, r in zip(prompts, ref))
        entry = {
            "file": path.name,
            "bytes": path.stat().st_size,
            "tensor_types": sorted(set(written.values())),
            "weights_equal_rounding": not differ,
            "max_abs_diff": diff,
            "logit_scale": scale,
            "relative_diff": diff / scale if scale else None,
            "bound": HEADROOM * WEIGHT_RTOL[t] * scale,
        }
        if differ:
            report["failures"].append(
                f"GGUF {t}: {len(differ)} tensors read back differ from their {t} rounding (first: {differ[0]})"
            )
        if not diff <= entry["bound"]:
            report["failures"].append(f"GGUF {t}: max |Δlogit| {diff:.3g} > {entry['bound']:.3g}")
        entry["tokenizer_ids_match"] = _tokenizer_roundtrip(meta, tok, texts, out, t)
        if entry["tokenizer_ids_match"] is False:
            report["failures"].append(f"GGUF {t}: the tokenizer read back from the file encodes differently")
        report["files"][t] = entry
    return report


def network_forward(net) -> Callable[[dict[str, np.ndarray], list[int]], np.ndarray]:
    """forward(weights, ids) -> float32 logits [T, V] of `net` (a MindSpore LLaMA) with `weights` assigned."""
    params = net.trainable_params()

    def forward(weights: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
        assign(params, weights, "gguf check")
        return net(ms.Tensor(np.asarray([ids], np.int32))).asnumpy()[0]

    return forward


def _gguf_name(ours: str) -> str:
    for g, o in TENSORS:
        if "{i}" not in o and o == ours:
            return g
        if "{i}" in o:
            head, tail = o.split("{i}")
            if ours.startswith(head) and ours.endswith(tail):
                return g.replace("{i}", ours[len(head) : len(ours) - len(tail)])
    return ours


def _tokenizer_roundtrip(meta: dict[str, Any], tok, texts: list[str], out: Path, t: str) -> bool | None:
    """Byte-level BPE: the tokenizer.json rebuilt from the file's metadata encodes `texts` as the model's own does.
    SentencePiece vocabularies are checked by piece list (llama.cpp runs its own SentencePiece-style BPE)."""
    if meta.get("tokenizer.ggml.model") == "llama":
        return list(meta["tokenizer.ggml.tokens"]) == [tok.id_to_piece(i) for i in range(tok.vocab_size)]
    try:
        files = hf_files_from_gguf(meta, f"{out.name}/{FILES[t]}")
    except TokenizerError:
        return False
    with tempfile.TemporaryDirectory(dir=out) as d:
        for name, content in files.items():
            (Path(d) / name).write_text(json.dumps(content, ensure_ascii=False), encoding="utf-8")
        back = load_tokenizer(d)
        return all(back.encode(x) == tok.encode(x) for x in texts) and back.eos_id() == tok.eos_id()
