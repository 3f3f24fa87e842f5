"""Autoregressive generation on token ids: greedy or sampled, with or without a KV cache.

    gen = Generator(net)                                    # net: LlamaForCausalLM (eval mode)
    ids = gen.generate(prompt_ids, max_new_tokens=48)       # greedy, KV cache
    ids = gen.generate(prompt_ids, max_new_tokens=48, temperature=0.8, top_k=50, top_p=0.95, seed=1)
    ids = gen.generate(prompt_ids, stop=lambda new_ids: ...)  # e.g. decode and look for a stop string

The cached path preallocates one K and one V buffer of [1, n_kv, S, head_dim] per
layer (S = max_seq_length) and runs `LlamaForCausalLM.forward_cached` under
`mindspore.jit`: the prompt is right-padded to a multiple of `bucket` and written in
one prefill call, then each decode step feeds one token at a Tensor position, so the
step compiles once and never again (the caches go in through `mindspore.mutable`;
a plain tuple of Tensors is a jit constant and recompiles on every new value). The
uncached path recomputes the full forward over the whole sequence each step (also
jit-compiled, right-padded to a multiple of `bucket`, one compilation per bucket): the
reference for tests and the baseline of `scripts/bench/generate.py`.

Token ids in, token ids out: no tokenizer here (stop strings are the caller's
`stop` callback). A sequence never grows past S tokens: the prompt keeps its last
S - 1 tokens and generation ends when the sequence fills the cache, so both paths
see exactly the same context and produce the same tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import mindspore as ms
from mindspore import Tensor


def sample_next(logits: np.ndarray, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                rng: np.random.Generator | None = None) -> int:
    """The next token id from one row of logits [V].

    temperature 0 (or below) is greedy argmax. Otherwise logits / temperature, keep
    the top_k largest, then the smallest set of most likely tokens whose probability
    reaches top_p (the most likely token is always kept), renormalise and sample.
    """
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    if top_k is not None and top_k < z.size:
        kth = np.partition(z, -top_k)[-top_k]
        z = np.where(z < kth, -np.inf, z)
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        cum = np.cumsum(p[order])
        keep = order[: int(np.searchsorted(cum, top_p)) + 1]  # first index where cum >= top_p, inclusive
        mask = np.zeros_like(p, dtype=bool)
        mask[keep] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    rng = rng if rng is not None else np.random.default_rng()
    return int(rng.choice(p.size, p=p))


class Generator:
    """Generation for one network; keeps its compiled prefill/decode steps across calls."""

    def __init__(self, net, bucket: int = 32, max_len: int | None = None):
        self.net = net
        self.bucket = bucket
        self.max_len = max_len or net.config.max_seq_length  # cache slots S
        if self.max_len > net.config.max_seq_length:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_length {net.config.max_seq_length}")
        # Plain closures, not `ms.jit(net.forward_cached)`: jit on a bound method of a Cell binds that
        # method as the Cell's graph, and a later `net(ids)` inside another jit function fails.
        def step(input_ids, start_pos, k_caches, v_caches):
            return net.forward_cached(input_ids, start_pos, k_caches, v_caches)

        def forward(input_ids):
            return net(input_ids)

        self._step = ms.jit(step)
        self._forward = ms.jit(forward)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = 0,
                 eos_id: int | None = None, stop: Callable[[list[int]], bool] | None = None,
                 use_cache: bool = True) -> list[int]:
        """New token ids after `prompt_ids` (the prompt is not included).

        Stops after max_new_tokens, at eos_id (included in the output), when
        `stop(new_ids)` returns True (the token that triggered it is included), or when
        the sequence fills max_len. Sampling draws from numpy's default_rng(seed), so a
        seed gives the same tokens on every run and with or without the cache.
        """
        if not len(prompt_ids):
            raise ValueError("generate: the prompt is empty; pass at least one token id (e.g. BOS or EOS)")
        ids = [int(t) for t in prompt_ids][-(self.max_len - 1):]
        budget = min(max_new_tokens, self.max_len - len(ids))
        rng = np.random.default_rng(seed)
        next_logits = self._cached_steps(ids) if use_cache else self._uncached_steps(ids)
        new: list[int] = []
        logits = next(next_logits)
        while len(new) < budget:
            tok = sample_next(logits, temperature, top_k, top_p, rng)
            new.append(tok)
            if tok == eos_id or (stop is not None and stop(new)) or len(new) == budget:
                break
            logits = next_logits.send(tok)
        next_logits.close()
        return new

    def compile(self, prompt_len: int, max_new_tokens: int, use_cache: bool = True) -> None:
        """Compile every shape a `generate` of this size uses (benchmarks time decoding, not compilation)."""
        n = min(prompt_len, self.max_len - 1)
        if use_cache:
            self.generate([0] * n, 2)
            return
        fed = range(n, min(n + max_new_tokens, self.max_len))  # sequence lengths the forward sees
        for length in sorted({min(-(-m // self.bucket) * self.bucket, self.max_len) for m in fed}):
            self._forward(Tensor(np.zeros((1, length), np.int32))).asnumpy()

    # Each path is a coroutine: it yields the logits [V] for the next position, and is sent the
    # token chosen there.

    def _cached_steps(self, ids: list[int]):
        n = len(ids)
        padded = min(-(-n // self.bucket) * self.bucket, self.max_len)
        x = np.zeros((1, padded), np.int32)
        x[0, :n] = ids
        k, v = self.net.init_cache(1, self.max_len)
        logits, k, v = self._step(Tensor(x), Tensor(0, ms.int32), ms.mutable(k), ms.mutable(v))
        pos = n
        tok = yield logits.asnumpy()[0, n - 1]
        while True:
            logits, k, v = self._step(Tensor([[tok]], ms.int32), Tensor(pos, ms.int32), ms.mutable(k), ms.mutable(v))
            pos += 1
            tok = yield logits.asnumpy()[0, 0]

    def _uncached_steps(self, ids: list[int]):
        seq = list(ids)
        while True:  # the whole sequence again, right-padded to a bucket (causal: padding never leaks back)
            n = len(seq)
            x = np.zeros((1, min(-(-n // self.bucket) * self.bucket, self.max_len)), np.int32)
            x[0, :n] = seq
            tok = yield self._forward(Tensor(x)).asnumpy()[0, n - 1]
            seq.append(tok)


def generate(net, prompt_ids: Sequence[int], max_new_tokens: int = 64, **kwargs) -> list[int]:
    """One-off `Generator(net).generate(...)`; keep a Generator to reuse its compiled steps."""
    return Generator(net).generate(prompt_ids, max_new_tokens, **kwargs)
