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

CPU-driven choices (see docs/MINDSPORE_CPU.md): projections are one 2-D MatMul
on the flattened tokens, attention scores use BatchMatMul(transpose_b=True); last-axis
reductions run on 2-D tensors or as a MatMul by a ones column (RMSNorm, softmax rows),
broadcasting element-wise ops are avoided where one broadcast can be shared (the causal
mask, RoPE's cos/sin), the loss is the fused LogSoftmax kernel plus a gather, SwiGLU has
a hand-written backward; RMSNorm / embedding avoid Rsqrt and nn.Embedding so the model
exports to ONNX.
"""

from __future__ import annotations

import numpy as np
import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from model.config import ModelConfig

_MASKED = -1e9  # additive score for disallowed keys; exp() of it underflows to exactly 0


def rope_tables(head_dim: int, max_seq_length: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin tables [max_seq_length, head_dim] for rotate-half RoPE (HF layout)."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    freqs = np.outer(np.arange(max_seq_length, dtype=np.float64), inv_freq)  # [S, hd/2]
    angles = np.concatenate([freqs, freqs], axis=-1)                         # [S, hd]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, hd] by the angles of its positions; cos/sin are [T, hd]."""
    x1, x2 = ops.chunk(x, 2, axis=-1)
    return x * cos + ops.cat((-x2, x1), axis=-1) * sin


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R [hd, hd] with x @ R == cat(-x2, x1) exactly (entries 0 and ±1: every output is one input)."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0   # out[:half] = -x2
    r[np.arange(half), np.arange(half) + half] = 1.0    # out[half:] = x1
    return r


def causal_mask(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """Additive mask [Tq, Tk]: 0 where the key is at or before the query, else -1e9.

    Built from positions (not from T alone) so a KV-cache decode step, whose
    queries sit at the end of a longer key sequence, can reuse it.
    """
    future = k_positions.reshape(1, -1) > q_positions.reshape(-1, 1)
    return future.astype(ms.float32) * _MASKED


class Linear(nn.Cell):
    """Bias-free projection with an [out, in] weight, as ONE 2-D matmul on flattened tokens."""

    def __init__(self, weight: np.ndarray, compute_dtype=ms.float32):
        super().__init__()
        self.out_features = weight.shape[0]
        self.weight = Parameter(Tensor(weight), name="weight")
        self.matmul = ops.MatMul(transpose_b=True)
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [N, in] @ [out, in]^T -> [..., out]
        if self.half:  # fp32 master weight, low-precision matmul; output stays in compute_dtype
            y = self.matmul(x.reshape(-1, x.shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype))
        else:
            y = self.matmul(x.reshape(-1, x.shape[-1]), self.weight)
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token embedding as a gather on a [vocab, hidden] Parameter (ONNX-exportable)."""

    def __init__(self, weight: np.ndarray, compute_dtype=ms.float32):
        super().__init__()
        self.weight = Parameter(Tensor(weight), name="weight")
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, input_ids: Tensor) -> Tensor:
        x = ops.gather(self.weight, input_ids, 0)  # [B, T] -> [B, T, H]
        if self.half:
            x = x.astype(self.compute_dtype)
        return x


class FusedRMSNorm(nn.Cell):
    """RMSNorm forward and backward as one fused kernel each (model/train_kernels.cc); the backward
    recomputes 1/rms from x (one pass) rather than keeping it."""

    def __init__(self, kernels, eps: float):
        super().__init__()
        self.forward_op, self.backward_op = kernels.rms_norm, kernels.rms_norm_grad
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.forward_op(x, weight, self.eps)

    def bprop(self, x, weight, out, dout):
        return self.backward_op(x, weight, self.eps, dout)


class RMSNorm(nn.Cell):
    """x * (1 / sqrt(mean(x^2) + eps)) * weight, over the last axis (no Rsqrt: ONNX has no mapping).

    On the flattened tokens [N, H], with the sum of squares as a MatMul by a ones column: a
    last-axis ReduceMean of a 3-D tensor and Div's gradient are slow on CPU (docs/MINDSPORE_CPU.md).
    """

    def __init__(self, hidden_size: int, eps: float, compute_dtype=ms.float32, kernels=None):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = Parameter(Tensor(np.ones(hidden_size, np.float32)), name="weight")
        self.ones = Tensor(np.ones((hidden_size, 1), np.float32))  # a constant, not a Parameter
        self.sum_matmul = ops.MatMul()
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype
        self.fused = kernels is not None and not self.half
        if self.fused:  # forward and backward one fused kernel each (model/kernels.py)
            self.fused_norm = FusedRMSNorm(kernels, eps)

    def construct(self, x: Tensor) -> Tensor:
        if self.fused:
            return self.fused_norm(x, self.weight)
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)                                   # [N, H]
        if self.half:  # normalise in fp32, hand back the compute dtype
            x2 = x2.astype(ms.float32)
        mean_sq = self.sum_matmul(x2 * x2, self.ones) / self.hidden_size       # [N, 1]
        y = x2 * (1.0 / ops.sqrt(mean_sq + self.eps)) * self.weight            # [N, H]
        if self.half:
            y = y.astype(self.compute_dtype)
        return y.reshape(shape)


class Attention(nn.Cell):
    """Grouped-query causal self-attention with RoPE.

    Under tensor parallel (model/parallel.py) each rank holds num_heads/tp query heads and
    num_kv_heads/tp KV heads (the KV heads its query heads share) and all-reduces o_proj's output.
    """

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32, tensor_parallel=None, kernels=None):
        super().__init__()
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype
        # the training forward's mask + softmax (and its backward) as one fused op each (model/kernels.py)
        self.fused = kernels is not None and not self.half
        if self.fused:
            self.causal_softmax = FusedCausalSoftmax(kernels)
        tp = tensor_parallel
        t = tp.size if tp is not None else 1
        h, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads // t, config.num_kv_heads // t, hd
        self.n_rep = config.num_heads // config.num_kv_heads
        self.scale = hd ** -0.5
        # full matrices drawn in the same order as on one device, then sliced: same init at any tp
        q, k, v, o = (init(config.num_heads * hd, h), init(config.num_kv_heads * hd, h),
                      init(config.num_kv_heads * hd, h), init(h, config.num_heads * hd))
        if tp is not None:
            q, k, v, o = tp.rows(q), tp.rows(k), tp.rows(v), tp.cols(o)
        self.q_proj = Linear(q, compute_dtype)
        self.k_proj = Linear(k, compute_dtype)
        self.v_proj = Linear(v, compute_dtype)
        self.o_proj = Linear(o, compute_dtype)
        self.scores_matmul = ops.BatchMatMul(transpose_b=True)
        self.values_matmul = ops.BatchMatMul()
        self.rotate = Tensor(rotate_half_matrix(hd).astype(np.float16 if self.half else np.float32))
        self.rotate_matmul = ops.MatMul()
        self.tp = tp is not None
        if self.tp:
            from model.parallel import CopyToTP, ReduceFromTP

            self.tp_in, self.tp_out = CopyToTP(tp.group), ReduceFromTP(tp.group)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        if self.tp:
            x = self.tp_in(x)
        q, k, v = self._qkv(x, cos, sin)
        out = self._attend(q, k, v, mask, True)                                   # [B, T, H] (partial under tp)
        if self.tp:
            out = self.tp_out(out)
        return out

    def construct_cached(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, src: Tensor, written: Tensor,
                         k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Attention of x's T tokens over a fixed-size cache [B, nkv, S, hd] that they are written into.

        Cache slot j takes the new token src[j] where written[j] (one gather + select keeps the
        cache shape fixed, so a jit-compiled step never recompiles); mask is [T, S].
        """
        q, k, v = self._qkv(x, cos, sin)
        place = written.reshape(1, 1, -1, 1)                                      # [1, 1, S, 1]
        k_cache = ops.where(place, ops.gather(k, src, 2), k_cache)               # [B, nkv, S, hd]
        v_cache = ops.where(place, ops.gather(v, src, 2), v_cache)               # [B, nkv, S, hd]
        return self._attend(q, k_cache, v_cache, mask, False), k_cache, v_cache

    def _qkv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        b, t, h = x.shape
        nh, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        q = ops.transpose(self.q_proj(x).reshape(b, t, nh, hd), (0, 2, 1, 3))   # [B, nh, T, hd]
        k = ops.transpose(self.k_proj(x).reshape(b, t, nkv, hd), (0, 2, 1, 3))  # [B, nkv, T, hd]
        v = ops.transpose(self.v_proj(x).reshape(b, t, nkv, hd), (0, 2, 1, 3))  # [B, nkv, T, hd]
        return self._rope(q, cos, sin) * self.scale, self._rope(k, cos, sin), v

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """apply_rope, with rotate-half as a MatMul by a ±1 permutation (exact) and cos/sin broadcast
        once: split/negate/concat and broadcasting element-wise ops are slow on CPU."""
        rotated = self.rotate_matmul(x.reshape(-1, self.head_dim), self.rotate).reshape(x.shape)
        return x * ops.broadcast_to(cos, x.shape) + rotated * ops.broadcast_to(sin, x.shape)

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, causal: bool) -> Tensor:
        """mask: [T, S], or already broadcast to [B * nh, T, S] (LlamaForCausalLM.construct does,
        once for all layers: adding a broadcast mask costs ~2x a same-shape add on CPU). `causal`: the
        queries are the last T of the S keys (the training forward), so a fused causal softmax may
        replace the mask (it is then unused)."""
        b, nh, t, hd = q.shape
        nkv = self.num_kv_heads
        # GQA without copying K/V: query heads h*n_rep..h*n_rep+n_rep-1 share kv head h,
        # so fold them into the query-length axis of their kv head.
        q = q.reshape(b, nkv, self.n_rep * t, hd)                                 # [B, nkv, rep*T, hd]
        scores = self.scores_matmul(q, k)                                         # [B, nkv, rep*T, S]
        s = scores.shape[-1]
        if self.fused and causal:
            probs = self.causal_softmax(scores.reshape(b * nh, t, s))                # [B*nh, T, S]
            out = self.values_matmul(probs.reshape(b, nkv, self.n_rep * t, s), v).reshape(b, nh, t, hd)
            return self.o_proj(ops.transpose(out, (0, 2, 1, 3)).reshape(b, t, nh * hd))
        # softmax over 2-D rows: a last-axis reduction (softmax's backward) of a 4-D tensor is ~3.5x slower
        if self.half:  # mask and softmax in fp32, probabilities back to the compute dtype
            scores = scores.reshape(b * nh, t, s).astype(ms.float32) + mask      # [B*nh, T, S]
            probs = ops.softmax(scores.reshape(-1, s), -1).astype(self.compute_dtype)
        else:
            scores = scores.reshape(b * nh, t, s) + mask                          # [B*nh, T, S]
            probs = ops.softmax(scores.reshape(-1, s), -1)                        # [B*nh*T, S]
        out = self.values_matmul(probs.reshape(b, nkv, self.n_rep * t, s), v).reshape(b, nh, t, hd)  # [B, nh, T, hd]
        out = ops.transpose(out, (0, 2, 1, 3)).reshape(b, t, nh * hd)             # [B, T, nh*hd]
        return self.o_proj(out)                                                   # [B, T, H]


class FusedCausalSoftmax(nn.Cell):
    """softmax(scores + causal mask) over the last axis of [N, T, S] (queries at the last T of S keys), forward
    and backward each one fused kernel (model/train_kernels.cc): 2-3x MindSpore's mask add + Softmax and
    its expanded backward (Mul, ReduceSum, Sub, Mul) on CPU. Masked keys get probability exactly 0."""

    def __init__(self, kernels):
        super().__init__()
        self.forward_op, self.backward_op = kernels.causal_softmax, kernels.softmax_grad

    def construct(self, scores: Tensor) -> Tensor:
        return self.forward_op(scores)

    def bprop(self, scores, out, dout):
        return (self.backward_op(out, dout),)


class FusedCrossEntropy(nn.Cell):
    """Per-row cross-entropy of logits [N, V] against int32 labels [N] (negative = ignored, nll 0), returning
    (nll [N], logsumexp [N]); forward and backward one pass each (model/train_kernels.cc): no [N, V]
    log-probability buffer is kept, and the backward writes dlogits directly."""

    def __init__(self, kernels):
        super().__init__()
        self.forward_op, self.backward_op = kernels.cross_entropy, kernels.cross_entropy_grad

    def construct(self, logits: Tensor, labels: Tensor):
        return self.forward_op(logits, labels)

    def bprop(self, logits, labels, out, dout):
        return self.backward_op(logits, labels, out[1], dout[0]), ops.zeros_like(labels)


class SwiGLU(nn.Cell):
    """silu(gate) * up, with a hand-written backward: ~28% faster forward + backward on CPU than
    autodiff of ops.silu (which expands to Sigmoid, SigmoidGrad and more element-wise passes); with
    `kernels` (model/kernels.py) forward and backward are one fused kernel each (~2x and ~3.5x faster)."""

    def __init__(self, kernels=None):
        super().__init__()
        self.fused = kernels is not None
        if self.fused:
            self.forward_op, self.backward_op = kernels.swiglu, kernels.swiglu_grad

    def construct(self, gate: Tensor, up: Tensor) -> Tensor:
        if self.fused:
            return self.forward_op(gate, up)
        return ops.silu(gate) * up

    def bprop(self, gate, up, out, dout):
        if self.fused:
            return self.backward_op(gate, up, dout)
        s = ops.sigmoid(gate)
        a = gate * s                                       # silu(gate)
        # d silu(g) / dg = s + g * s * (1 - s) = s * (1 + g - a)
        return dout * up * (s * (1.0 + gate - a)), dout * a


class MLP(nn.Cell):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32, tensor_parallel=None, kernels=None):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        tp = tensor_parallel
        gate, up, down = init(f, h), init(f, h), init(h, f)
        if tp is not None:  # each rank: f/tp hidden units
            gate, up, down = tp.rows(gate), tp.rows(up), tp.cols(down)
        self.gate_proj = Linear(gate, compute_dtype)
        self.up_proj = Linear(up, compute_dtype)
        self.down_proj = Linear(down, compute_dtype)
        self.swiglu = SwiGLU(kernels if compute_dtype == ms.float32 else None)
        self.tp = tp is not None
        if self.tp:
            from model.parallel import CopyToTP, ReduceFromTP

            self.tp_in, self.tp_out = CopyToTP(tp.group), ReduceFromTP(tp.group)

    def construct(self, x: Tensor) -> Tensor:
        if self.tp:
            x = self.tp_in(x)
            return self.tp_out(self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x))))
        return self.down_proj(self.swiglu(self.gate_proj(x), self.up_proj(x)))  # [B, T, H]


