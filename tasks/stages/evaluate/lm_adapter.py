"""lm-evaluation-harness on our MindSpore model: a `TemplateLM` subclass and the batched scorer under it.

    from tasks.stages.evaluate import lm_adapter
    lm_adapter.register()                               # idempotent; adds the model name "msllm"
    lm_eval.simple_evaluate(model="msllm", model_args="pretrained=artifacts/pretrain/<key>", tasks=[...])
    lm = lm_adapter.MindSporeLM(pretrained=path)        # or an instance, for simple_evaluate(model=lm)

Token boundaries follow the harness (`TemplateLM`): a request (context, continuation)
is encoded as the whole string and as the context alone, and the continuation is the
whole's tokens after the context's (trailing spaces of the context move to the
continuation); an empty context becomes the prefix token. Every encoding starts with
the prefix token, EOS: the data stage writes `tokens(doc) + [eos]` back to back, so
"after EOS" is where the model has seen documents begin. The sequence fed to the model
is `(context + continuation)[-(max_length + 1):][:-1]`, scored on its last
len(continuation) positions, as HF's LM does; `max_length` is the trained sequence
length from model.json.

`TokenScorer` does the arithmetic in two graphs compiled once each with dynamic shapes
(`Cell.set_inputs` with None dimensions): the decoder to its outputs [B, T, H], then the
final norm, LM head and log-softmax only on the positions asked for (no padding; for a
loglikelihood request only its continuation). Rows are sorted by length (longest first),
cut into batches of `batch_size` and right-padded to the batch's longest row, which is
invisible to a causal model. A MindSpore graph on CPU keeps every intermediate of its
largest run alive for the life of the process, so the peak is that of the largest batch:
one static graph per length bucket held them all at once, and a [B, T, V] logit buffer in
each was GBs with a 49k vocabulary (docs/MINDSPORE_CPU.md, "Memory").
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import lm_eval.models  # noqa: F401  (built-ins first: the registry loads them only while it is empty)
import mindspore as ms
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from mindspore import ops

from model.config import SCORING_MAX_BYTES
from model.runtime import dynamic_graph, hidden_states_graph, setup_mindspore
from tasks.modeling.build import generator, load_network
from tasks.runtime.progress import progress_bar
from tasks.store.model_artifact import load_tokenizer

MODEL_NAME = "msllm"
log = logging.getLogger("msllm.eval")


class TokenScorer:
    """Log-probabilities of target tokens under a network, batched, with one dynamic-shape graph per part: the
    decoder one layer at a time (model.runtime.layerwise_hidden_states), then the head on the rows asked for."""

    # The activations one call may hold (model.config.SCORING_MAX_BYTES, which says why); fewer rows per call beyond it.
    MAX_BYTES = SCORING_MAX_BYTES

    def __init__(self, net, batch_size: int = 8, max_bytes: int | None = None):
        self.net, self.batch_size = net, batch_size
        self.max_bytes = int(max_bytes or self.MAX_BYTES)
        self.max_seq_length = net.config.max_seq_length
        self.shapes_run: set[tuple[int, int]] = set()

        def head(net, x, targets):  # [N, H], [N] -> log p(target) [N], target is the argmax [N]
            x = x.astype(net.compute_dtype).expand_dims(0)  # as the decoder left it
            logp = ops.log_softmax(net.head_logits(x).squeeze(0), -1)  # [N, V]
            target_logp = ops.gather_elements(logp, 1, targets.expand_dims(-1)).squeeze(-1)
            return target_logp, ops.argmax(logp, -1) == targets

        # [B, T] ids -> [B, T, H]; layers_held: the decoder layers whose activations one call holds (1: a layer at a
        # time)
        self._body, self.layers_held = hidden_states_graph(net)
        self._head = dynamic_graph(
            net,
            head,
            ms.Tensor(shape=[None, net.config.hidden_size], dtype=ms.float32),
            ms.Tensor(shape=[None], dtype=ms.int32),
        )

    def score(
        self,
        rows: Sequence[tuple[Sequence[int], Sequence[int]]],
        progress: bool = False,
        desc: str = "scoring",
        tails: Sequence[int] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """For each (input_ids, target_ids) pair of equal length: (log p(target_t | input_≤t) [T], is_argmax [T]);
        with `tails`, only each row's last tails[i] positions (a loglikelihood request's continuation)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[Any] = [None] * len(rows)
        bar = progress_bar(total=len(rows), desc=desc, enabled=progress)
        start = 0
        while start < len(order):
            t = len(rows[order[start]][0])  # the longest row left
            if t == 0 or t > self.max_seq_length:
                raise ValueError(f"cannot score a sequence of {t} tokens (model max_seq_length {self.max_seq_length})")
            chunk = order[start : start + self.rows_per_call(t)]
            start += len(chunk)
            ids = np.zeros((len(chunk), t), np.int32)
            picks, targets, spans = [], [], []
            for r, i in enumerate(chunk):
                inp, target = rows[i]
                n = len(inp)
                if n != len(target):
                    raise ValueError(f"row {i}: {n} input ids but {len(target)} targets")
                first = n - min(n, int(tails[i])) if tails is not None else 0
                ids[r, :n] = inp
                picks.append(r * t + np.arange(first, n))
                targets.append(np.asarray(target[first:], np.int32))
                spans.append(n - first)
            hidden = self._body(ms.Tensor(ids)).asnumpy().astype(np.float32, copy=False)  # [B, T, H]
            self.shapes_run.add(ids.shape)
            x = hidden.reshape(len(chunk) * t, -1)[np.concatenate(picks)]  # [N, H]: the positions asked for
            logp, greedy = self._run_head(x, np.concatenate(targets))
            at = 0
            for i, n in zip(chunk, spans):
                out[i] = (logp[at : at + n].astype(np.float64), greedy[at : at + n])
                at += n
            bar.update(len(chunk))
        bar.close()
        return out

    def bytes_per_token(self, t: int) -> int:
        """Activation bytes one token of a length-`t` row holds in the decoder graph
        (ModelConfig.scoring_bytes_per_token)."""
        return self.net.config.scoring_bytes_per_token(t, self.layers_held)

    def rows_per_call(self, t: int) -> int:
        """Rows of length `t` one decoder call takes: batch_size, fewer where they would exceed max_bytes."""
        return self.net.config.scoring_rows(t, self.batch_size, self.max_bytes, self.layers_held)

    def _run_head(self, x: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(log p(target) [N], is_argmax [N]) of decoder outputs x [N, H]: the head in chunks whose [rows, V]
        logits and log-softmax stay within max_bytes / 8."""
        if not len(x):
            return np.zeros(0, np.float32), np.zeros(0, bool)
        step = max(1, self.max_bytes // (8 * 2 * 4 * self.net.config.vocab_size))
        parts = [
            self._head(ms.Tensor(x[a : a + step]), ms.Tensor(targets[a : a + step])) for a in range(0, len(x), step)
        ]
        return (np.concatenate([p[0].asnumpy() for p in parts]), np.concatenate([p[1].asnumpy() for p in parts]))


class StepScorer:
    """`TokenScorer.score` through a Generator's fused steps (`Generator.score`: the prefill chunk with every row's
    logits) in its weight format: one sequence at a time, a chunk per step (`Generator._fused_chunk`), never [T, V]
    for more than a chunk. The eval scorer for eval.weights fp16 / q8_0."""

    def __init__(self, gen):
        self.gen = gen
        self.max_seq_length = gen.max_len
        self.shapes_run: set[tuple[int, int]] = set()

    def score(
        self,
        rows: Sequence[tuple[Sequence[int], Sequence[int]]],
        progress: bool = False,
        desc: str = "scoring",
        tails: Sequence[int] | None = None,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """As `TokenScorer.score`: for each (input_ids, target_ids) pair, (log p(target_t | input_<=t), is_argmax)."""
        out: list[Any] = []
        bar = progress_bar(total=len(rows), desc=desc, enabled=progress)
        try:  # the rows back to back, the kernel's threads spinning between them (park=False); asleep after the last
            for i, (inp, target) in enumerate(rows):
                n = len(inp)
                if n != len(target):
                    raise ValueError(f"row {i}: {n} input ids but {len(target)} targets")
                if n == 0 or n > self.max_seq_length:
                    raise ValueError(
                        f"cannot score a sequence of {n} tokens (model max_seq_length {self.max_seq_length})"
                    )
                logp, top = self.gen.score(inp, target, park=False)
                first = n - min(n, int(tails[i])) if tails is not None else 0
                out.append((logp[first:], top[first:]))
                self.shapes_run.add((1, self.gen._fused_chunk(n)))  # the chunk shape its steps ran
                bar.update(1)
        finally:
            self.gen.park()
        bar.close()
        return out


def token_byte_lengths(tok) -> np.ndarray:
    """UTF-8 bytes each token id stands for (special/unknown tokens 0, byte pieces 1): tasks.tokenizer's token_bytes.

    With the data stage's SentencePiece tokenizer (no dummy prefix, identity normalisation) and with byte-level
    BPE the sum over a document's tokens is exactly the document's UTF-8 length.
    """
    return tok.token_bytes()


class MindSporeLM(TemplateLM):
    """lm-eval model backed by a model artifact (MindSpore network + its tokenizer, either backend).

    Tokenization is the harness's `hf` model's for a tokenizer.json model (the tokenizer's own special tokens by
    default, BOS as the prefix of an empty context, EOS otherwise), so loglikelihoods equal lm-eval's `hf` model on
    the same weights; a SentencePiece model trained here is conditioned as in pretraining (EOS first).

    Construct from a model artifact (`pretrained=PATH`, what `model_args` passes), or
    from a loaded network and tokenizer (`net=..., tokenizer=...`; `tokenizer` may be None
    when only the token-level methods are used, e.g. by benchmarks).
    """

    def __init__(
        self,
        pretrained: str | Path | None = None,
        *,
        net=None,
        tokenizer=None,
        batch_size: int | str | None = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        eot_token_id: int | None = None,
        progress: bool = True,
        fused_kernels: bool = True,
        weights: str = "fp32",
        **_harness_kwargs: Any,
    ):
        """`fused_kernels` (eval.fused_kernels): whether generation may decode with the fused decode kernel
        (model.kernels.enabled(..., kind="decode")); the tokens are the same either way. `weights` (eval.weights): the
        weight format that scores and decodes; other than fp32, every score goes through the fused steps on those
        weights (`StepScorer`), as `msllm serve --weights` decodes; `self.weights` is the format that runs (fp32 where
        the fused steps cannot take the model: no compiler, rows not whole Q8_0 blocks, fused_kernels false)."""
        super().__init__()
        self.fused_kernels = fused_kernels
        self._generator = None
        if pretrained is not None:
            setup_mindspore()
            # a stored format that the fused steps will run: only its matrices are loaded (no float32 copy)
            tokenizer = load_tokenizer(pretrained)  # first: its parse's transient peak under the weights' load
            net, info = load_network(pretrained, weights=weights if fused_kernels else "fp32")
            max_length = max_length or info.get("seq_length")
        if net is None:
            raise ValueError("MindSporeLM needs `pretrained` (a model artifact path) or `net`")
        self.net, self.sp = net, tokenizer
        bs = int(batch_size) if str(batch_size or "").isdigit() else 8  # "auto" and None: our default
        self._max_length = min(int(max_length or net.config.max_seq_length), net.config.max_seq_length)
        self.weights, scorer = "fp32", None
        if weights != "fp32":
            gen = generator(net, fused=fused_kernels, max_len=self._max_length, weights=weights)
            if gen.weights == weights and gen.can_score():
                self._generator, self.weights, scorer = gen, weights, StepScorer(gen)
            else:
                log.warning("[eval] weights %s: scoring in fp32 instead (%s)", weights, gen.decode_reason)
        self.scorer: TokenScorer | StepScorer = scorer or TokenScorer(net, batch_size=max(1, bs))
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress
        if eot_token_id is None:
            if tokenizer is None:
                raise ValueError("MindSporeLM without a tokenizer needs eot_token_id")
            eot_token_id = tokenizer.eos_id() if tokenizer.eos_id() >= 0 else tokenizer.bos_id()
        self._eot = int(eot_token_id)

    # ---- what the harness asks about the model

    @property
    def eot_token_id(self) -> int:
        return self._eot

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return self.sp.kind if self.sp is not None else "none"

    @property
    def prefix_token_id(self) -> int:
        """What precedes an empty context: BOS where a tokenizer.json model has one (as lm-eval's `hf`), else EOT."""
        if self.sp is not None and self.sp.kind == "hf" and self.sp.bos_id() >= 0:
            return self.sp.bos_id()
        return self._eot

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """SentencePiece: the ids after the prefix token unless add_special_tokens is False. tokenizer.json: the
        tokenizer's own encoding (its post-processor's special tokens unless add_special_tokens is False)."""
        if self.sp.kind == "hf":
            return self.sp.encode(string) if add_special_tokens is False else self.sp.prompt_ids(string)
        ids = self.sp.encode(string)
        return ids if add_special_tokens is False else [self.prefix_token_id] + ids

    def tok_decode(self, ids: Iterable[int], **kwargs: Any) -> str:
        return self.sp.decode([int(i) for i in ids])

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        ctx, cont = super()._encode_pair(context, continuation)
        if not cont:  # the tokenizer merged the continuation into the context's tokens: score it on its own
            cont = self.tok_encode(continuation, add_special_tokens=False)
        return ctx, cont

    # ---- scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        """requests: ((context, continuation) or None, context_ids, continuation_ids) -> (sum log p, all greedy)."""
        rows, spans = [], []
        for _, ctx, cont in requests:
            cont = list(cont)[-self.max_length :]
            whole = (list(ctx) + cont)[-(self.max_length + 1) :]
            rows.append((whole[:-1], whole[1:]))
            spans.append(len(cont))
        scored = self.scorer.score(rows, progress=self.progress and not disable_tqdm, desc="loglikelihood", tails=spans)
        out = []
        for (key, _, _), (logp, greedy), n in zip(requests, scored, spans):
            answer = (float(logp[-n:].sum()), bool(greedy[-n:].all()))
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
            out.append(answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood, in disjoint windows of max_length tokens (the harness's windows)."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            tokens = self.tok_encode(req.args[0], add_special_tokens=False)
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=tokens, prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (ll, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)):
            totals[i] += ll
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # ---- generation

    @property
    def generator(self):
        if self._generator is None:
            self._generator = generator(
                self.net, fused=self.fused_kernels, max_len=self._max_length, weights=self.weights
            )
        return self._generator

    def generate_text(
        self,
        context: str,
        *,
        until: Sequence[str] = (),
        max_gen_toks: int | None = None,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
    ) -> str:
        """The completion of `context`, cut before the first stop string (EOS always stops)."""
        max_gen = int(max_gen_toks or self.max_gen_toks)
        # Keep room for the new tokens inside the trained length, but never less than half of it as
        # context (the cache holds max_seq_length tokens, so long generations still fit).
        ids = self.tok_encode(context)[-max(self.max_length - max_gen, self.max_length // 2) :]
        until = [u for u in until if u]

        def hit_stop(new_ids: list[int]) -> bool:
            text = self.tok_decode(new_ids)
            return any(u in text for u in until)

        new = self.generator.generate(
            ids,
            max_gen,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            seed=seed,
            eos_id=self.eot_token_id,
            stop=hit_stop if until else None,
        )
        text = self.tok_decode([t for t in new if t != self.eot_token_id])
        for u in until:
            text = text.split(u)[0]
        return text

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in progress_bar(requests, desc="generate_until", enabled=self.progress and not disable_tqdm):
            context, kwargs = req.args
            kwargs = dict(kwargs or {})
            until = kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            temperature = float(kwargs.get("temperature") or 1.0) if kwargs.get("do_sample") else 0.0  # HF's meaning
            text = self.generate_text(
                context,
                until=until,
                max_gen_toks=kwargs.get("max_gen_toks"),
                temperature=temperature,
                top_k=kwargs.get("top_k"),
                top_p=kwargs.get("top_p"),
                seed=kwargs.get("seed", 0),
            )
            self.cache_hook.add_partial("generate_until", (context, req.args[1]), text)
            out.append(text)
        return out


def register() -> None:
    """Make `simple_evaluate(model="msllm", ...)` work. Idempotent; no import-time side effects."""
    if model_registry.get(MODEL_NAME, None) is not MindSporeLM:
        register_model(MODEL_NAME)(MindSporeLM)
