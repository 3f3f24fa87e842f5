"""The exported files: MindIR, the ONNX KV-cache decoder, its int8 copy, onnxruntime-genai's files.

    export_mindir(net, out / "model.mindir")                       # dynamic [batch, seq], full forward
    export_onnx(info, weights, out / "model.onnx", meta)            # tasks/deploy/onnx_decoder.py, checked
    export_int8(out / "model.onnx", out / "model.int8.onnx")        # onnxruntime dynamic quantization
    write_genai_files(out, info, model_dir)                        # genai_config.json, tokenizer.json
    onnx_io(model_config)                                           # export.json's description of model.onnx

MindSpore, onnx (tasks/deploy/onnx_decoder.py) and onnxruntime load inside the functions that use them (lazy): the
export stage's parent side imports this module.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tasks.deploy.checks import ExportCheckFailed
from tasks.store.disk import atomic_write_json
from tasks.tokenizer import HF_CONFIG, HF_FILE, SP_FILE


def export_mindir(net, path: Path) -> None:
    """MindIR with a dynamic [batch, seq] int32 input; `path` ends in .mindir."""
    import mindspore as ms

    ms.export(
        net, ms.Tensor(shape=[None, None], dtype=ms.int32), file_name=str(path.with_suffix("")), file_format="MINDIR"
    )
    os.chmod(path, 0o644)  # MindSpore writes it owner-read-only


def export_onnx(
    info: dict[str, Any], weights: dict[str, np.ndarray], path: Path, meta: dict[str, str] | None = None
) -> dict[str, Any]:
    """The KV-cache decoder (tasks/deploy/onnx_decoder.py) from `weights`, saved at `path` and checked.

    Returns {"onnx_opset", "onnx_bytes"}; ExportCheckFailed when onnx.checker rejects the file.
    """
    from tasks.deploy.onnx_decoder import OPSET, build_decoder, check_model, save_model

    files = save_model(build_decoder(info["model"], weights, metadata=meta), path)
    try:
        check_model(path)
    except ValueError as exc:
        raise ExportCheckFailed(f"export verification failed: {exc}") from None
    return {"onnx_opset": OPSET, "onnx_bytes": sum(f.stat().st_size for f in files)}


def onnx_io(model_config: dict[str, Any]) -> dict[str, Any]:
    """Names, types and shapes of model.onnx's inputs and outputs (export.json)."""
    L, nkv = model_config["num_layers"], model_config["num_kv_heads"]
    hd = model_config["hidden_size"] // model_config["num_heads"]
    kv = f"float32 [batch, {nkv}, {{}}, {hd}]"
    return {
        "inputs": {
            "input_ids": "int64 [batch, sequence]",
            "attention_mask": "int64 [batch, past + sequence] (1 = token, 0 = padding)",
            "position_ids": "int64 [batch, sequence]",
            **{f"past_key_values.{i}.{n}": kv.format("past") for i in range(L) for n in ("key", "value")},
        },
        "outputs": {
            "logits": f"float32 [batch, sequence, {model_config['vocab_size']}]",
            **{f"present.{i}.{n}": kv.format("past + sequence") for i in range(L) for n in ("key", "value")},
        },
        "cache": "feed present.{i}.key/value back as past_key_values.{i}.key/value; a first call takes past of "
        "length 0; batches are left-padded with position_ids counting real tokens",
    }


# Dynamic int8 quantization, chosen to be accurate on every x86 CPU: activations are u8 and weights s8, and
# without AVX-512 VNNI onnxruntime's u8 x s8 kernel multiplies with vpmaddubsw, whose int16 sum of two
# products saturates (255 * 127 * 2 > 32767): on AVX2-only CPUs the logits moved by 0.08 where VNNI gave
# < 0.05. reduce_range keeps |weights| <= 64 (2 * 255 * 64 < 32767: no saturation on any path), and
# per-channel scales win back the bit (one scale per output column instead of one per matrix).
INT8_OPTIONS = {
    "weight_type": "QInt8",
    "per_channel": True,
    "reduce_range": True,
    "op_types_to_quantize": ["MatMul"],
    "extra_options": {"MatMulConstBOnly": True},
}


def int8_method() -> str:
    """How export_int8 quantizes, for the export manifest."""
    return (
        "onnxruntime.quantization.quantize_dynamic, QInt8 weights per channel with reduce_range (7-bit: no "
        "u8 x s8 saturation without VNNI), MatMul with constant B only"
    )


def export_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantization of every MatMul with a constant (weight) input; attention MatMuls stay fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    opts = dict(INT8_OPTIONS)
    quantize_dynamic(str(src), str(dst), weight_type=getattr(QuantType, opts.pop("weight_type")), **opts)


def write_genai_files(out: Path, info: dict[str, Any], model_dir: Path) -> str | None:
    """genai_config.json, tokenizer.json and tokenizer_config.json next to model.onnx.

    A model with a Hugging Face tokenizer.json gets its own files (copied byte for byte); a SentencePiece BPE
    model gets the equivalent tokenizer.json written from its tokenizer.model. Returns None, or why the tokenizer
    files were not written (a SentencePiece model that is not BPE): genai then still generates from token ids.
    """
    from tasks.deploy.onnx_decoder import genai_config, hf_tokenizer_files

    tok = info.get("tokenizer", {})
    eos = tok.get("eos_id", 2)
    pad = tok.get("pad_id", -1)
    atomic_write_json(
        out / "genai_config.json",
        genai_config(
            info["model"], eos_id=eos, bos_id=tok.get("bos_id", 1), pad_id=pad if pad is not None and pad >= 0 else eos
        ),
    )
    if not (model_dir / SP_FILE).is_file():
        for f in (HF_FILE, HF_CONFIG):
            if (model_dir / f).is_file():
                shutil.copy2(model_dir / f, out / f)
        return None
    try:
        tok_json, tok_cfg = hf_tokenizer_files((model_dir / SP_FILE).read_bytes())
    except ValueError as exc:
        return str(exc)
    atomic_write_json(out / "tokenizer.json", tok_json)
    atomic_write_json(out / "tokenizer_config.json", tok_cfg)
    return None
