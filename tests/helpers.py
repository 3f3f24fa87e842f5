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


CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tiny_hf_tokenizer(out_dir: Path, vocab_size: int = 512, chat_template: str | None = CHATML,
                            digits: bool = True) -> Path:
    """A byte-level BPE tokenizer.json (SmolLM2's layout: digits split one by one, then GPT-2's byte-level
    regex; <|endoftext|> 0, <|im_start|> 1 (BOS), <|im_end|> 2 (EOS, pad)) trained on ~200 KB of Shakespeare,
    with tokenizer_config.json and, unless None, a ChatML chat template. Returns the directory."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if digits else byte_level)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
           "pad_token": "<|im_end|>", "unk_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out_dir
