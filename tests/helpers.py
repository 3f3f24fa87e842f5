"""Shared test helpers: a real (randomly initialised) tiny model artifact, built through the store; the float32
bounds (`fp32_tol`, `decoder_reduction`, `logit_tol`, `loglikelihood_tol`, `train_tol`) that comparisons of two
computations of the same math use: every tolerance in tests/ is one of these or says how it was derived."""

from __future__ import annotations

import ctypes
import io
import math
import os
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

EPS32 = 2.0**-23
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


def logit_tol(cfg, t: int, max_logit: float, extra: int = 0) -> float:
    """How far two fp32 computations of one logit of LlamaForCausalLM(cfg) at t keys may differ (another kernel
    body, batch shape, ISA cap or library): `fp32_tol` of the decoder's reductions (`decoder_reduction`) at the
    logits' magnitude `max_logit` (the largest |logit| of that forward: the partial sums of the head stay below
    it, those of the layers' sums are normalised by the RMSNorms before they reach it). `extra`: reductions one side
    adds on the path (an unmerged LoRA adapter's rank, summed in each adapted projection)."""
    return fp32_tol(max_logit, decoder_reduction(cfg, t) + extra)


def loglikelihood_tol(cfg, t: int, n: int, max_logit: float, ll: float) -> float:
    """How far two fp32 computations of one loglikelihood request may differ: the sum over its n continuation
    tokens of log p(token) = z_token - logsumexp(z), each at up to t keys (the request's whole length).

    One term moves by at most the logit's own error plus the log-sum-exp's, which is at most the largest logit
    error (a softmax-weighted mean of them) plus the rounding of its own sum over the vocabulary V:
    2 * logit_tol + fp32_tol(max_logit, V). The n terms come from n positions whose roundings are independent
    (each has its own inputs, its own partial sums), so their errors add as sqrt(n), as fp32_tol's own n
    roundings do; the float32 sum of the n terms rounds once more per term (fp32_tol(|ll|, n)). The bound grows
    with the continuation's length and the logits' magnitude, never an absolute figure: a 300-token
    continuation summing to -330 (SmolLM2-135M, piqa, logits ~30) gets ~0.26, while the defects it is there to
    catch (a token scored at the wrong position, another token in its place) move a loglikelihood by a nat or
    more per token; the test of the bound itself is tests/test_smollm2.py test_loglikelihood_bound_*."""
    term = 2 * logit_tol(cfg, t, max_logit) + fp32_tol(max_logit, cfg.vocab_size)
    return math.sqrt(n) * term + fp32_tol(abs(ll), n)


def train_tol(cfg, t: int, batch_tokens: int, scale: float) -> float:
    """How far a training run's losses, validation losses, gradients or weights may be from the same run in another
    layout (data or tensor parallel, gradient accumulation, optimizer sharding, stopped and resumed, layer at a
    time): the same math with the batch split elsewhere, so the sums that cross the split (the loss's mean over
    the batch's tokens, each weight gradient's sum over them, the all-reduce, the global norm) add in another
    order and the shapes pick other kernel blockings.

    A loss passes the decoder's reductions at t keys (`decoder_reduction`), the log-softmax over the vocabulary and
    the mean over the batch's tokens; a weight's gradient runs the same chain backwards and sums over the same
    tokens: fp32_tol(scale, decoder_reduction(cfg, t) + V + batch_tokens). `scale` is the magnitude of what is
    compared (|loss|; the largest |weight| plus the distance the updates can move one, steps * lr: AdamW's
    update m / (sqrt(v) + eps) is at most ~lr whatever the gradient's scale, so a gradient computed with a
    relative error moves each step's update by lr times that error, and a weight's rounding is that of a sum of
    its initial value and its updates). For the `tiny` pipeline (t 64, batch 8 x 64) that is ~2.4e-5 * scale."""
    return fp32_tol(scale, decoder_reduction(cfg, t) + cfg.vocab_size + batch_tokens)


def tiny_train_tol(scale: float) -> float:
    """`train_tol` for the `tiny` pipeline's runs (preset tiny, seq_length 64, a global batch of 8 sequences)."""
    from model.config import ModelConfig

    return train_tol(ModelConfig.from_name("tiny"), 64, 8 * 64, scale)


def assert_same_scalars(a, b, tol=tiny_train_tol) -> None:
    """Two runs' losses (dicts step -> loss, or sequences) match within `tol` of their magnitude."""
    pairs = [(a[s], b[s]) for s in a] if isinstance(a, dict) else list(zip(a, b, strict=True))
    scale = max(max(abs(x), abs(y)) for x, y in pairs)
    worst = max(abs(x - y) for x, y in pairs)
    assert worst <= tol(scale), (a, b, worst, tol(scale))


