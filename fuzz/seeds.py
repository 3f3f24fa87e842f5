"""The valid inputs the targets mutate, built from the tests' own inputs (tests/helpers.py, tests/test_gguf_safety.py's
tiny GGUF) into a cache directory once per code version: a tiny llama GGUF with a byte-level BPE tokenizer, that
tokenizer's tokenizer.json / tokenizer_config.json (with the ChatML template), a safetensors file of the tiny model's
weights, and the repository's pipelines.yaml."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MSLLM_FUZZ_CACHE") or Path.home() / ".cache" / "msllm" / "fuzz")


def _version() -> str:
    h = hashlib.sha256()
    for f in (Path(__file__), REPO / "model" / "gguf.py", REPO / "tests" / "helpers.py"):
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def tiny_config(vocab: int):
    from model.config import ModelConfig

    return ModelConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        max_seq_length=32,
        tie_embeddings=False,
    )


def _weights(cfg) -> dict[str, np.ndarray]:
    from model.convert import key_pairs

    rng = np.random.default_rng(0)
    return {ours: (0.1 * rng.standard_normal(shape)).astype(np.float32) for _, ours, shape in key_pairs(cfg)}


def seeds() -> Path:
    """The seed directory (built on first use): tok/ (tokenizer files), model.gguf, model.safetensors."""
    out = CACHE / _version()
    if (out / "done").is_file():
        return out
    from model.gguf import write_gguf
    from tasks.deploy.gguf_export import tokenizer_meta
    from tasks.store.tensors import save_tensors
    from tasks.tokenizer import load_tokenizer
    from tests.helpers import train_tiny_hf_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tok = train_tiny_hf_tokenizer(out / "tok", vocab_size=300)
    meta = tokenizer_meta(load_tokenizer(tok))
    cfg = tiny_config(len(meta["tokenizer.ggml.tokens"]))
    weights = _weights(cfg)
    write_gguf(out / "model.gguf", cfg, weights, meta, qtype="F32")
    save_tensors(out / "model.safetensors", weights)
    _model_artifact(out, cfg, weights, tok)
    (out / "done").write_text("")
    return out


def _model_artifact(out: Path, cfg, weights, tok: Path) -> None:
    """A published model artifact of the tiny model (store/pretrain/KEY/: manifest, model.json, weights, tokenizer)."""
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import tokenizer_info, write_model
    from tasks.tokenizer import load_tokenizer

    store = ArtifactStore(out / "store")
    with store.build("pretrain", "f" * 16, pipeline="fuzz", config={}, inputs=[], code="fuzz") as b:
        write_model(
            b.dir,
            name="llama",
            config=cfg,
            weights=weights,
            tokenizer_model=tok,
            tokenizer_info=tokenizer_info(load_tokenizer(tok)),
            seq_length=cfg.max_seq_length,
        )


def model_artifact() -> Path:
    return seeds() / "store" / "pretrain" / ("f" * 16)
