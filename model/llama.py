"""LLaMA decoder-only transformer in MindSpore, and its causal-LM loss.

    model = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=0)
    logits = model(input_ids)              # [B, T] int32 -> [B, T, vocab] float32
    loss = model.loss(input_ids, labels)   # labels aligned with input_ids, -100 = ignore
    k, v = model.init_cache(batch_size=1)  # KV-cache decoding (see model/generate.py)
    logits, k, v = model.forward_cached(input_ids, ms.Tensor(0, ms.int32), k, v)

Parameter names mirror Hugging Face's LlamaForCausalLM without the "model."
prefix (embed_tokens.weight, layers.0.self_attn.q_proj.weight, ..., norm.weight,
lm_head.weight), every projection weight is [out, in] and RoPE uses HF's
rotate-half layout, so weight conversion is a plain rename table.

Mixed precision: `LlamaForCausalLM(config, compute_dtype=ms.float16)` keeps fp32
master Parameters and runs the projections and attention matmuls in fp16 (input and
weight cast per call, so gradients reach the fp32 weights through the Cast); the
residual stream is fp16, RMSNorm, softmax and the loss run in fp32 and logits are
returned as fp32. The default float32 adds no casts at all.

CPU-driven choices (see docs/MINDSPORE_CPU.md): attention scores use BatchMatMul(transpose_b=True),
softmax runs on 2-D rows, broadcasting element-wise ops are avoided where one broadcast can be shared (the
causal mask, RoPE's cos/sin), the loss is the fused LogSoftmax kernel plus a gather. The building blocks
(projection, embedding, RMSNorm, SwiGLU, RoPE tables, the fused-kernel cells) are in model/layers.py.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops

from model.config import ModelConfig
from model.layers import (
    Embedding,
    Linear,
    MaskedSoftmax,
    RMSNorm,
    SwiGLU,
    causal_mask,
    rotate_half_matrix,
    untouched_zeros,
)
from model.rope import rope_tables


class Attention(nn.Cell):
    """Grouped-query causal self-attention with RoPE.

    `num_heads` / `num_kv_heads` are the heads this cell computes: all of them, or this rank's share once
    tensor parallelism slices the projections (tasks/modeling/parallelize.py sets both).
    """

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32):
        super().__init__()
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.n_rep = config.num_heads // config.num_kv_heads
        self.scale = hd**-0.5
        self.q_proj = Linear(init(config.num_heads * hd, h), compute_dtype)
        self.k_proj = Linear(init(config.num_kv_heads * hd, h), compute_dtype)
        self.v_proj = Linear(init(config.num_kv_heads * hd, h), compute_dtype)
        self.o_proj = Linear(init(h, config.num_heads * hd), compute_dtype)
        self.softmax = MaskedSoftmax(compute_dtype)  # the training forward's (causal) softmax
        self.fused = None  # the training forward's fused attention, where the build swaps one in (FusedCausalAttention)
        self.cache_softmax = MaskedSoftmax(compute_dtype)  # the KV-cache path's (mask over the cache slots)
        self.scores_matmul = ops.BatchMatMul(transpose_b=True)
        self.values_matmul = ops.BatchMatMul()
        self.rotate = Tensor(rotate_half_matrix(hd).astype(np.float16 if self.half else np.float32))
        self.rotate_matmul = ops.MatMul()

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        q, k, v = self._qkv(x, cos, sin)
        if self.fused is not None:  # one kernel for scores, causal softmax and values (model/fused_cells.py)
            b, nh, t, hd = q.shape
            out = ops.transpose(self.fused(q, k, v)[0], (0, 2, 1, 3)).reshape(b, t, nh * hd)  # [B, T, nh*hd]
            return self.o_proj(out)  # [B, T, H]
        return self._attend(q, k, v, mask, self.softmax)  # [B, T, H]

    def construct_cached(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        src: Tensor,
        written: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Attention of x's T tokens over a fixed-size cache [B, nkv, S, hd] that they are written into.

        Cache slot j takes the new token src[j] where written[j] (one gather + select keeps the
        cache shape fixed, so a jit-compiled step never recompiles); mask is [T, S].
        """
        q, k, v = self._qkv(x, cos, sin)
        place = written.reshape(1, 1, -1, 1)  # [1, 1, S, 1]
        k_cache = ops.where(place, ops.gather(k, src, 2), k_cache)  # [B, nkv, S, hd]
        v_cache = ops.where(place, ops.gather(v, src, 2), v_cache)  # [B, nkv, S, hd]
        return self._attend(q, k_cache, v_cache, mask, self.cache_softmax), k_cache, v_cache

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, h = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = ops.transpose(self.q_proj(x).reshape(b, t, nh, hd), (0, 2, 1, 3))  # [B, nh, T, hd]
        k = ops.transpose(self.k_proj(x).reshape(b, t, nkv, hd), (0, 2, 1, 3))  # [B, nkv, T, hd]
        v = ops.transpose(self.v_proj(x).reshape(b, t, nkv, hd), (0, 2, 1, 3))  # [B, nkv, T, hd]
        return self._rope(q, cos, sin) * self.scale, self._rope(k, cos, sin), v

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """apply_rope, with rotate-half as a MatMul by a ±1 permutation (exact) and cos/sin broadcast
        once: split/negate/concat and broadcasting element-wise ops are slow on CPU."""
        rotated = self.rotate_matmul(x.reshape(-1, self.head_dim), self.rotate).reshape(x.shape)
        return x * ops.broadcast_to(cos, x.shape) + rotated * ops.broadcast_to(sin, x.shape)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, softmax: nn.Cell) -> Tensor:
        """mask: [T, S], or already broadcast to [B * nh, T, S] (LlamaForCausalLM.construct does,
        once for all layers: adding a broadcast mask costs ~2x a same-shape add on CPU), unused by a
        softmax that applies the causal mask itself."""
        b, nh, t, hd = q.shape
        nkv = self.num_kv_heads
        # GQA without copying K/V: query heads h*n_rep..h*n_rep+n_rep-1 share kv head h,
        # so fold them into the query-length axis of their kv head.
        q = q.reshape(b, nkv, self.n_rep * t, hd)  # [B, nkv, rep*T, hd]
        scores = self.scores_matmul(q, k)  # [B, nkv, rep*T, S]
        s = scores.shape[-1]
        probs = softmax(scores.reshape(b * nh, t, s), mask)  # [B*nh(*T), (T,) S]
        out = self.values_matmul(probs.reshape(b, nkv, self.n_rep * t, s), v).reshape(b, nh, t, hd)  # [B, nh, T, hd]
        out = ops.transpose(out, (0, 2, 1, 3)).reshape(b, t, nh * hd)  # [B, T, nh*hd]
        return self.o_proj(out)  # [B, T, H]


