"""The LLaMA decoder's building blocks, each with its forward and (where autodiff is slow on CPU) its backward:
RoPE's rotation (its tables: model/rope.py) and the causal mask, the bias-free projection, the embedding, RMSNorm,
SwiGLU and the masked softmax that model/llama.py puts together. Plain MindSpore: the fused-kernel cells of the same
signatures (model/fused_cells.py) are swapped in from outside, by the build's convert step (tasks/modeling/build.py).

    proj = Linear(weight)                                     # weight [out, in]: one 2-D MatMul on the tokens
    norm = RMSNorm(hidden, eps)                               # norm.normalize(x, weight) does the arithmetic

CPU-driven choices (see docs/MINDSPORE_CPU.md): projections are one 2-D MatMul on the flattened tokens;
last-axis reductions run on 2-D tensors or as a MatMul by a ones column (RMSNorm); SwiGLU has a hand-written
backward; RMSNorm / embedding avoid Rsqrt and nn.Embedding so the model exports to ONNX. A cell's Parameter
is named `weight`: the model's attribute path makes the full name (layers.0.self_attn.q_proj.weight).
"""

from __future__ import annotations

import mmap

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

_MASKED = -1e9  # additive score for disallowed keys; exp() of it underflows to exactly 0


def untouched_zeros(shape: tuple[int, ...], name: str, dtype=np.float32) -> Parameter:
    """A Parameter of zeros (not trained) whose memory is an anonymous mapping of its own, shared without a copy: its
    pages stay the kernel's zero page, resident only once written. `Parameter(Tensor(shape, init=Zero()))` lets
    numpy's calloc place smaller arrays in malloc's heap, where clearing them made them resident (30 MB at
    SmolLM2-135M's placeholders); `Parameter(Tensor.from_numpy(a))` copies. KV caches and the placeholders of a
    network whose weights arrive next (docs/MINDSPORE_CPU.md)."""
    n = int(np.prod(shape))
    arr = np.frombuffer(mmap.mmap(-1, max(4, n * np.dtype(dtype).itemsize)), dtype)[:n].reshape(shape)
    return parameter_over(arr, name)


def parameter_over(arr: np.ndarray, name: str) -> Parameter:
    """A Parameter (not trained) whose memory is the contiguous array `arr` itself: `Parameter(Tensor.from_numpy(a))`
    copies it, `set_data(Tensor.from_numpy(a))` on a 1-element placeholder shares it (docs/MINDSPORE_CPU.md)."""
    p = Parameter(Tensor(np.zeros(1, arr.dtype)), name=name, requires_grad=False)
    p.set_data(Tensor.from_numpy(arr))
    return p


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, heads, T, hd] by the angles of its positions; cos/sin are [T, hd]."""
    x1, x2 = ops.chunk(x, 2, axis=-1)
    return x * cos + ops.cat((-x2, x1), axis=-1) * sin


def rotate_half_matrix(head_dim: int) -> np.ndarray:
    """R [hd, hd] with x @ R == cat(-x2, x1) exactly (entries 0 and ±1: every output is one input)."""
    half = head_dim // 2
    r = np.zeros((head_dim, head_dim), np.float32)
    r[np.arange(half) + half, np.arange(half)] = -1.0  # out[:half] = -x2
    r[np.arange(half), np.arange(half) + half] = 1.0  # out[half:] = x1
    return r


def causal_mask(q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """Additive mask [Tq, Tk]: 0 where the key is at or before the query, else -1e9.

    Built from positions (not from T alone) so a KV-cache decode step, whose
    queries sit at the end of a longer key sequence, can reuse it.
    """
    future = k_positions.reshape(1, -1) > q_positions.reshape(-1, 1)
    return future.astype(ms.float32) * _MASKED


def _weight(weight: np.ndarray | Tensor) -> Parameter:
    """A cell's trainable `weight`: a Parameter of the array / Tensor, or a placeholder Parameter as it is."""
    if isinstance(weight, Parameter):
        weight.name, weight.requires_grad = "weight", True
        return weight
    return Parameter(weight if isinstance(weight, Tensor) else Tensor(weight), name="weight")


class Linear(nn.Cell):
    """Bias-free projection with an [out, in] weight, as ONE 2-D matmul on flattened tokens."""

    def __init__(self, weight: np.ndarray | Tensor, compute_dtype=ms.float32):
        super().__init__()
        self.out_features = weight.shape[0]
        self.weight = _weight(weight)
        self.matmul = ops.MatMul(transpose_b=True)
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, x: Tensor) -> Tensor:
        # x: [..., in] -> [N, in] @ [out, in]^T -> [..., out]
        if self.half:  # fp32 master weight, low-precision matmul; output stays in compute_dtype
            y = self.matmul(
                x.reshape(-1, x.shape[-1]).astype(self.compute_dtype), self.weight.astype(self.compute_dtype)
            )
        else:
            y = self.matmul(x.reshape(-1, x.shape[-1]), self.weight)
        return y.reshape(x.shape[:-1] + (self.out_features,))


