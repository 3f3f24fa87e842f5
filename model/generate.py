"""Autoregressive generation on token ids: greedy or sampled, with or without a KV cache.

    gen = Generator(net)                                    # net: LlamaForCausalLM (eval mode)
    ids = gen.generate(prompt_ids, max_new_tokens=48)       # greedy, KV cache
    ids = gen.generate(prompt_ids, max_new_tokens=48, temperature=0.8, top_k=50, top_p=0.95, seed=1)
    ids = gen.generate(prompt_ids, stop=lambda new_ids: ...)  # e.g. decode and look for a stop string

The cached path, for an fp32 single-device net with plain projections (`CachedDecoder.supports`),
writes the prompt into per-layer K/V cache Parameters [n_kv, S, head_dim] (S = max_len) in fixed-size
chunks of `prefill_chunk` (64) tokens through ONE static graph (`CachedDecoder` at T = C; `_chunks`), whose
RoPE, cache write and attention are one custom op per layer over slots 0..position (`ChunkAttention`,
model/decode_kernel.cc) where the kernel builds: neither its buffers nor its work grow with the prompt or with S, and no
prompt length compiles anything new. (A dynamic-length graph held 24 GB at a 2000-token SmolLM2 prompt and a static
graph per 32-token bucket kept every bucket's buffers; see docs/MINDSPORE_CPU.md, "Memory".) Where the fused kernel
builds, the prompt chunks and then each token are ONE call of it instead, `FusedDecodeStep` (model/decode_kernel.cc,
built with g++ on first use: every layer's RMSNorm, projections, RoPE, attention over the cache and SwiGLU MLP, plus
the LM head, with SIMD GEMVs on the kernel's own thread pool, called through ctypes on this thread; it reads the net's
own Parameters, so weights updated in place are seen, and writes the caches in place). Without a compiler (or with
MSLLM_FUSED_DECODE=0) the tokens go through `CachedDecoder` on MindSpore's kernels: same tokens,
slower. A net with unmerged LoRA layers (`model.lora.LoRALinear`, e.g. the server's `LoRASlots`) runs on
`CachedDecoder`, which calls the projection Cells and so adds each B·A; the fused step reads only each
projection's base weight, so it decodes such a net's sequence only when the caller says every LoRA update is
zero throughout (`_cached_steps(ids, base_only=True)`: the server's base requests). fp16, tensor-parallel
nets, and sequences interleaved with one already using the
in-place caches (the server's engine) take the functional `LlamaForCausalLM.forward_cached`, whose
caches go in and out as values (through `mindspore.mutable`; a plain tuple of Tensors is a jit
constant and recompiles on every new value); its prompt pass takes the same fixed-size chunks (one static
graph, the LM head on the last row only). Each
decode step compiles once: the position is a Tensor. The uncached path recomputes the full forward over
the whole sequence each step (also jit-compiled, right-padded to a multiple of `bucket`, one compilation per bucket):
the reference for tests and the `kv_speedup` baseline of `scripts/bench/generate.py`.

Token ids in, token ids out: no tokenizer here (stop strings are the caller's
`stop` callback). A sequence never grows past S tokens: the prompt keeps its last
S - 1 tokens and generation ends when the sequence fills the cache, so both paths
see exactly the same context and produce the same tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import ParameterTuple, Tensor, nn, ops

from model.batch_decode import BatchDecoder
from model.fused_decode import (
    WEIGHT_FORMATS,
    DecodeError,
    FusedDecodeStep,
    build_decode_kernel,
    chunk_attention_op,
    decode_disabled_reason,
    decode_kernel_path,
    decode_threads,
    decode_weights_for,
    zero_cache,
)
from model.hugepages import back_with_huge_pages
from model.layers import Linear
from model.llama import MLP, Attention
from model.lora import LoRALinear, lora_layers
from model.runtime import dynamic_graph, hidden_states_graph, trim_heap
from model.sampling import sample_next

log = logging.getLogger("msllm.generate")


class CachedDecoder(nn.Cell):
    """The KV-cache forward of a LlamaForCausalLM for batch 1, specialised for decoding on CPU.

    Same math as `LlamaForCausalLM.forward_cached` on the net's own Parameters (the norms,
    projections and MLP are the net's Cells), arranged for few, cheap kernels per token:
    activations stay 2-D [T, H]; the caches are Parameters [n_kv, S, head_dim] per layer
    written in place with one ScatterNdUpdate each (the functional cache rewrites every slot
    with a Select each step); RoPE broadcasts cos/sin over heads only; with T = 1 the head
    transposes are reshapes; and only the one row whose logits are needed goes through the
    final norm and the LM head. `construct(input_ids [1, T], start_pos, last)` returns the
    logits [1, V] of position start_pos + last.
    """

    def __init__(self, net, max_len: int, lib: str | None = None, threads: int = 1):
        super().__init__()
        c = net.config
        # not a child Cell: registering it would prefix every one of the net's parameter names with "net."
        object.__setattr__(self, "net", net)
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.n_rep = c.num_heads // c.num_kv_heads
        self.max_len = max_len
        # resident only as positions are written (zero_cache): an 8192-slot cache costs what the prompts reach
        shape = (c.num_kv_heads, max_len, c.head_dim)
        self.k_cache = ParameterTuple([zero_cache(shape, f"decoder_k_cache.{i}") for i in range(c.num_layers)])
        self.v_cache = ParameterTuple([zero_cache(shape, f"decoder_v_cache.{i}") for i in range(c.num_layers)])
        self.scores_matmul = ops.BatchMatMul(transpose_b=True)
        self.values_matmul = ops.BatchMatMul()
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.scatter = ops.ScatterNdUpdate()
        # With the decode kernel's library: a prompt chunk's RoPE, cache write and attention as one op per layer over
        # slots 0..position (ChunkAttention), instead of ~20 kernels with [heads, T, S] scores over every slot
        self.chunk_attention = chunk_attention_op(lib) if lib else None
        self.attention_consts = Tensor(
            np.array([net.layers[0].self_attn.scale if len(net.layers) else 1.0, threads], np.float32)
        )

    @staticmethod
    def supports(net) -> bool:
        """fp32, one device, `Linear` or `LoRALinear` projections (the decoder calls them, so a LoRA update is
        applied; no tensor-parallel slices), a plain LM head."""
        if getattr(net, "half", False):
            return False
        for layer in net.layers:
            a, m = layer.self_attn, layer.mlp
            if type(a) is not Attention or type(m) is not MLP:  # e.g. tensor-parallel blocks
                return False
            projs = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            if any(type(p) not in (Linear, LoRALinear) for p in projs):
                return False
        return net.tie_embeddings or type(net.lm_head) is Linear

    def _heads_first(self, x: Tensor, t: int, heads: int, single: bool) -> Tensor:
        """[T, heads * hd] -> [heads, T, hd]."""
        if single:
            return x.reshape(heads, 1, self.head_dim)
        return ops.transpose(x.reshape(t, heads, self.head_dim), (1, 0, 2))

    def construct(self, input_ids: Tensor, start_pos: Tensor, last: Tensor) -> Tensor:
        return self._run(input_ids, start_pos, last, input_ids.shape[1] == 1)  # static shapes: T is a constant

    def _run(self, input_ids: Tensor, start_pos: Tensor, last: Tensor, single: bool) -> Tensor:
        net = self.net
        x = ops.gather(net.embed_tokens.weight, input_ids.reshape(-1), 0)  # [T, H]
        if self.chunk_attention is not None and not single:  # RoPE, cache write and attention: one op per layer
            for i, layer in enumerate(net.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(x)
                out = self.chunk_attention(
                    attn.q_proj(h),
                    attn.k_proj(h),
                    attn.v_proj(h),
                    start_pos,
                    net.rope_cos,
                    net.rope_sin,
                    self.k_cache[i],
                    self.v_cache[i],
                    self.attention_consts,
                )
                x = x + attn.o_proj(out)
                x = x + layer.mlp(layer.post_attention_layernorm(x))
        else:
            x = self._layers(x, start_pos, single)
        x = net.norm(ops.gather(x, last.reshape(1), 0))  # [1, H]
        if net.tie_embeddings:
            return self.head_matmul(x, net.embed_tokens.weight)  # [1, V]
        return net.lm_head(x)

    def _layers(self, x: Tensor, start_pos: Tensor, single: bool) -> Tensor:
        """The decoder layers on MindSpore's kernels: scores over all S slots under a mask, the cache rows written
        with ScatterNdUpdate (T = 1 decode on the decoder path; prompt chunks where the native op is missing)."""
        net = self.net
        t = x.shape[0]
        nh, nkv, hd, s = self.num_heads, self.num_kv_heads, self.head_dim, self.max_len
        positions = start_pos + ops.arange(t, dtype=ms.int32)  # [T]
        cos = ops.gather(net.rope_cos, positions, 0).reshape(t, 1, hd)  # [T, 1, hd]
        sin = ops.gather(net.rope_sin, positions, 0).reshape(t, 1, hd)
        mask = (ops.arange(s, dtype=ms.int32).reshape(1, -1) > positions.reshape(-1, 1)).astype(ms.float32) * -1e9
        # cache rows written: (kv head h, slot start_pos + i) for h, i -> [nkv * T, 2]
        heads = ops.arange(nkv, dtype=ms.int32).reshape(-1, 1, 1).broadcast_to((nkv, t, 1))
        slots = positions.reshape(1, -1, 1).broadcast_to((nkv, t, 1))
        rows = ops.cat((heads, slots), -1).reshape(nkv * t, 2)
        for i, layer in enumerate(net.layers):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).reshape(t * nh, hd)
            k = attn.k_proj(h).reshape(t * nkv, hd)
            v = attn.v_proj(h)
            q = (q.reshape(t, nh, hd) * cos + attn.rotate_matmul(q, attn.rotate).reshape(t, nh, hd) * sin) * attn.scale
            k = k.reshape(t, nkv, hd) * cos + attn.rotate_matmul(k, attn.rotate).reshape(t, nkv, hd) * sin
            kc = self.scatter(
                self.k_cache[i], rows, self._heads_first(k.reshape(t, nkv * hd), t, nkv, single).reshape(nkv * t, hd)
            )
            vc = self.scatter(self.v_cache[i], rows, self._heads_first(v, t, nkv, single).reshape(nkv * t, hd))
            qh = self._heads_first(q.reshape(t, nh * hd), t, nh, single).reshape(nkv, self.n_rep * t, hd)
            scores = self.scores_matmul(qh, kc).reshape(nh, t, s) + mask  # [nh, T, S]
            probs = ops.softmax(scores.reshape(nh * t, s), -1).reshape(nkv, self.n_rep * t, s)
            out = self.values_matmul(probs, vc).reshape(nh, t, hd)  # [nh, T, hd]
            if single:
                out = out.reshape(1, nh * hd)
            else:
                out = ops.transpose(out, (1, 0, 2)).reshape(t, nh * hd)
            x = x + attn.o_proj(out)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x


PREFILL_CHUNK = 64  # prompt tokens per prefill call: one static graph whose buffers do not grow with the prompt
FUSED_PREFILL_CHUNK = 256
"""Tokens per fused prefill (and score) step for a prompt longer than this: each step packs every weight matrix once
for its chunk's GEMMs (dequantizing fp16 / Q8_0 as it packs), so 2000 tokens in 64-token chunks repacked them 32
times. SmolLM2-135M, 2000 tokens, 2 threads, AMD EPYC (AVX-512): time to first token fp32 4.05 s / q8_0 6.2 s in
64-token chunks, 2.49 / 2.63 in 256 (HF transformers' sdpa forward: 4.8 s). Shorter prompts keep `prefill_chunk`
(a 16-token prompt padded to 256 would compute 16x its tokens). The fused step allocates its buffers per call, so a
longer chunk keeps nothing afterwards."""


class Generator:
    """Generation for one network; keeps its compiled prefill/decode steps across calls.

    `fused=False` keeps decoding on MindSpore's kernels (`CachedDecoder`); `threads` sets the fused
    step's OpenMP threads (default `decode_threads()`: $MSLLM_DECODE_THREADS, else the usable cores, at
    most 8). The path is chosen here, once: `decode_path` says which ("fused", "decoder" or "functional") and
    `decode_reason` why; both are logged (logger "msllm.generate") and reported by the decode benchmarks and the
    server's /health. A path that fails mid-sequence raises `DecodeError`; it is never swapped for another.
    """

    ECHO_HEAD_ROWS = 256
    """Prompt positions per LM-head call of `prompt_logits` (its [rows, V] logits: 50 MB at SmolLM2's vocabulary)."""

    def __init__(
        self,
        net,
        bucket: int = 32,
        max_len: int | None = None,
        fused: bool = True,
        threads: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        weights: str = "fp32",
    ):
        if weights not in WEIGHT_FORMATS:
            formats = ", ".join(WEIGHT_FORMATS)
            raise ValueError(f"weights: {weights!r} is not a decode weight format; use one of {formats}")
        self.net = net
        self.bucket = bucket
        self.max_len = max_len or net.config.max_seq_length  # cache slots S
        self.prefill_chunk = max(1, min(prefill_chunk, self.max_len))  # prompt tokens per prefill call (_chunks)
        if self.max_len > net.config.max_seq_length:
            raise ValueError(f"max_len {self.max_len} exceeds the model's max_seq_length {net.config.max_seq_length}")

        # Plain closures, not `ms.jit(net.forward_cached)`: jit on a bound method of a Cell binds that
        # method as the Cell's graph, and a later `net(ids)` inside another jit function fails.
        def step(input_ids, start_pos, k_caches, v_caches):
            return net.forward_cached(input_ids, start_pos, k_caches, v_caches)

        def chunk_step(input_ids, start_pos, last, k_caches, v_caches):  # a prompt chunk: the head on row `last` only
            return net.forward_cached(input_ids, start_pos, k_caches, v_caches, last)

        def forward(input_ids):
            return net(input_ids)

        self._step = ms.jit(step)
        self._chunk_step = ms.jit(chunk_step)
        self._forward = ms.jit(forward)
        self._graphs: dict[str, object] = {}  # the echo logits' dynamic-shape graphs, built on its first use
        self._trimmed: set[str] = set()  # graphs whose first run has been followed by trim_heap (_compiled)
        supported = CachedDecoder.supports(net)
        lib = build_decode_kernel(fused) if supported else None
        self.huge_page_bytes = 0
        threads = threads or decode_threads()
        if not supported:
            self._path_reason = "this network has no in-place KV-cache decoder (CachedDecoder.supports: false)"
        elif lib is None:
            off = decode_disabled_reason(fused) or "the kernel did not build here (no C++ compiler, or a failed build)"
            self._path_reason = f"the fused decode kernel is off: {off}"
        else:
            self._path_reason = (
                f"the fused decode kernel (model/decode_kernel.cc, {decode_kernel_path(fused)} body, {threads} threads)"
            )
        # the fused steps' matrices (None: the net's); lean: the net holds only them (load_network(..., weights=))
        self._weights, self.lean, why = decode_weights_for(net, weights, lib, self._path_reason)
        self.weights = self._weights.dtype if self._weights is not None else "fp32"
        self._path_reason += why
        if lib is not None:  # the matrices every token streams, on transparent huge pages (model/hugepages.py)
            streamed = net.get_parameters() if self._weights is None else self._weights.get_parameters()
            self.huge_page_bytes = back_with_huge_pages([(p.data_ptr(), p.nbytes) for p in streamed])
            if self.huge_page_bytes:
                self._path_reason += f", {self.huge_page_bytes >> 20} MiB of them on huge pages"
        self._lib, self._threads = lib, threads  # for BatchDecoder
        self._decoder = CachedDecoder(net, self.max_len, lib, threads) if supported else None
        # The decoder's caches are one set of Parameters: one sequence at a time may use them. Sequences
        # interleaved with it (the server's engine runs several coroutines in turn) take the functional path.
        self._decoder_busy = False
        if self._decoder is not None:
            decoder = self._decoder

            def decode(input_ids, start_pos, last):
                return decoder(input_ids, start_pos, last)

            self._decode = ms.jit(decode)  # T = 1 steps: static shapes
        # Decode tokens (T = 1) as one fused kernel call when it builds here (see FusedDecodeStep); else, or
        # with fused=False, on the decoder's MindSpore kernels. Both write the same caches.
        self._fused = None
        self._fused_score = None  # a chunk's every row of logits (ScoreStep), where _fused is
        self._fused_prefill = None  # prompt chunks as one call (FusedDecodeStep with prefill=True), where _fused is
        self._lora = [
            layer for _, layer in lora_layers(net)
        ]  # the fused step ignores their updates (see _cached_steps)
        if lib is not None:  # called on this thread through ctypes (FusedDecodeStep: not as a MindSpore op)
            self._fused = FusedDecodeStep(self._decoder, lib, threads, weights=self._weights)
            self._fused_prefill = FusedDecodeStep(self._decoder, lib, threads, prefill=True, weights=self._weights)
            self._fused_score = FusedDecodeStep(self._decoder, lib, threads, score=True, weights=self._weights)
        log.info("[generate] decode path: %s: %s", self.decode_path, self.decode_reason)

    @property
    def decode_reason(self) -> str:
        """Why `decode_path` is what it is (chosen when the Generator was built; unmerged LoRA layers move a net from
        the fused step to the decoder, which applies them)."""
        if self._decoder is not None and self._fused is not None and self._lora_on():
            return "unmerged LoRA layers: the fused step reads only the base weights, the decoder applies B·A"
        return self._path_reason

    @property
    def decode_path(self) -> str:
        """Which kernels decode a sequence that gets the in-place caches: "fused", "decoder" or "functional"
        (a net with unmerged LoRA layers: "decoder", unless `_cached_steps(..., base_only=True)`)."""
        if self._decoder is None:
            return "functional"
        return "fused" if self._fused is not None and not self._lora_on() else "decoder"

    def _lora_on(self) -> bool:
        return any(not layer.merged for layer in self._lora)

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 64,
        *,
        temperature: float = 0.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = 0,
        eos_id: int | None = None,
        stop: Callable[[list[int]], bool] | None = None,
        use_cache: bool = True,
    ) -> list[int]:
        """New token ids after `prompt_ids` (the prompt is not included).

        Stops after max_new_tokens, at eos_id (included in the output), when
        `stop(new_ids)` returns True (the token that triggered it is included), or when
        the sequence fills max_len. Sampling draws from numpy's default_rng(seed), so a
        seed gives the same tokens on every run and with or without the cache.
        """
        if not len(prompt_ids):
            raise ValueError("generate: the prompt is empty; pass at least one token id (e.g. BOS or EOS)")
        ids = [int(t) for t in prompt_ids][-(self.max_len - 1) :]
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
        if use_cache or self.lean:
            self.generate([0] * n, 2)
            return
        fed = range(n, min(n + max_new_tokens, self.max_len))  # sequence lengths the forward sees
        for length in sorted({min(-(-m // self.bucket) * self.bucket, self.max_len) for m in fed}):
            self._forward(Tensor(np.zeros((1, length), np.int32))).asnumpy()

    def prompt_logits(self, ids: Sequence[int]) -> np.ndarray:
        """The logits [T, V] at every position of `ids` (a server's echo / prompt logprobs), compiled once for every
        prompt length: the decoder one layer at a time through one dynamic-shape layer graph (as the eval scorer:
        model.runtime.layerwise_hidden_states; a graph keeps a buffer per kernel, so a whole-decoder graph would
        hold every layer's [nh, T, T] scores at once), then the head on `ECHO_HEAD_ROWS` positions per call into
        the one [T, V] array returned. A static graph per 32-token bucket compiled again for every new bucket
        (~10 s each on SmolLM2) and kept each one's buffers for the life of the process (docs/MINDSPORE_CPU.md)."""
        if not 0 < len(ids) <= self.max_len:
            raise ValueError(f"prompt of {len(ids)} tokens: 1..{self.max_len} (max_len)")
        if self.lean:  # the same logits through the fused score step, in the stored format
            return self.score(ids)

        def head(net, x):
            return net.head_logits(x).astype(ms.float32)

        if "prompt_hidden" not in self._graphs:
            self._graphs["prompt_hidden"], _ = hidden_states_graph(self.net)
            self._graphs["prompt_head"] = dynamic_graph(
                self.net, head, Tensor(shape=[1, None, self.net.config.hidden_size], dtype=self.net.compute_dtype)
            )
        x = self._graphs["prompt_hidden"](Tensor(np.asarray([ids], np.int32)))  # [1, T, H]
        out = np.empty((len(ids), self.net.config.vocab_size), np.float32)
        for start in range(0, len(ids), self.ECHO_HEAD_ROWS):
            out[start : start + self.ECHO_HEAD_ROWS] = self._graphs["prompt_head"](
                x[:, start : start + self.ECHO_HEAD_ROWS]
            ).asnumpy()[0]
        return out

    def _compiled(self, name: str) -> None:
        """After a graph's first run: hand the heap its compilation freed back to the OS (`trim_heap`), once."""
        if name not in self._trimmed:
            self._trimmed.add(name)
            trim_heap()

    def long_prompt(self) -> int | None:
        """The shortest prompt the fused prefill takes in FUSED_PREFILL_CHUNK-token chunks (a shape of its own to
        compile: a server warms it up), or None where every prompt goes in `prefill_chunk` tokens."""
        n = FUSED_PREFILL_CHUNK + 1
        if self.decode_path != "fused" or n >= self.max_len or self._fused_chunk(n) == self.prefill_chunk:
            return None
        return n

    def _fused_chunk(self, n: int) -> int:
        """Tokens per fused prefill / score step for a sequence of n tokens (FUSED_PREFILL_CHUNK past it)."""
        return min(FUSED_PREFILL_CHUNK, self.max_len) if n > FUSED_PREFILL_CHUNK else self.prefill_chunk

    def _chunks(self, ids: list[int], c: int | None = None, pad_last: bool = False):
        """The prompt as fixed-size chunks [1, C] (C = `c`, default `prefill_chunk`): (ids, start, index of the last
        real token).
        A prompt shorter than C is right-padded (the fused PrefillStep stops at the prompt's last token; on
        MindSpore's ops the padding's K/V land in slots past the prompt: masked, then overwritten by decoding); a
        longer one is cut at multiples of C and its last chunk ends exactly at the prompt's end, overlapping the one
        before (those positions are computed again from the same tokens), so no slot past the prompt is written and
        no position goes past the cache. `pad_last` (the fused PrefillStep, which computes and writes a chunk's rows
        only up to `last`): a longer one in chunks from 0, c, 2c, ..., its last chunk padded, nothing recomputed."""
        n, c = len(ids), c or self.prefill_chunk
        if n <= c or pad_last:  # chunks from 0, c, 2c, ..., the last one right-padded
            out = []
            for s in range(0, n, c):
                x = np.zeros((1, c), np.int32)
                x[0, : min(c, n - s)] = ids[s : s + c]
                out.append((x, s, min(c, n - s) - 1))
            return out
        starts = list(range(0, n - c, c)) + [n - c]
        return [(np.asarray([ids[s : s + c]], np.int32), s, c - 1) for s in starts]

    def can_score(self) -> bool:
        """Whether `score` runs here: the fused steps built, no unmerged LoRA layer, the caches free."""
        return self._fused_score is not None and not self._lora_on() and not self._decoder_busy

    def score(self, ids: Sequence[int], targets: Sequence[int] | None = None, park: bool = True):
        """The logits [n, V] (float32) at every position of `ids` (row i: the distribution of the token after ids[i]),
        through the fused steps in this Generator's weight format (`weights`: what it serves is what it scores); with
        `targets` [n], instead (log p(targets[i]) float64 [n], whether targets[i] is the argmax [n]), a chunk at a
        time, never holding [n, V]. The sequence goes through chunks as a prompt on the fused steps does
        (`_fused_chunk` tokens; `_chunks`: the last one padded, or overlapping the one before), each chunk one
        ScoreStep: the prefill step with every row's logits. The in-place caches hold the sequence meanwhile; at most
        max_len tokens. `park=False` leaves the kernel's threads spinning for a next call that follows at once (a
        loop of scores, which calls `park()` at its end)."""
        if not self.can_score():
            raise RuntimeError(
                f"Generator.score needs the fused steps, no LoRA left unmerged, free caches: {self.decode_reason}"
            )
        n = len(ids)
        if not 0 < n <= self.max_len:
            raise ValueError(f"cannot score a sequence of {n} tokens (max_len {self.max_len})")
        if targets is not None and len(targets) != n:
            raise ValueError(f"{n} ids but {len(targets)} targets")
        if targets is None:
            out = np.empty((n, self.net.config.vocab_size), np.float32)
        else:
            tg = np.asarray(targets, np.int64)
            logp, top = np.empty(n, np.float64), np.empty(n, bool)
        self._decoder_busy = True
        try:
            self._fused_score.bind()
            for x, start, last in self._chunks([int(t) for t in ids], self._fused_chunk(n)):
                rows = self._fused_op(self._fused_score, "score", start, x, np.array([start, 0], np.int32))
                rows = rows[: min(last + 1, n - start)]  # a short sequence's padding dropped
                at = slice(start, start + len(rows))
                if targets is None:
                    out[at] = rows
                    continue
                z = rows.astype(np.float64)
                m = z.max(-1)
                lse = m + np.log(np.exp(z - m[:, None]).sum(-1))
                picked = z[np.arange(len(z)), tg[at]]
                logp[at], top[at] = picked - lse, z.argmax(-1) == tg[at]
        finally:
            self._decoder_busy = False
            if park:
                self.park()
        self._compiled("score")
        return out if targets is None else (logp, top)

    def park(self) -> None:
        """This Generator's sequences are over for now: the fused kernel's threads sleep at once instead of spinning
        10 ms for a next call (`FusedDecodeStep.park`; the pool is the library's, one for all three steps). A
        sequence's end does it (generate, score), so only a caller that deferred it (`score(..., park=False)` in a
        loop) calls this."""
        if self._fused is not None:
            self._fused.park()

    def _fused_op(self, op, what: str, pos: int, *args):
        """One call of a fused prefill/decode step; its failure is a DecodeError naming the path, not a switch."""
        try:
            return op(*args)
        except RuntimeError as exc:  # the op failed to load or run: an error with its reason, never a fallback
            raise DecodeError(
                f"the fused {what} step failed at position {pos} ({self.decode_reason}): "
                f"{str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}; "
                f"MSLLM_FUSED_DECODE=0 decodes on MindSpore's kernels instead"
            ) from exc

    # Each path is a coroutine: it yields the logits [V] for the next position, and is sent the
    # token chosen there.

    def _cached_steps(self, ids: list[int], base_only: bool = False):
        """`base_only`: the caller promises that the net's LoRA layers add exactly zero at every step of this
        sequence (the server's base requests on a `LoRASlots` net), so the fused step, which reads only each
        projection's base weight, may decode it; otherwise a net with unmerged LoRA layers decodes on the
        decoder's MindSpore kernels, which apply them."""
        n = len(ids)
        fused = self._fused is not None and (base_only or not self._lora_on())
        if not fused:
            self._refuse_lean("unmerged LoRA layers")
        if self._decoder is not None and not self._decoder_busy:
            # in-place caches; slots past the prompt are masked until written
            self._decoder_busy = True
            try:
                zero = Tensor(0, ms.int32)
                # fixed [1, C] chunks: the same shapes for every prompt (the fused step: longer ones past 256 tokens)
                # (the three fused steps are built together: `fused` means the prefill step is there too)
                c = self._fused_chunk(n) if fused else self.prefill_chunk
                if fused:
                    self._fused_prefill.bind()
                for x, start, last in self._chunks(ids, c, pad_last=fused):
                    if fused:
                        where = np.array([start, last], np.int32)
                        logits = self._fused_op(self._fused_prefill, "prefill", start, x, where)[0]
                    else:
                        logits = self._decode(Tensor(x), Tensor(start, ms.int32), Tensor(last, ms.int32)).asnumpy()[0]
                self._compiled("prefill")
                tok = yield logits
                pos = n
                if fused:
                    self._fused.bind()
                while True:
                    if fused:
                        logits = self._fused_op(self._fused, "decode", pos, np.array([[tok]], np.int32), np.int32(pos))
                    else:
                        logits = self._decode(Tensor([[tok]], ms.int32), Tensor(pos, ms.int32), zero).asnumpy()
                    self._compiled("decode")
                    tok = yield logits[0]
                    pos += 1
            finally:  # close(), or the coroutine garbage-collected
                self._decoder_busy = False
                if fused:
                    self.park()
        self._refuse_lean("a second sequence interleaved with the one decoding")
        k, v = self.net.init_cache(1, self.max_len)
        for x, start, last in self._chunks(ids):
            logits, k, v = self._chunk_step(
                Tensor(x), Tensor(start, ms.int32), Tensor(last, ms.int32), ms.mutable(k), ms.mutable(v)
            )
        pos = n
        tok = yield logits.asnumpy()[0, 0]
        while True:
            logits, k, v = self._step(Tensor([[tok]], ms.int32), Tensor(pos, ms.int32), ms.mutable(k), ms.mutable(v))
            pos += 1
            tok = yield logits.asnumpy()[0, 0]

    def batch(self, slots: int) -> BatchDecoder:
        """A `BatchDecoder` (model/batch_decode.py) of `slots` sequences over this Generator's network, weights and
        fused steps."""
        return BatchDecoder(self, slots)

    def _refuse_lean(self, what: str) -> None:
        """A MindSpore path on a network holding only its stored matrices (its own are placeholders): an error."""
        if self.lean:
            raise DecodeError(
                f"{what} needs the float32 weights, and this network holds only its {self.weights} matrices "
                f"(load_network(..., weights={self.weights!r})): one sequence at a time through the fused steps; "
                "load it whole (weights='fp32') for more"
            )

    def _uncached_steps(self, ids: list[int]):
        self._refuse_lean("decoding without the KV cache (use_cache=False)")
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
