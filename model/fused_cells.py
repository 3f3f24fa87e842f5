"""The cells that run the native training kernels (model/train_kernels.cc through model/kernel_ops.py), each with
the signature of the plain cell it replaces in model/layers.py / model/llama.py. The model never builds them: the
build's convert step (tasks/modeling/build.py `convert`) swaps them in when the one kernel decision says so.

    | plain (model/)                 | fused (here)          |
    |--------------------------------|-----------------------|
    | RMSNorm.normalize (x, weight)  | FusedRMSNorm          |
    | Attention.softmax (scores, m)  | FusedCausalSoftmax    |
    | Attention.fused (q, k, v)      | FusedCausalAttention  |
    | MLP.swiglu (gate, up)          | FusedSwiGLU           |
    | LlamaForCausalLM.loss_fn       | FusedCausalLMLoss     |
    | the LM head's MatMul (x, W)    | FusedHeadMatMul (where MatMul runs oneDNN's AVX2 path) |

Forward and backward are one fused kernel each; the math matches MindSpore's own ops to ~1e-6.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn, ops


class FusedRMSNorm(nn.Cell):
    """RMSNorm forward and backward as one fused kernel each (model/train_kernels.cc); the backward
    recomputes 1/rms from x (one pass) rather than keeping it.

    The kernel cell gets the weight's value, not the Parameter: a custom `bprop` handed a Parameter reads it as it
    was when the graph started, not after an `assign` earlier in the same graph (MindSpore 2.10; the
    layer-at-a-time train step assigns each layer's weights into one layer copy inside its graph,
    tasks/training/layerwise.py, and its norm gradients were the previous layer's; docs/MINDSPORE_CPU.md)."""

    def __init__(self, kernels, eps: float):
        super().__init__()
        self.kernel = _RMSNormKernel(kernels, eps)

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.kernel(x, weight * 1.0)  # a value: [H], nothing to speak of


class _RMSNormKernel(nn.Cell):
    """The two RMSNorm kernels with their bprop, over (x, the weight's value)."""

    def __init__(self, kernels, eps: float):
        super().__init__()
        self.forward_op, self.backward_op = kernels.rms_norm, kernels.rms_norm_grad
        self.eps = Tensor(np.array([eps], np.float32))

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.forward_op(x, weight, self.eps)

    def bprop(self, x, weight, out, dout):
        return self.backward_op(x, weight, self.eps, dout)


class FusedCausalSoftmax(nn.Cell):
    """softmax(scores + causal mask) over the last axis of [N, T, S] (queries at the last T of S keys; `mask` is unused:
    the kernel applies the causal mask itself), forward
    and backward each one fused kernel (model/train_kernels.cc): 2-3x MindSpore's mask add + Softmax and
    its expanded backward (Mul, ReduceSum, Sub, Mul) on CPU. Masked keys get probability exactly 0."""

    applies_mask = True

    def __init__(self, kernels):
        super().__init__()
        self.forward_op, self.backward_op = kernels.causal_softmax, kernels.softmax_grad

    def construct(self, scores: Tensor, mask: Tensor) -> Tensor:
        return self.forward_op(scores)

    def bprop(self, scores, mask, out, dout):
        return self.backward_op(out, dout), ops.zeros_like(mask)


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


class FusedSwiGLU(nn.Cell):
    """silu(gate) * up, forward and backward one fused kernel each (~2x and ~3.5x faster than layers.SwiGLU)."""

    def __init__(self, kernels):
        super().__init__()
        self.forward_op, self.backward_op = kernels.swiglu, kernels.swiglu_grad

    def construct(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.forward_op(gate, up)

    def bprop(self, gate, up, out, dout):
        return self.backward_op(gate, up, dout)


class FusedCausalLMLoss(nn.Cell):
    """Mean next-token cross-entropy of logits [B, T, V] against labels [B, T] (-100 = ignored) through
    FusedCrossEntropy: the [N, V] log-probabilities are never kept."""

    def __init__(self, kernels):
        super().__init__()
        self.cross_entropy = FusedCrossEntropy(kernels)

    def construct(self, logits: Tensor, labels: Tensor) -> Tensor:
        labels = labels.reshape(-1).astype(ms.int32)
        nll, _ = self.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels)
        count = (labels != -100).astype(ms.float32).sum()
        return nll.sum() / ops.maximum(count, 1.0)


class FusedHeadMatMul(nn.Cell):
    """The LM head's logits x [N, H] · W [V, H]ᵀ (MindSpore's MatMul), with a backward whose weight gradient is
    dlogitsᵀ · x on the transposed dlogits (the Transpose kernel), a plain MatMul: the gradient MindSpore derives,
    MatMul(transpose_a)(dlogits, x), runs on oneDNN's AVX2 path at about half speed at [N, V] = [2048, 8192]
    (docs/MINDSPORE_CPU.md). dx = dlogits · W as before. Swapped in only where MatMul runs that path
    (tasks/modeling/build.py `convert`): with AVX-512 the transposed-A product is as fast as the plain one and the
    transpose (~10 ms and N·V floats at [2048, 8192]) would cost more than it saves. The weight arrives as a value
    the graph does not assign before the head (the whole-model step; the layer-at-a-time head takes only the
    transpose, tasks/training/layer_grad.py)."""

    def __init__(self, kernels):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.plain = ops.MatMul()
        self.transpose = kernels.transpose

    def construct(self, x: Tensor, weight: Tensor) -> Tensor:
        return self.matmul(x, weight)

    def bprop(self, x, weight, out, dout):
        return self.plain(dout, weight), self.plain(self.transpose(dout), x)


class FusedCausalAttention(nn.Cell):
    """Causal GQA attention of scaled q [B, nh, T, hd] over k, v [B, nkv, S, hd] (queries the last T of S), returning
    (out [B, nh, T, hd], the rows' log-sum-exp [B, nh, T]); forward and backward one kernel each
    (model/train_kernels.cc CausalAttention): the scores, probabilities and their gradients live in a 64-query block
    of the kernel's, never as [B·nh, T, S] tensors, and only keys up to each block's last query are computed. The
    backward recomputes the probabilities from q, k and the log-sum-exp. The log-sum-exp is for the backward only:
    its own gradient (dout[1]) is not propagated, so nothing downstream may depend on it."""

    def __init__(self, kernels):
        super().__init__()
        self.forward_op, self.backward_op = kernels.causal_attention, kernels.causal_attention_grad

    def construct(self, q: Tensor, k: Tensor, v: Tensor):
        return self.forward_op(q, k, v)

    def bprop(self, q, k, v, out, dout):
        return self.backward_op(q, k, v, out[0], out[1], dout[0])
