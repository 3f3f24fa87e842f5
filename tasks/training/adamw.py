"""AdamW with bias correction and global-norm clipping, as a MindSpore Cell; the guard that refuses an
update that could overflow the weights.

MindSpore's own `nn.AdamWeightDecay` has no bias correction; this one matches `torch.optim.AdamW`
(decoupled weight decay: p -= lr * (m̂ / (√v̂ + eps) + wd * p)). The update runs inside the compiled train
step (tasks/training/step.py); a non-finite gradient norm leaves parameters and moments untouched.
ZeRO-1's sharded variant is in zero.py.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model.kernel_ops import zero_ops


def decays(name: str, *, decay_norms_and_biases: bool, decay_embeddings: bool) -> bool:
    """Whether weight decay applies to a parameter, by its name."""
    lname = name.lower()
    if "norm" in lname or lname.endswith("bias"):
        return decay_norms_and_biases
    if "embed" in lname:
        return decay_embeddings
    return True


def sum_sq(g: Tensor) -> Tensor:
    """Σ g² of one gradient: over its rows first, then the row sums. A full reduction of a large tensor
    to a scalar is ~4x slower on MindSpore's CPU kernels ([8192, 256]: 7.4 vs 1.7 ms)."""
    sq = ops.square(g)
    if sq.ndim >= 2:
        return ops.sum(ops.sum(sq.reshape(-1, sq.shape[-1]), -1))
    return ops.sum(sq)


def clip_coefficient(gnorm: Tensor, clip: float, grad_scale: Tensor) -> Tensor:
    """The one factor each gradient is multiplied by: global-norm clipping (clip > 0) and the unscale by
    grad_scale together (AdamW and ShardedAdamW share it, inside their compiled step)."""
    coef = ops.ones((), ms.float32)
    if clip > 0:
        coef = ops.minimum(coef, clip / (gnorm + 1e-6))
    return coef / grad_scale


def folded_adam_scalars(lr: Tensor, step: Tensor, beta1: float, beta2: float, eps: float):
    """torch's AdamW bias correction folded into the fused kernel's scalar inputs (exact algebra):

    torch: p -= lr*wd*p; p -= lr * (m/bc1) / (sqrt(v/bc2) + eps)
         = p - lr' * (m / (sqrt(v) + eps') + wd' * p)  with
    lr' = lr*sqrt(bc2)/bc1, eps' = eps*sqrt(bc2), wd' = wd*bc1/sqrt(bc2) (the caller forms wd' per parameter).
    Returns (bc1, sqrt(bc2), lr', eps', beta1, beta2) as tensors.
    """
    bc1 = 1.0 - ops.pow(beta1, step)
    sbc2 = ops.sqrt(1.0 - ops.pow(beta2, step))
    lr_f = lr * sbc2 / bc1
    eps_f = eps * sbc2
    b1 = ops.ones((), ms.float32) * beta1
    b2 = ops.ones((), ms.float32) * beta2
    return bc1, sbc2, lr_f, eps_f, b1, b2