class Embedding(nn.Cell):
    """Token embedding as a gather on a [vocab, hidden] Parameter (ONNX-exportable)."""

    def __init__(self, weight: np.ndarray | Tensor, compute_dtype=ms.float32):
        super().__init__()
        self.weight = _weight(weight)
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, input_ids: Tensor) -> Tensor:
        x = ops.gather(self.weight, input_ids, 0)  # [B, T] -> [B, T, H]
        if self.half:
            x = x.astype(self.compute_dtype)
        return x


class RMSNormFunction(nn.Cell):
    """The RMSNorm arithmetic of x [..., H] with a given weight [H] (what `RMSNorm` calls; the build's convert step
    may swap in the fused kernel cell of the same signature, model/fused_cells.py).

    On the flattened tokens [N, H], with the sum of squares as a MatMul by a ones column: a
    last-axis ReduceMean of a 3-D tensor and Div's gradient are slow on CPU (docs/MINDSPORE_CPU.md).
    """

    def __init__(self, hidden_size: int, eps: float, compute_dtype=ms.float32):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.ones = Tensor(np.ones((hidden_size, 1), np.float32))  # a constant, not a Parameter
        self.sum_matmul = ops.MatMul()
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.hidden_size)  # [N, H]
        if self.half:  # normalise in fp32, hand back the compute dtype
            x2 = x2.astype(ms.float32)
        mean_sq = self.sum_matmul(x2 * x2, self.ones) / self.hidden_size  # [N, 1]
        y = x2 * (1.0 / ops.sqrt(mean_sq + self.eps)) * weight  # [N, H]
        if self.half:
            y = y.astype(self.compute_dtype)
        return y.reshape(shape)


class RMSNorm(nn.Cell):
    """x * (1 / sqrt(mean(x^2) + eps)) * weight, over the last axis (no Rsqrt: ONNX has no mapping).

    Holds the weight; the arithmetic is `self.normalize(x, weight)` (RMSNormFunction)."""

    def __init__(self, hidden_size: int, eps: float, compute_dtype=ms.float32):
        super().__init__()
        self.eps = eps
        self.hidden_size = hidden_size
        self.weight = Parameter(Tensor(np.ones(hidden_size, np.float32)), name="weight")
        self.normalize = RMSNormFunction(hidden_size, eps, compute_dtype)

    def construct(self, x: Tensor) -> Tensor:
        return self.normalize(x, self.weight)


class MaskedSoftmax(nn.Cell):
    """Attention probabilities [N*T, S] of scores [N, T, S] plus an additive mask ([T, S] or [N, T, S]), in fp32
    (cast back to the compute dtype). On 2-D rows: a last-axis reduction (softmax's backward) of a higher-rank
    tensor is ~3.5x slower on CPU. `applies_mask` False: the caller builds the mask (a fused causal softmax,
    model/fused_cells.py, applies it itself)."""

    applies_mask = False

    def __init__(self, compute_dtype=ms.float32):
        super().__init__()
        self.half = compute_dtype != ms.float32
        self.compute_dtype = compute_dtype

    def construct(self, scores: Tensor, mask: Tensor) -> Tensor:
        s = scores.shape[-1]
        if self.half:  # mask and softmax in fp32, probabilities back to the compute dtype
            scores = scores.astype(ms.float32) + mask  # [N, T, S]
            return ops.softmax(scores.reshape(-1, s), -1).astype(self.compute_dtype)
        scores = scores + mask  # [N, T, S]
        return ops.softmax(scores.reshape(-1, s), -1)  # [N*T, S]


class SwiGLU(nn.Cell):
    """silu(gate) * up, with a hand-written backward: ~28% faster forward + backward on CPU than
    autodiff of ops.silu (which expands to Sigmoid, SigmoidGrad and more element-wise passes)."""

    def construct(self, gate: Tensor, up: Tensor) -> Tensor:
        return ops.silu(gate) * up

    def bprop(self, gate, up, out, dout):
        s = ops.sigmoid(gate)
        a = gate * s  # silu(gate)
        # d silu(g) / dg = s + g * s * (1 - s) = s * (1 + g - a)
        return dout * up * (s * (1.0 + gate - a)), dout * a