def assert_same_weights(a: dict, b: dict, steps: int, lr: float, tol=tiny_train_tol) -> None:
    """Two runs' weights (name -> array) match: the scale is the largest |weight| plus steps * lr (`train_tol`)."""
    import numpy as np

    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    scale = max(float(np.abs(v).max()) for v in a.values()) + steps * lr
    worst = max(float(np.abs(a[k] - b[k]).max()) for k in a)
    assert worst <= tol(scale), (worst, tol(scale))


def assert_greedy_agrees(got: list[int], want: list[int], ref_logits, tol, eos_id: int | None = None) -> int:
    """Two greedy continuations of one prompt (ours, the reference's) are the same tokens, or they part where the
    reference's logits make the two tokens a near-tie that float32 order decides: there the reference scores its
    token at most 2 * tol above ours (each logit may be off by tol, `logit_tol` at that length); after it
    nothing more is compared (the two now continue different texts). ref_logits(prefix) -> the reference's next
    logits after prompt + prefix; tol(i, z) -> the bound at step i given those logits z (computed once, here). A
    sequence that ended early ended on eos_id. Returns how many tokens agreed."""
    for i in range(max(len(got), len(want))):
        a = got[i] if i < len(got) else eos_id
        b = want[i] if i < len(want) else eos_id
        if a == b:
            continue
        assert a is not None and b is not None, (i, got, want)
        z = ref_logits(want[:i])
        bound = tol(i, z)
        assert float(z[b]) - float(z[a]) <= 2 * bound, (i, a, b, float(z[b]) - float(z[a]), 2 * bound)
        return i
    return len(got)


def assert_choices_agree(task: str, ours: dict, ref: dict, tols: dict) -> int:
    """lm-eval multiple-choice documents scored twice (`samples` by doc_id, each with its `arguments` (context,
    continuation) and `resps` [[(ll, is_greedy)]]): each document's choice (the largest ll, and for acc_norm the
    largest ll per byte of the continuation, as lm-eval's acc_norm) is the same, or the two choices are a near-tie
    that the loglikelihoods' own bound admits: under the reference's values they are within the sum of the two
    requests' bounds (tols[(doc_id, i)]). Returns the number of documents that chose differently, so that a caller
    comparing accuracies allows exactly that many (each moves an accuracy by 1 / the number of documents)."""
    flips = 0
    for d, r in ours.items():
        a = [float(x[0][0]) for x in r["resps"]]
        b = [float(x[0][0]) for x in ref[d]["resps"]]
        if len(a) < 2:
            continue
        nbytes = [max(1, len(cont.encode("utf-8"))) for _, cont in r["arguments"]]
        for norm in ([1] * len(a), nbytes):
            mine = max(range(len(a)), key=lambda i: a[i] / norm[i])
            theirs = max(range(len(b)), key=lambda i: b[i] / norm[i])
            if mine != theirs:
                gap = b[theirs] / norm[theirs] - b[mine] / norm[mine]
                room = tols[(d, mine)] / norm[mine] + tols[(d, theirs)] / norm[theirs]
                assert gap <= room, (task, d, mine, theirs, gap, room)
                flips += 1
                break
    return flips


def train_tiny_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """A SentencePiece BPE model trained on the first ~200 KB of Shakespeare (a few seconds)."""
    import sentencepiece as spm

    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([ln for ln in text.splitlines() if ln.strip()]),
        model_writer=buf,
        vocab_size=vocab_size,
        model_type="bpe",
        byte_fallback=True,
        character_coverage=1.0,
        pad_id=0,
        unk_id=1,
        bos_id=2,
        eos_id=3,
        num_threads=1,
        minloglevel=2,
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
    tok = (
        train_tiny_tokenizer(Path(root) / "tok.model", mc.vocab_size)
        if not (Path(root) / "tok.model").exists()
        else Path(root) / "tok.model"
    )
    sp = SentencePieceTokenizer(tok)
    net = LlamaForCausalLM(mc, seed=seed)
    key = store.key("pretrain", {"preset": preset, "seed": seed, **overrides}, [], "test")
    hit = store.lookup("pretrain", key)
    if hit:
        return hit
    with store.build("pretrain", key, pipeline="test", config={"preset": preset}, inputs=[], code="test") as b:
        write_model(
            b.dir,
            name="llama",
            config=mc,
            weights={p.name: p.asnumpy() for p in net.trainable_params()},
            tokenizer_model=tok,
            tokenizer_info=tokenizer_info(sp),
            seq_length=mc.max_seq_length,
        )
    return b.path


CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def train_tiny_hf_tokenizer(
    out_dir: Path, vocab_size: int = 512, chat_template: str | None = CHATML, digits: bool = True
) -> Path:
    """A byte-level BPE tokenizer.json (SmolLM2's layout: digits split one by one, then GPT-2's byte-level
    regex; <|endoftext|> 0, <|im_start|> 1 (BOS), <|im_end|> 2 (EOS, pad)) trained on ~200 KB of Shakespeare,
    with tokenizer_config.json and, unless None, a ChatML chat template. Returns the directory."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) if digits else byte_level
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = SHAKESPEARE.read_text(encoding="utf-8")[:200_000]
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return out_dir


# The inputs each stage takes, in the order its module's `run` names them (tasks/stages/runner.py `prepare`).
_STAGE_INPUTS = {
    "data": ("tokenizer_model",),
    "pretrain": ("data_artifact", "init_from"),
    "finetune": ("base_artifact",),
    "eval": ("model_artifact", "data_artifact"),
    "export": ("model_artifact", "eval_artifact"),
    "convert": ("source", "pipeline", "kind"),
}


def run_stage(name: str, cfg, store, *inputs, **kw) -> Path:
    """Stage `name` run as the CLI and the flows run it: through the stage runner, which checks the machine and
    computes the key once (`prepare(name, store, cfg, **inputs).run(**options)`). `inputs` are positional in the
    stage's order (or named); every other keyword is a run option (progress, isolate, retries, inject, ...)."""
    from tasks.stages.runner import prepare

    names = _STAGE_INPUTS[name]
    named = dict(zip(names, inputs))
    named.update({k: kw.pop(k) for k in list(kw) if k in names})
    return prepare(name, store, cfg, **named).run(**kw)


def convert_hf(hf_dir, store, pipeline: str | None = None) -> Path:
    """The convert stage on a Hugging Face directory, through the stage runner."""
    return run_stage("convert", None, store, Path(hf_dir), pipeline, "hf", progress=False)


def convert_gguf(gguf_file, store, pipeline: str | None = None) -> Path:
    """The convert stage on a GGUF file, through the stage runner."""
    return run_stage("convert", None, store, Path(gguf_file), pipeline, "gguf", progress=False)


def pretrain_child(cfg, root: Path, data_art: Path, init_from: Path | None = None, **kw):
    """The pretrain child's body (tasks/stages/pretrain.py `_train`), to run in this process, keyed as the stage
    runner keys it (the data may live outside `root`: the child reads it by path). Returns (a thunk that trains and
    returns what the child returns, the run dir)."""
    from tasks.stages import pretrain
    from tasks.store.artifacts import ArtifactStore

    store = ArtifactStore(root)
    keyed = pretrain.stage_key(cfg, store, data_art, init_from)
    run_dir = store.root / "runs" / "pretrain" / keyed[0]

    def train():
        return pretrain._train(cfg, store, data_art, init_from, keyed[0], progress=False, keyed=keyed, **kw)

    return train, run_dir


def q8_0_activations(x):
    """x [..., n] quantized as ggml's quantize_row_q8_0 (its AVX2 body) does, per 32-value block of each row: from x
    in float32, id = 127 / amax, q = x * id rounded to nearest (ties to even), the scale amax / 127 rounded to
    binary16. (q [..., n] int32, d [..., n / 32] float32); q * d is what a Q8_0 GEMV multiplies."""
    import numpy as np

    xb = np.asarray(x, np.float32).reshape(*np.shape(x)[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(xb * inv[..., None]).astype(np.int32)
    d = (amax / np.float32(127)).astype(np.float16).astype(np.float32)
    return q.reshape(np.shape(x)), d


def kernel_threads() -> int:
    """The thread count the train kernels would use now (MsllmKernelThreads: the C environment at this call)."""
    from model.kernel_ops import train_ops

    fn = ctypes.CDLL(train_ops().lib).MsllmKernelThreads
    fn.restype = ctypes.c_int
    return fn()


def use_threads(monkeypatch, n: str) -> int:
    """Run the kernels on `n` threads (at most the CPUs): MSLLM_KERNEL_THREADS, and an OMP_NUM_THREADS that does not
    cap it (MindSpore sets OMP_NUM_THREADS=1 in the C environment of a 2-core process once its graph scheduler
    starts; without this every count here ran one thread). Returns the count the kernels report."""
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    monkeypatch.setenv("MSLLM_KERNEL_THREADS", n)
    got = kernel_threads()
    assert got == min(int(n), len(os.sched_getaffinity(0)))
    return got