class AdamW(nn.Cell):
    """In-graph AdamW over `params`; construct(grads, lr, step, grad_scale) -> (grad_norm, finite).

    `grad_scale` divides the gradients first (gradient accumulation count × loss scale).
    Uses MindSpore's fused in-place `AdamWeightDecay` kernel per parameter, with torch's
    bias correction folded into its scalar inputs (exact algebra, see `_fold`): an
    update written as separate element-wise ops costs ~200 bytes of resident memory per
    parameter on the CPU graph executor (each intermediate keeps its own buffer).
    """

    def __init__(
        self,
        params: list[Parameter],
        *,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip: float | None,
        decay_mask: list[bool],
        sharded: list[bool] | None = None,
        tp_group: str | None = None,
        in_place: bool = True,
    ):
        """`sharded` marks tensor-parallel slices; their squared norms are summed over `tp_group`
        so that clipping uses the global gradient norm of the unsplit model. `in_place` (the build's kernel decision,
        tasks/modeling/build.py `Kernels.optimizer`): where the kernel library builds, the update is the in-place
        AdamW op (model/train_kernels.cc ZeroAdamW) (the arithmetic of AdamWeightDecay, multi-threaded, the clip
        factor applied inside: no `grad * coef` temporaries)."""
        super().__init__()
        self.params = ParameterTuple(params)
        k = zero_ops() if in_place else None
        self.kernel = k.adamw if k is not None else None
        self.whole = Tensor([0], ms.int32)  # the kernel's offset: whole parameters
        self.exp_avg = self.params.clone(prefix="adam_m", init="zeros")
        self.exp_avg_sq = self.params.clone(prefix="adam_v", init="zeros")
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.wd = tuple(weight_decay if d else 0.0 for d in decay_mask)
        self.clip = grad_clip if grad_clip is not None else 0.0
        self.n = len(params)
        self.adam = ops.AdamWeightDecay()
        self.tp = tp_group is not None and sharded is not None and any(sharded)
        if self.tp:
            self.rep_idx = tuple(i for i, s in enumerate(sharded) if not s)
            self.shard_idx = tuple(i for i, s in enumerate(sharded) if s)
            self.tp_sum = ops.AllReduce(group=tp_group)

    def construct(self, grads, lr: Tensor, step: Tensor, grad_scale: Tensor, allow: Tensor):
        """`allow` (bool): False skips the update whatever the gradients (see `UpdateGuard`)."""
        return self.update(grads, self.global_norm(grads, grad_scale), lr, step, grad_scale, allow)

    def global_norm(self, grads, grad_scale: Tensor) -> Tensor:
        """The norm of the unscaled gradient (the whole model's, over the tensor-parallel slices)."""
        if self.tp:  # replicated grads counted once, slices summed over the tensor-parallel ranks
            sq_shard = self.tp_sum(ops.sum(ops.stack([sum_sq(grads[i]) for i in self.shard_idx])))
            sq_rep = ops.sum(ops.stack([sum_sq(grads[i]) for i in self.rep_idx]))
            return ops.sqrt(sq_rep + sq_shard) / grad_scale
        sq = ops.stack([sum_sq(g) for g in grads])
        return ops.sqrt(ops.sum(sq)) / grad_scale

    def update(self, grads, gnorm: Tensor, lr: Tensor, step: Tensor, grad_scale: Tensor, allow: Tensor):
        """The update given the gradient norm `gnorm` (of the unscaled gradient; non-finite: nothing changes);
        returns (gnorm, finite). The layer-at-a-time step computes the norm outside the graph: in here each
        gradient's squares would be a buffer the size of the model that the graph keeps (docs/MEMORY.md)."""
        finite = ops.isfinite(gnorm)
        coef = clip_coefficient(gnorm, self.clip, grad_scale)
        bc1, sbc2, lr_f, eps_f, b1, b2 = folded_adam_scalars(lr, step, self.beta1, self.beta2, self.eps)
        if self.kernel is not None:  # `apply` 0 (non-finite or refused) writes nothing; no control flow needed
            apply = ops.cast(ops.logical_and(finite, allow), ms.float32)
            for i in range(self.n):
                wd_f = self.wd[i] * bc1 / sbc2
                done = self.kernel(
                    self.params[i],
                    grads[i],
                    self.exp_avg[i],
                    self.exp_avg_sq[i],
                    self.whole,
                    lr_f,
                    b1,
                    b2,
                    eps_f,
                    wd_f,
                    coef,
                    apply,
                )
                gnorm = ops.depend(gnorm, done)
            return gnorm, finite
        if ops.logical_and(finite, allow):  # a non-finite or refused step leaves parameters and moments untouched
            for i in range(self.n):
                wd_f = self.wd[i] * bc1 / sbc2
                self.adam(
                    self.params[i], self.exp_avg[i], self.exp_avg_sq[i], lr_f, b1, b2, eps_f, wd_f, grads[i] * coef
                )
        return gnorm, finite


class UpdateGuard:
    """Refuses, before it is applied, any AdamW update that could make a weight non-finite.

    With finite gradients, moments and weights, an update can only produce Inf/NaN by float32
    overflow. This bounds the largest weight after the update without reading the weights:
    AdamW computes p' = p·(1 − lr·wd) − lr'·m/(√v + eps'), with lr' = lr·√(1−β2^t)/(1−β1^t), and
    since m and v are moving averages of the same gradients starting at zero, Cauchy–Schwarz gives
    |m|/√v ≤ K_t = (1−β1)/√(1−β2) · √(Σ_{k<t} (β1²/β2)^k). So
    max|p'| ≤ P·max(1, |1 − lr·wd|) + lr'·K_t, where P bounds max|p| (measured exactly at the
    start of a process, then carried by this same recurrence). An update whose bound reaches
    `limit` (1e37, ~34× below float32's largest value) is refused (`TrainStep(..., allow=False)`)
    and counted as a non-finite step; the weights and moments stay as they were. The check is host
    arithmetic on scalars, so it costs nothing per step. With sane learning rates the bound stays
    tiny (lr 3e-4 for 10^6 steps adds < 10^3); it trips for learning rates around 1e36 and above,
    or a weight decay that makes |1 − lr·wd| > 1 and the weights grow geometrically.
    """

    def __init__(self, max_abs_weight: float, *, beta1: float, beta2: float, weight_decay: float, limit: float = 1e37):
        self.bound = float(max_abs_weight)
        self.beta1, self.beta2, self.wd, self.limit = beta1, beta2, weight_decay, limit

    @staticmethod
    def max_abs(arrays) -> float:
        """max |w| over numpy arrays (inf when any is non-finite)."""
        m = 0.0
        for a in arrays:
            if a.size:
                m = max(m, float(np.max(np.abs(a))))
        return m

    def _next_bound(self, lr: float, step: int) -> float:
        b1, b2 = self.beta1, self.beta2
        r = b1 * b1 / b2
        series = float(step) if abs(r - 1.0) < 1e-12 else (1.0 - r**step) / (1.0 - r)
        k = (1.0 - b1) / math.sqrt(1.0 - b2) * math.sqrt(series)
        lr_f = lr * math.sqrt(1.0 - b2**step) / (1.0 - b1**step)
        try:
            return self.bound * max(1.0, abs(1.0 - lr * self.wd)) + lr_f * k
        except OverflowError:
            return math.inf

    def allows(self, lr: float, step: int) -> bool:
        """Whether the update of optimizer step `step` (1-based) at `lr` is safe to apply."""
        nxt = self._next_bound(lr, step)
        return math.isfinite(nxt) and nxt < self.limit

    def applied(self, lr: float, step: int) -> None:
        """Carry the bound over an update that was applied."""
        self.bound = self._next_bound(lr, step)
