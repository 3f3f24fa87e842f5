"""Reading and writing model artifacts (pretrain, converted HF, merged finetune): one format, one place.

A model artifact directory holds:

    model.safetensors   weights by MindSpore parameter name (embed_tokens.weight, layers.0.self_attn.q_proj.weight, …)
    model.json          {"name": registry name, "model": ModelConfig.to_dict(), "tokenizer": {vocab_size, bos_id,
                         eos_id, pad_id, unk_id, ...}, "seq_length": trained sequence length}
    tokenizer.model     the SentencePiece model the weights were trained with

    net, info = load_model(path)          # MindSpore network with the weights loaded (eval mode)
    sp = load_tokenizer(path)             # sentencepiece.SentencePieceProcessor

Every file is checked against the artifact's manifest before use (tasks.store.artifacts.verify_published).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from tasks.store.artifacts import atomic_write_json, verify_published


def read_info(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "model.json"
    if not p.is_file():
        raise FileNotFoundError(f"{path}: no model.json; not a model artifact (pass a pretrain, convert or merged finetune artifact)")
    return json.loads(verify_published(p).read_text())


def model_config(path: str | Path):
    from model.config import ModelConfig

    return ModelConfig.from_dict(read_info(path)["model"])


def load_model(path: str | Path, seed: int = 0, **kwargs):
    """(network with the artifact's weights, model.json contents); kwargs go to the model's constructor
    (e.g. fused_kernels=True for training)."""
    from model.registry import build_model
    from tasks.training.checkpoint import load_weights
    from tasks.training.checkpoint import assign

    info = read_info(path)
    net = build_model(info.get("name", "llama"), model_config(path), seed=seed, **kwargs)
    assign(net.trainable_params(), load_weights(path), str(path))
    net.set_train(False)
    return net, info


def load_tokenizer(path: str | Path):
    import sentencepiece as spm

    f = Path(path) / "tokenizer.model" if Path(path).is_dir() else Path(path)
    if not f.is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.model")
    verify_published(f)
    return spm.SentencePieceProcessor(model_file=str(f))


def write_model(out_dir: Path, *, name: str, config, weights: dict[str, np.ndarray], tokenizer_model: Path,
                tokenizer_info: dict[str, Any], seq_length: int, extra: dict[str, Any] | None = None) -> None:
    """Write the three files of a model artifact into `out_dir` (a store build directory)."""
    from tasks.training.checkpoint import save_tensors

    save_tensors(out_dir / "model.safetensors", weights)
    shutil.copy2(tokenizer_model, out_dir / "tokenizer.model")
    atomic_write_json(out_dir / "model.json", {"name": name, "model": config.to_dict(), "tokenizer": tokenizer_info,
                                               "seq_length": seq_length, **(extra or {})})


def tokenizer_info(sp) -> dict[str, Any]:
    return {"vocab_size": sp.get_piece_size(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id(), "pad_id": sp.pad_id(),
            "unk_id": sp.unk_id()}


def newest_model(store, pipeline: str) -> Path | None:
    """The pipeline's newest model artifact (a merged finetune or a pretrain, whichever was created last)."""
    newest = [items[-1] for stage in ("merged", "pretrain") if (items := store.list(stage, pipeline))]
    return max(newest, key=lambda pm: pm[1].get("created", ""))[0] if newest else None
