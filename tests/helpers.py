"""Shared test helpers: a real (randomly initialised) tiny model artifact, built through the store."""

from __future__ import annotations

import io
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHAKESPEARE = REPO / "data/corpora/tinyshakespeare.txt"


def train_tiny_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """A SentencePiece BPE model trained on the first ~200 KB of Shakespeare (a few seconds)."""
    import sentencepiece as spm

    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([ln for ln in text.splitlines() if ln.strip()]), model_writer=buf,
        vocab_size=vocab_size, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3, num_threads=1, minloglevel=2,
    )
    out.write_bytes(buf.getvalue())
    return out


def tiny_model_artifact(root: Path, preset: str = "tiny", seed: int = 0, **overrides) -> Path:
    """A pretrain-type model artifact (random weights) under `root`, in the real store format."""
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import tokenizer_info, write_model
    from tasks.tokenizer import SentencePieceTokenizer

    store = ArtifactStore(root)
    mc = ModelConfig.from_name(preset, **overrides)
    tok = train_tiny_tokenizer(Path(root) / "tok.model", mc.vocab_size) if not (Path(root) / "tok.model").exists() else Path(root) / "tok.model"
    sp = SentencePieceTokenizer(tok)
    net = LlamaForCausalLM(mc, seed=seed)
    key = store.key("pretrain", {"preset": preset, "seed": seed, **overrides}, [], "test")
    hit = store.lookup("pretrain", key)
    if hit:
        return hit
    with store.build("pretrain", key, pipeline="test", config={"preset": preset}, inputs=[], code="test") as b:
        write_model(b.dir, name="llama", config=mc, weights={p.name: p.asnumpy() for p in net.trainable_params()},
                    tokenizer_model=tok, tokenizer_info=tokenizer_info(sp), seq_length=mc.max_seq_length)
    return b.path