class MLP(nn.Cell):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(init(f, h), compute_dtype)
        self.up_proj = Linear(init(f, h), compute_dtype)
        self.down_proj = Linear(init(h, f), compute_dtype)
        self.swiglu = SwiGLU()

    def construct(self, x: Tensor) -> Tensor:
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))  # [B, T, H]


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32):
        super().__init__()
        self.self_attn = Attention(config, init, compute_dtype)
        self.mlp = MLP(config, init, compute_dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, compute_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, compute_dtype)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)  # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x))  # [B, T, H]

    def construct_cached(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor,
        src: Tensor,
        written: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        a, k_cache, v_cache = self.self_attn.construct_cached(
            self.input_layernorm(x), cos, sin, mask, src, written, k_cache, v_cache
        )
        x = x + a  # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class LlamaForCausalLM(nn.Cell):
    """LLaMA decoder with an LM head; fp32 weights.

    `seed` drives a numpy RandomState that draws every weight (normal(0, init_std),
    norms = 1), so the init is reproducible and independent of MindSpore's global seed. `init_weights=False`
    draws nothing and allocates nothing for the projections and the embedding (placeholders the caller assigns
    before any use: a model artifact's weights, tasks/modeling/build.py).
    `compute_dtype` (ms.float32 or ms.float16) is the matmul / residual-stream dtype;
    Parameters stay fp32 either way, logits are always fp32.
    A plain model: no kernel choice and no parallelism inside. The build sequence (tasks/modeling/build.py
    `build_network`: build → convert → parallelize) swaps in the fused-kernel cells (model/fused_cells.py) and
    applies the tensor-parallel plan from outside; inference and export use the plain cells.
    """

    def __init__(
        self, config: ModelConfig, seed: int | None = None, compute_dtype=ms.float32, *, init_weights: bool = True
    ):
        super().__init__()
        if compute_dtype not in (ms.float32, ms.float16):
            raise ValueError(f"compute_dtype must be mindspore.float32 or mindspore.float16, got {compute_dtype}")
        self.config = config
        self.compute_dtype = compute_dtype
        self.half = compute_dtype != ms.float32
        rng = np.random.RandomState(seed)

        def init(*shape: int) -> np.ndarray | Tensor:
            if not init_weights:  # weights assigned next (tasks/modeling/build.py): a placeholder, nothing resident
                return untouched_zeros(shape, "weight")
            return rng.normal(0.0, config.init_std, size=shape).astype(np.float32)

        h = config.hidden_size
        self.tie_embeddings = config.tie_embeddings
        self.embed_tokens = Embedding(init(config.vocab_size, h), compute_dtype)
        self.layers = nn.CellList([DecoderLayer(config, init, compute_dtype) for _ in range(config.num_layers)])
        self.norm = RMSNorm(h, config.norm_eps, compute_dtype)
        self.loss_fn = CausalLMLoss()
        if not config.tie_embeddings:
            self.lm_head = Linear(init(config.vocab_size, h), compute_dtype)
        self.tied_matmul = ops.MatMul(transpose_b=True)
        cos, sin = rope_tables(config.head_dim, config.max_seq_length, config.rope_theta)
        if self.half:  # tables in the compute dtype: q/k stay fp16 through RoPE
            cos, sin = cos.astype(np.float16), sin.astype(np.float16)
        self.rope_cos, self.rope_sin = Tensor(cos), Tensor(sin)  # constants, not Parameters

    def enable_recompute(self) -> None:
        """Recompute each decoder layer's activations in backward (less memory, more compute)."""
        for layer in self.layers:
            layer.recompute()

    def construct(self, input_ids: Tensor) -> Tensor:
        return self.head_logits(self.hidden_states(input_ids))  # [B, T, V]

    def hidden_states(self, input_ids: Tensor) -> Tensor:
        """The last decoder layer's output [B, T, H] (before the final norm): `head_logits` of it is `construct`.
        Callers that need only some positions' logits (the eval scorer) run the head on those rows alone."""
        x, cos, sin, mask = self.layer_inputs(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, mask)  # [B, T, H]
        return x

    def layer_inputs(self, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """What every decoder layer of `hidden_states` takes: (embeddings [B, T, H], cos [T, hd], sin [T, hd],
        the causal mask [B*nh, T, T], or a 0-d zero where the softmax applies it itself)."""
        b, t = input_ids.shape
        positions = ops.arange(t, dtype=ms.int32)  # [T]
        cos = ops.gather(self.rope_cos, positions, 0)  # [T, hd]
        sin = ops.gather(self.rope_sin, positions, 0)  # [T, hd]
        attn = self.layers[0].self_attn
        heads = attn.num_heads  # the heads the cell computes (its slice)
        if attn.softmax.applies_mask:  # a fused causal softmax (model/fused_cells.py): no mask to build
            mask = ops.zeros((), ms.float32)
        else:
            mask = ops.broadcast_to(
                ops.stop_gradient(causal_mask(positions, positions)), (b * heads, t, t)
            )  # [B*nh, T, T]
        return self.embed_tokens(input_ids), cos, sin, mask  # [B, T, H], ...

    def head_logits(self, x: Tensor) -> Tensor:
        """Logits [B, T, V] of decoder outputs x [B, T, H]: the final norm, then the LM head (tied or not)."""
        b, t, _ = x.shape
        x = self.norm(x)  # [B, T, H]
        if self.half:
            if self.tie_embeddings:
                logits = self.tied_matmul(x.reshape(b * t, -1), self.embed_tokens.weight.astype(self.compute_dtype))
                return logits.reshape(b, t, -1).astype(ms.float32)  # [B, T, V]
            return self.lm_head(x).astype(ms.float32)  # [B, T, V]
        if self.tie_embeddings:
            logits = self.tied_matmul(x.reshape(b * t, -1), self.embed_tokens.weight)
            return logits.reshape(b, t, -1)  # [B, T, V]
        return self.lm_head(x)  # [B, T, V]

    def init_cache(self, batch_size: int, max_len: int | None = None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Zeroed KV caches for `forward_cached`: per layer one K and one V of [B, n_kv, max_len, head_dim] (compute
        dtype)."""
        c = self.config
        shape = (batch_size, c.num_kv_heads, max_len or c.max_seq_length, c.head_dim)
        k = tuple(ops.zeros(shape, self.compute_dtype) for _ in range(c.num_layers))
        v = tuple(ops.zeros(shape, self.compute_dtype) for _ in range(c.num_layers))
        return k, v

    def forward_cached(
        self, input_ids: Tensor, start_pos: Tensor, k_caches: tuple, v_caches: tuple, last: Tensor | None = None
    ) -> tuple[Tensor, tuple, tuple]:
        """Logits of input_ids [B, T] at positions start_pos.. (a 0-d int32 Tensor), attending to the cache.

        Writes the tokens' K/V into cache slots start_pos..start_pos+T-1 and returns
        (logits [B, T, V], new k_caches, new v_caches). Caches keep their fixed shape
        [B, n_kv, S, hd] (S slots; see `init_cache`), and start_pos is a Tensor, so one
        jit compilation serves every decode step. Slots after the last written one may
        hold stale values: the causal mask hides them, and positions past the prompt
        are overwritten before any query can see them. Prefill is a call with start_pos 0.
        """
        b, t = input_ids.shape
        s = k_caches[0].shape[2]
        positions = start_pos + ops.arange(t, dtype=ms.int32)  # [T]
        slots = ops.arange(s, dtype=ms.int32)  # [S]
        cos = ops.gather(self.rope_cos, positions, 0)  # [T, hd]
        sin = ops.gather(self.rope_sin, positions, 0)  # [T, hd]
        mask = causal_mask(positions, slots)  # [T, S]
        offset = slots - start_pos  # [S]: which new token goes to slot j
        written = ops.logical_and(offset >= 0, offset < t)  # [S]
        src = ops.clip(offset, 0, t - 1)  # [S]
        x = self.embed_tokens(input_ids)  # [B, T, H]
        new_k, new_v = (), ()
        for i, layer in enumerate(self.layers):
            x, k, v = layer.construct_cached(x, cos, sin, mask, src, written, k_caches[i], v_caches[i])
            new_k = new_k + (k,)
            new_v = new_v + (v,)
        if last is not None:  # a prompt chunk: only the row whose logits are wanted goes through the head
            x = ops.gather(x, last.reshape(1), 1)  # [B, 1, H]
        return self.head_logits(x), new_k, new_v  # [B, T or 1, V], caches

    def loss(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross-entropy; labels[b, t] is the target of position t (-100 = ignored)."""
        return self.loss_fn(self.construct(input_ids), labels)  # self(...) fails under jit


class CausalLMLoss(nn.Cell):
    """`causal_lm_loss` as a cell: the model's `loss_fn`, which the build's convert step may swap for the fused
    cross-entropy (model/fused_cells.py FusedCausalLMLoss)."""

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        return causal_lm_loss(logits, labels)


def causal_lm_loss(logits: Tensor, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of logits [B, T, V] against labels [B, T], skipping ignore_index.

    Labels are already aligned with the logits (no shift here: the data pipeline
    stores tokens[1:] as labels of tokens[:-1]). Returns a float32 scalar, 0 when
    every label is ignored. The fused LogSoftmax kernel on 2-D [N, V] rows, then a
    gather: ~2.8x faster forward + backward on CPU than a hand-written log-sum-exp
    (whose last-axis ReduceMax alone took as long as the lm_head matmul), with fewer
    logit-sized intermediates.
    """
    vocab = logits.shape[-1]
    logits = logits.reshape(-1, vocab).astype(ms.float32)  # [N, V]
    labels = labels.reshape(-1)  # [N]
    keep = labels != ignore_index  # [N]
    safe_labels = ops.select(keep, labels, ops.zeros_like(labels))
    logp = ops.log_softmax(logits, -1)  # [N, V]
    target = ops.gather_elements(logp, 1, safe_labels.reshape(-1, 1)).reshape(-1)  # [N]
    nll = ops.select(keep, -target, ops.zeros_like(target))  # [N]
    count = keep.astype(ms.float32).sum()
    return nll.sum() / ops.maximum(count, 1.0)
