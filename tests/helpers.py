"""Shared test helpers: a real (randomly initialised) tiny model artifact, built through the store; the float32
bound (`fp32_tol`, `decoder_reduction`) that comparisons of two computations of the same math use."""

from __future__ import annotations

import io
import math
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def load_bench(name: str):
    """scripts/bench/<name>.py by its path: scripts/bench never goes on sys.path (its distributed.py would shadow
    dask's `distributed` for every later test in the process)."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "scripts" / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
SHAKESPEARE = REPO / "data/corpora/tinyshakespeare.txt"

EPS32 = 2.0 ** -23
"""float32 machine epsilon (np.finfo(np.float32).eps): the spacing of float32 numbers at 1."""


def fp32_tol(scale, n: int = 0, k: float = 4.0):
    """How far apart two float32 results of the same math may be when they were computed another way: another
    kernel body (AVX2 or AVX-512), oneDNN's blocking for another batch shape or ISA cap, another thread split,
    onnxruntime's MLAS instead of MindSpore, or a float64 reference.

    A float32 sum of n terms rounds n - 1 times, each by at most eps32/2 of the running sum (<= the sum of the
    |terms|, `scale`). Another order rounds elsewhere. Roundings to nearest have random sign, so the difference
    grows as sqrt(n): a sum of n independent errors uniform in +-eps32/2 * scale has a standard deviation of
    eps32 * scale * sqrt(n / 12); k = 4 times eps32 * sqrt(n + 1) * scale is ~14 of those, which no CPU's
    order reaches by chance, while the worst case (all n roundings of one sign, n * eps32 * scale) never
    happens. The + 1 and k also cover the elementwise steps around the sums (exp, rsqrt, a division: an ulp
    or two each). Reductions chained along a value's path add their lengths (`n`: a matmul of width h, then
    a log-softmax over V, then a sum over T tokens: h + V + T; `decoder_reduction` for a whole decoder).
    `scale` bounds the |terms|: the largest |value| compared is the usual stand-in (an array: elementwise).
    The bound stays far below what a real defect moves (a token scored at the wrong position changes a
    log-likelihood by O(1))."""
    return k * EPS32 * math.sqrt(n + 1) * scale


def decoder_reduction(cfg, t: int) -> int:
    """The reduction lengths a logit of LlamaForCausalLM(cfg) passes through at t keys, added along its path:
    per layer the RMSNorms (hidden, twice), the q/k/v projections (hidden), the scores (head_dim), the
    softmax and the weighted values (t keys, twice), the output projection (hidden), gate/up (hidden) and
    down (intermediate); then the final norm and the head (hidden). For `fp32_tol`'s n."""
    h = cfg.hidden_size
    per_layer = 2 * h + h + cfg.head_dim + 2 * t + h + h + cfg.intermediate_size
    return cfg.num_layers * per_layer + 2 * h


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
