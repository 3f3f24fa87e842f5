"""Reading and writing model artifacts (pretrain, converted HF, merged finetune): one format, one place.

A model artifact directory holds:

    model.safetensors   weights by MindSpore parameter name (embed_tokens.weight, layers.0.self_attn.q_proj.weight, …)
    model.json          {"name": registry name, "model": ModelConfig.to_dict(), "tokenizer": {vocab_size, bos_id,
                         eos_id, pad_id, unk_id, ...}, "seq_length": trained sequence length}
    tokenizer.model     the SentencePiece model the weights were trained with, or
    tokenizer.json      a Hugging Face tokenizer (+ tokenizer_config.json, chat_template.jinja when the model has them)

    tok = load_tokenizer(path)            # tasks.tokenizer.Tokenizer (either backend)

The network itself is built by tasks/modeling/build.py (`load_network`), the one place networks are built.

Every file is checked against the artifact's manifest before use (tasks.store.published.verify_published).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig
from tasks.prompts import PROMPT_STYLE_FILE, check_prompt_style, prompt_style
from tasks.store.disk import atomic_write_json
from tasks.store.errors import ArtifactError
from tasks.store.published import verify_published
from tasks.store.tensors import save_tensors
from tasks.tokenizer import copy_tokenizer_files, tokenizer_files
from tasks.tokenizer import load_tokenizer as _load
from tasks.tokenizer_error import TokenizerError


def read_info(path: str | Path) -> dict[str, Any]:
    p = Path(path) / "model.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"{path}: no model.json; not a model artifact (pass a pretrain, convert or merged finetune artifact)"
        )
    try:
        info = json.loads(verify_published(p).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{p}: not valid JSON ({exc}); the artifact is corrupt: rebuild it") from None
    if not isinstance(info, dict) or not isinstance(info.get("model"), dict):
        raise ArtifactError(f"{p}: no 'model' object (the model's config); the artifact is corrupt: rebuild it")
    return info


def model_config(path: str | Path):
    """The ModelConfig of model artifact `path`; ArtifactError naming model.json when its config is malformed."""
    try:
        return ModelConfig.from_dict(read_info(path)["model"])
    except (ValueError, TypeError) as exc:
        raise ArtifactError(
            f"{Path(path) / 'model.json'}: its model config does not hold ({exc}); the artifact is corrupt: rebuild it"
        ) from None


def load_tokenizer(path: str | Path):
    """The artifact's tokenizer (tasks.tokenizer.Tokenizer); FileNotFoundError naming the artifact without one."""

    for f in tokenizer_files(path) if Path(path).is_dir() else [Path(path)]:
        verify_published(f)
    try:
        return _load(path)
    except TokenizerError as exc:
        raise FileNotFoundError(str(exc)) from None


def write_model(
    out_dir: Path,
    *,
    name: str,
    config,
    weights: dict[str, np.ndarray],
    tokenizer_model: Path,
    tokenizer_info: dict[str, Any],
    seq_length: int,
    extra: dict[str, Any] | None = None,
) -> None:
    """Write a model artifact into `out_dir` (a store build directory): weights, the tokenizer files (of
    `tokenizer_model`: a tokenizer.model file, or a directory holding the model's tokenizer files), model.json and
    prompt_style.json (how the model is asked: tasks/prompts.py `prompt_style`, read back by `load_prompt_style`)."""

    save_tensors(out_dir / "model.safetensors", weights)
    if Path(tokenizer_model).is_dir():
        copy_tokenizer_files(tokenizer_model, out_dir)
    else:  # a SentencePiece model file, under whatever name it had
        shutil.copy2(tokenizer_model, out_dir / "tokenizer.model")
    atomic_write_json(out_dir / PROMPT_STYLE_FILE, prompt_style(_load(out_dir)))
    atomic_write_json(
        out_dir / "model.json",
        {
            "name": name,
            "model": config.to_dict(),
            "tokenizer": tokenizer_info,
            "seq_length": seq_length,
            **(extra or {}),
        },
    )


def load_prompt_style(path: str | Path, tok) -> str:
    """The prompt style a model (or export) artifact records (`prompt_style.json`, checked against its manifest and
    against `tok`, its tokenizer); an artifact written before the file existed: the style its tokenizer implies."""
    f = Path(path) / PROMPT_STYLE_FILE
    if not f.is_file():
        return prompt_style(tok)["style"]
    try:
        data = json.loads(verify_published(f).read_text())
    except ValueError as exc:
        raise TokenizerError(f"{f}: not JSON ({exc}); rebuild the artifact") from None
    return check_prompt_style(data, tok, str(f))


def tokenizer_info(tok) -> dict[str, Any]:
    """model.json's tokenizer record: ids, size, files and digest (tasks.tokenizer.Tokenizer.info)."""
    return tok.info()


def newest_model(store, pipeline: str) -> Path | None:
    """The pipeline's newest model artifact (a merged finetune or a pretrain, whichever was created last)."""
    newest = [items[-1] for stage in ("merged", "pretrain") if (items := store.list(stage, pipeline))]
    return max(newest, key=lambda pm: pm[1].get("created", ""))[0] if newest else None