class DecoderLayer(nn.Cell):
    """Pre-norm block: x + attn(norm(x)), then + mlp(norm(.))."""

    def __init__(self, config: ModelConfig, init, compute_dtype=ms.float32, tensor_parallel=None, kernels=None):
        super().__init__()
        self.self_attn = Attention(config, init, compute_dtype, tensor_parallel, kernels)
        self.mlp = MLP(config, init, compute_dtype, tensor_parallel, kernels)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps, compute_dtype, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps, compute_dtype, kernels)

    def construct(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)  # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x))            # [B, T, H]

    def construct_cached(self, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, src: Tensor, written: Tensor,
                         k_cache: Tensor, v_cache: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        a, k_cache, v_cache = self.self_attn.construct_cached(self.input_layernorm(x), cos, sin, mask, src, written,
                                                              k_cache, v_cache)
        x = x + a                                                        # [B, T, H]
        return x + self.mlp(self.post_attention_layernorm(x)), k_cache, v_cache


class LlamaForCausalLM(nn.Cell):
    """LLaMA decoder with an LM head; fp32 weights.

    `seed` drives a numpy RandomState that draws every weight (normal(0, init_std),
    norms = 1), so the init is reproducible and independent of MindSpore's global seed.
    `compute_dtype` (ms.float32 or ms.float16) is the matmul / residual-stream dtype;
    Parameters stay fp32 either way, logits are always fp32.
    `tensor_parallel` (a model.parallel.TensorParallel) builds this rank's slice of the model
    for Megatron-style tensor parallelism (training only: the KV-cache path is single-device).
    `fused_kernels=True` runs the training forward's causal softmax, SwiGLU and RMSNorm (and their backward) as fused
    custom ops (model/kernels.py, built with g++ on first use; fp32 only). Without a compiler, in fp16, or by
    default, MindSpore's own ops run: the same math to ~1e-6. The trainer turns it on (pretrain.fused_kernels);
    inference and export keep the built-in ops (a MindIR with a custom op would need its library).
    """

    def __init__(self, config: ModelConfig, seed: int | None = None, compute_dtype=ms.float32, tensor_parallel=None,
                 fused_kernels: bool = False):
        super().__init__()
        if compute_dtype not in (ms.float32, ms.float16):
            raise ValueError(f"compute_dtype must be mindspore.float32 or mindspore.float16, got {compute_dtype}")
        self.config = config
        self.compute_dtype = compute_dtype
        self.half = compute_dtype != ms.float32
        rng = np.random.RandomState(seed)

        def init(*shape: int) -> np.ndarray:
            return rng.normal(0.0, config.init_std, size=shape).astype(np.float32)

        h = config.hidden_size
        self.tie_embeddings = config.tie_embeddings
        self.embed_tokens = Embedding(init(config.vocab_size, h), compute_dtype)
        self.tensor_parallel = tensor_parallel
        if tensor_parallel is not None and (config.num_kv_heads % tensor_parallel.size
                                            or config.intermediate_size % tensor_parallel.size):
            raise ValueError(f"tensor_parallel={tensor_parallel.size} must divide num_kv_heads={config.num_kv_heads} "
                             f"and intermediate_size={config.intermediate_size}")
        from model.kernels import Capabilities, enabled

        kernels = None
        if enabled(fused_kernels, Capabilities(ms.get_context("device_target"), "fp16" if self.half else "fp32")):
            from model.kernels import train_ops

            kernels = train_ops()
        self.fused_kernels = kernels is not None
        if self.fused_kernels:
            self.cross_entropy = FusedCrossEntropy(kernels)
        self.layers = nn.CellList([DecoderLayer(config, init, compute_dtype, tensor_parallel, kernels)
                                   for _ in range(config.num_layers)])
        self.norm = RMSNorm(h, config.norm_eps, compute_dtype, kernels)
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
        b, t = input_ids.shape
        positions = ops.arange(t, dtype=ms.int32)                      # [T]
        cos = ops.gather(self.rope_cos, positions, 0)                  # [T, hd]
        sin = ops.gather(self.rope_sin, positions, 0)                  # [T, hd]
        heads = self.layers[0].self_attn.num_heads if len(self.layers) else 1  # this rank's heads
        if self.fused_kernels:  # the fused softmax applies the causal mask itself
            mask = ops.zeros((), ms.float32)
        else:
            mask = ops.broadcast_to(ops.stop_gradient(causal_mask(positions, positions)), (b * heads, t, t))  # [B*nh, T, T]
        x = self.embed_tokens(input_ids)                               # [B, T, H]
        for layer in self.layers:
            x = layer(x, cos, sin, mask)                               # [B, T, H]
        return self._logits(x)                                         # [B, T, V]

    def _logits(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        x = self.norm(x)                                               # [B, T, H]
        if self.half:
            if self.tie_embeddings:
                logits = self.tied_matmul(x.reshape(b * t, -1), self.embed_tokens.weight.astype(self.compute_dtype))
                return logits.reshape(b, t, -1).astype(ms.float32)     # [B, T, V]
            return self.lm_head(x).astype(ms.float32)                  # [B, T, V]
        if self.tie_embeddings:
            logits = self.tied_matmul(x.reshape(b * t, -1), self.embed_tokens.weight)
            return logits.reshape(b, t, -1)                            # [B, T, V]
        return self.lm_head(x)                                         # [B, T, V]

    def init_cache(self, batch_size: int, max_len: int | None = None) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
        """Zeroed KV caches for `forward_cached`: per layer one K and one V of [B, n_kv, max_len, head_dim] (compute dtype)."""
        c = self.config
        shape = (batch_size, c.num_kv_heads, max_len or c.max_seq_length, c.head_dim)
        k = tuple(ops.zeros(shape, self.compute_dtype) for _ in range(c.num_layers))
        v = tuple(ops.zeros(shape, self.compute_dtype) for _ in range(c.num_layers))
        return k, v

    def forward_cached(self, input_ids: Tensor, start_pos: Tensor, k_caches: tuple, v_caches: tuple
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
        positions = start_pos + ops.arange(t, dtype=ms.int32)          # [T]
        slots = ops.arange(s, dtype=ms.int32)                          # [S]
        cos = ops.gather(self.rope_cos, positions, 0)                  # [T, hd]
        sin = ops.gather(self.rope_sin, positions, 0)                  # [T, hd]
        mask = causal_mask(positions, slots)                           # [T, S]
        offset = slots - start_pos                                     # [S]: which new token goes to slot j
        written = ops.logical_and(offset >= 0, offset < t)             # [S]
        src = ops.clip(offset, 0, t - 1)                               # [S]
        x = self.embed_tokens(input_ids)                               # [B, T, H]
        new_k, new_v = (), ()
        for i, layer in enumerate(self.layers):
            x, k, v = layer.construct_cached(x, cos, sin, mask, src, written, k_caches[i], v_caches[i])
            new_k = new_k + (k,)
            new_v = new_v + (v,)
        return self._logits(x), new_k, new_v                           # [B, T, V], caches

    def loss(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        """Mean next-token cross-entropy; labels[b, t] is the target of position t (-100 = ignored)."""
        logits = self.construct(input_ids)  # self(...) fails under jit
        if self.fused_kernels:
            labels = labels.reshape(-1).astype(ms.int32)
            nll, _ = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)
            count = (labels != -100).astype(ms.float32).sum()
            return nll.sum() / ops.maximum(count, 1.0)
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
    logits = logits.reshape(-1, vocab).astype(ms.float32)                      # [N, V]
    labels = labels.reshape(-1)                                                # [N]
    keep = labels != ignore_index                                              # [N]
    safe_labels = ops.select(keep, labels, ops.zeros_like(labels))
    logp = ops.log_softmax(logits, -1)                                         # [N, V]
    target = ops.gather_elements(logp, 1, safe_labels.reshape(-1, 1)).reshape(-1)  # [N]
    nll = ops.select(keep, -target, ops.zeros_like(target))                    # [N]
    count = keep.astype(ms.float32).sum()
    return nll.sum() / ops.maximum(count, 1.0)
