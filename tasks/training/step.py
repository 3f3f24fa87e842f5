"""The compiled train step (forward, loss, value_and_grad, accumulate, reduce, clip, AdamW) and the fp16
loss scale.

Everything that runs per step is compiled under `mindspore.jit`; the learning rate, step count and loss
scale are tensors fed in each step (no recompilation). This is the whole-model step (`train.layerwise: false`, and
where the layer-at-a-time step does not apply); the default on CPU runs the same step one decoder layer at a time
(tasks/training/layerwise.py `LayerwiseTrainStep`, built on this one: less memory, 0.8-1.0x the speed); `train_step`
there picks between them and `causal_lm_train_step` builds either for the benchmarks and tests.
"""

from __future__ import annotations

import math

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops

from model.runtime import trim_after_first_call
from tasks.training.adamw import AdamW


class DynamicLossScale:
    """fp16 loss scale S: halves on an overflowed (non-finite gradient) step, doubles after `window` good ones.

    Host-side state (S is fed to the compiled step as a Tensor each step, so changing it never
    recompiles). `dynamic=False` keeps S fixed (fp32 training: S = 1). S never drops below
    `floor`; a non-finite step at the floor is a genuine fault, not an overflow (see `update`).
    """

    def __init__(self, scale: float = 1.0, *, window: int = 1000, dynamic: bool = False, floor: float = 1.0):
        self.scale, self.window, self.dynamic, self.floor = float(scale), int(window), dynamic, float(floor)
        self.good_steps = 0  # consecutive finite steps since the last change of S

    def update(self, grads_finite: bool) -> bool:
        """Record a step's outcome; True when it was a loss-scale overflow (S halved, not a fault)."""
        if not self.dynamic:
            return False
        if grads_finite:
            self.good_steps += 1
            if self.good_steps >= self.window:
                self.scale *= 2.0
                self.good_steps = 0
            return False
        self.good_steps = 0
        if self.scale > self.floor:
            self.scale = max(self.floor, self.scale / 2.0)
            return True
        return False

    def state_dict(self) -> dict:
        return {"loss_scale": self.scale, "loss_scale_good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        if "loss_scale" in state:
            self.scale = float(state["loss_scale"])
            self.good_steps = int(state.get("loss_scale_good_steps", 0))


class TrainStep:
    """The compiled step: forward, loss, value_and_grad, (accumulate,) clip, AdamW.

    `loss_fn(*batch) -> scalar` closes over the network. With accumulation k > 1,
    `micro(*batch)` adds gradients into buffers and `apply(lr, step)` updates
    with their mean; with k == 1 `step(*batch, lr, step)` does both in one graph.
    The loss scale S is a runtime Tensor input (the loss is multiplied by it and the
    gradients divided back), so a dynamic scale never recompiles the graph.

    The step's loss is the mean over every counted token (labels != -100) of all k micro-batches
    on all data-parallel ranks, as one process with the whole global batch computes it: each
    micro-batch's mean loss is weighted by its share of the tokens (w = tokens · k · dp / total)
    before the gradients are averaged. With equal token counts (packed pretraining blocks) w is
    exactly 1; with response-only fine-tuning masks it keeps accumulation and data parallelism
    from over-weighting short micro-batches.
    """

    def __init__(
        self,
        loss_fn,
        params: list[Parameter],
        optimizer: AdamW,
        accumulation: int = 1,
        loss_scale: float = 1.0,
        dp_group: str | None = None,
        dp: int = 1,
    ):
        """`dp_group` (data parallel): gradients and the reported loss are averaged over its `dp` ranks
        (MindSpore's `nn.DistributedGradReducer`) before clipping and the update."""
        self.optimizer = optimizer
        self.k = accumulation
        self.loss_scale = loss_scale
        self.dp = dp if dp_group is not None else 1
        self._count_sum = ops.AllReduce(group=dp_group) if self.dp > 1 else None
        zero = hasattr(optimizer, "rebuild_fn")
        self._compile(loss_fn, params, optimizer, accumulation, zero, *_reducers(params, dp_group, dp, zero))
        # ZeRO-1 (ShardedAdamW): after an applied update, the ranks' updated shares are gathered into the parameters
        self._rebuild = optimizer.rebuild_fn() if hasattr(optimizer, "rebuild_fn") else None

    def _compile(
        self,
        loss_fn,
        params: list[Parameter],
        optimizer: AdamW,
        accumulation: int,
        zero: bool,
        reduce_grads,
        reduce_loss,
    ) -> None:
        """The compiled graphs: `_fused` (k == 1: the whole step), or `_micro` (accumulate) and `_apply` (update)."""

        def scaled_loss(input_ids, labels, scale, weight):
            loss = loss_fn(input_ids, labels) * weight
            return loss * scale, loss

        grad_fn = ms.value_and_grad(scaled_loss, None, weights=params, has_aux=True)
        self.accum = ParameterTuple(params).clone(prefix="grad_accum", init="zeros") if accumulation > 1 else None
        accum = self.accum

        @ms.jit
        def fused(input_ids, labels, lr, step, grad_scale, weight, allow):
            (_, loss), grads = grad_fn(input_ids, labels, grad_scale, weight)
            gnorm, finite = optimizer(reduce_grads(grads), lr, step, grad_scale, allow)
            if zero:  # after the gradients' collectives on every rank (see reduce_grads)
                loss = ops.depend(loss, gnorm)
            return reduce_loss(loss), gnorm, finite

        @ms.jit
        def micro(input_ids, labels, scale, weight):
            (_, loss), grads = grad_fn(input_ids, labels, scale, weight)
            for a, g in zip(accum, grads):
                ops.assign_add(a, g)
            return loss

        @ms.jit
        def apply(lr, step, grad_scale, loss, allow):
            grads = reduce_grads(tuple(a * 1.0 for a in accum))
            gnorm, finite = optimizer(grads, lr, step, grad_scale, allow)
            for a in accum:
                ops.assign(a, ops.zeros_like(a))
            if zero:
                loss = ops.depend(loss, gnorm)
            return gnorm, finite, reduce_loss(loss)

        # each graph's first call compiles it: the compilation's freed heap goes back before anything else compiles
        self._fused, self._micro, self._apply = (trim_after_first_call(g) for g in (fused, micro, apply))

    def __call__(self, micro_batches, lr: float, step: int, loss_scale: float | None = None, allow: bool = True):
        """micro_batches: list of k (input_ids, labels) numpy pairs. Returns (loss, grad_norm, finite).

        `loss_scale` overrides `self.loss_scale` for this step (the dynamic fp16 scale); `allow=False`
        computes loss and gradient norm but applies no update (`UpdateGuard` refused it).
        """
        allow_t = Tensor(bool(allow), ms.bool_)
        lr_t = Tensor(lr, ms.float32)
        step_t = Tensor(float(step), ms.float32)
        s = self.loss_scale if loss_scale is None else loss_scale
        scale = Tensor(s, ms.float32)
        weights = [Tensor(w, ms.float32) for w in self.token_weights([labels for _, labels in micro_batches])]
        if self.k == 1:
            ids, labels = micro_batches[0]
            loss, gnorm, finite = self._fused(Tensor(ids), Tensor(labels), lr_t, step_t, scale, weights[0], allow_t)
            finite = bool(finite.asnumpy())
            self._rebuild_if(finite and allow)
            return float(loss.asnumpy()), float(gnorm.asnumpy()), finite
        losses = [
            float(self._micro(Tensor(ids), Tensor(labels), scale, w).asnumpy())
            for (ids, labels), w in zip(micro_batches, weights)
        ]
        gnorm, finite, loss = self._apply(
            lr_t, step_t, Tensor(s * self.k, ms.float32), Tensor(sum(losses) / len(losses), ms.float32), allow_t
        )
        loss = float(loss.asnumpy())
        finite = bool(finite.asnumpy())
        self._rebuild_if(finite and allow)
        return loss, float(gnorm.asnumpy()), finite and math.isfinite(loss)

    def _rebuild_if(self, applied: bool) -> None:
        """ZeRO-1: gather the updated shares when the optimizer applied its update (the same host-side decision
        on every rank: the gradient norm is computed from the all-reduced gradients, `allow` from equal weights)."""
        if self._rebuild is not None and applied:
            self._rebuild().asnumpy()

    def token_weights(self, labels: list) -> list[float]:
        """Each micro-batch's weight: its counted tokens × k × dp / the step's total over all ranks."""
        counts = [int(np.count_nonzero(np.asarray(y) != -100)) for y in labels]
        total = sum(counts)
        if self._count_sum is not None:  # the other ranks' tokens (one scalar AllReduce per step)
            # float32 only on CPU: send total // 4096 and total % 4096, both summed exactly (< 2^24)
            hi, lo = self._count_sum(Tensor([total >> 12, total & 4095], ms.float32)).asnumpy()
            total = (int(hi) << 12) + int(lo)
        n = len(counts) * self.dp
        return [c * n / total if total else 0.0 for c in counts]


def _reducers(params: list[Parameter], dp_group: str | None, dp: int, zero: bool):
    """(reduce_grads, reduce_loss) over the data-parallel group: chained AllReduces under ZeRO-1, MindSpore's
    reducer otherwise, nothing on one rank."""
    if dp_group is not None and dp > 1 and zero:
        # ZeRO-1: the ranks' graphs differ (each updates its own share), so the runtime may order independent
        # collectives differently on each rank, and a ring AllReduce of one gradient then meets another
        # rank's AllReduce of a different one ("Memcpy error ... dest size ... src size"). Chained by
        # data dependencies, every rank issues them in the same order; the arithmetic is the reducer's
        # (sum, then × 1/dp).
        grad_sum = ops.AllReduce(group=dp_group)
        loss_sum = ops.AllReduce(group=dp_group)
        inv_dp = 1.0 / dp
        inv_t = Tensor(inv_dp, ms.float32)

        def reduce_grads(grads):  # last parameter first: the order in which backward produces the gradients
            out, prev = [], None
            for g in grads[::-1]:
                r = grad_sum(g if prev is None else ops.depend(g, prev))
                prev = r
                out.append(ops.tensor_mul(r, inv_t))
            return tuple(out[::-1])

        def reduce_loss(loss):
            return loss_sum(loss) * inv_dp
    elif dp_group is not None and dp > 1:
        reducer = nn.DistributedGradReducer(params, mean=True, degree=dp, group=dp_group)
        loss_sum = ops.AllReduce(group=dp_group)
        inv_dp = 1.0 / dp

        def reduce_grads(grads):
            return reducer(grads)

        def reduce_loss(loss):
            return loss_sum(loss) * inv_dp
    else:

        def reduce_grads(grads):
            return grads

        def reduce_loss(loss):
            return loss

    return reduce_grads, reduce_loss


def causal_lm_loss_fn(net):
    """`loss_fn(input_ids, labels) -> scalar` of a causal LM: what the train step, validation and the
    benchmarks differentiate (pretrain and finetune share it)."""

    def loss_fn(ids, labels):  # a def, not a lambda: MindSpore's jit parser needs it on its own line
        return net.loss(ids, labels)  # the model's loss_fn cell: fused cross-entropy where the build swapped it in

    return loss_fn


def validation_fn(step_fn, loss_fn):
    """What the trainer's validation loss runs: the layer-at-a-time step's own `eval_loss` (no whole-model graph
    kept), else `loss_fn` compiled, with the heap its compilation freed handed back after its first call
    (`model.runtime.trim_after_first_call`)."""
    return getattr(step_fn, "eval_loss", None) or trim_after_first_call(ms.jit(loss_fn))
