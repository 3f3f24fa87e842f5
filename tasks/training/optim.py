"""AdamW with bias correction, global-norm clipping, a learning-rate schedule and non-finite skipping.

Everything that runs per step is a MindSpore Cell so the whole train step
compiles under `mindspore.jit`. The learning rate and step count are tensors fed
in each step (no recompilation); a non-finite loss or gradient norm leaves
parameters and moments untouched (the caller counts the skip).

MindSpore's own `nn.AdamWeightDecay` has no bias correction; this one matches
`torch.optim.AdamW` (decoupled weight decay: p -= lr * (m̂ / (√v̂ + eps) + wd * p)).
"""

from __future__ import annotations

import math

import mindspore as ms
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, decay: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant" or max_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if decay == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))  # cosine


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

    def __init__(self, params: list[Parameter], *, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_clip: float | None, decay_mask: list[bool],
                 sharded: list[bool] | None = None, tp_group: str | None = None, fused: bool = True):
        """`sharded` marks tensor-parallel slices; their squared norms are summed over `tp_group`
        so that clipping uses the global gradient norm of the unsplit model. `fused` (pretrain.fused_kernels):
        on CPU with a compiler, the update is the in-place AdamW op (model/train_kernels.cc ZeroAdamW) (the arithmetic of
        AdamWeightDecay, multi-threaded, the clip factor applied inside: no `grad * coef` temporaries)."""
        super().__init__()
        self.params = ParameterTuple(params)
        self.kernel = None
        if fused and ms.get_context("device_target") == "CPU" and all(p.dtype == ms.float32 for p in params):
            from model.kernels import zero_ops

            k = zero_ops()
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
        if self.tp:  # replicated grads counted once, slices summed over the tensor-parallel ranks
            sq_shard = self.tp_sum(ops.sum(ops.stack([sum_sq(grads[i]) for i in self.shard_idx])))
            sq_rep = ops.sum(ops.stack([sum_sq(grads[i]) for i in self.rep_idx]))
            gnorm = ops.sqrt(sq_rep + sq_shard) / grad_scale
        else:
            sq = ops.stack([sum_sq(g) for g in grads])
            gnorm = ops.sqrt(ops.sum(sq)) / grad_scale  # norm of the unscaled gradient
        finite = ops.isfinite(gnorm)
        coef = clip_coefficient(gnorm, self.clip, grad_scale)
        bc1, sbc2, lr_f, eps_f, b1, b2 = folded_adam_scalars(lr, step, self.beta1, self.beta2, self.eps)
        if self.kernel is not None:  # `apply` 0 (non-finite or refused) writes nothing; no control flow needed
            apply = ops.cast(ops.logical_and(finite, allow), ms.float32)
            for i in range(self.n):
                wd_f = self.wd[i] * bc1 / sbc2
                done = self.kernel(self.params[i], grads[i], self.exp_avg[i], self.exp_avg_sq[i], self.whole,
                                   lr_f, b1, b2, eps_f, wd_f, coef, apply)
                gnorm = ops.depend(gnorm, done)
            return gnorm, finite
        if ops.logical_and(finite, allow):  # a non-finite or refused step leaves parameters and moments untouched
            for i in range(self.n):
                wd_f = self.wd[i] * bc1 / sbc2
                self.adam(self.params[i], self.exp_avg[i], self.exp_avg_sq[i], lr_f, b1, b2, eps_f, wd_f,
                          grads[i] * coef)
        return gnorm, finite


class ShardedAdamW(nn.Cell):
    """ZeRO-1: the AdamW of `AdamW`, with its state split over the `dp` data-parallel ranks.

    The trainable parameters, flattened in order, form one buffer cut into chunks of whole parameters
    (~`chunk_elements` each), every chunk zero-padded to a multiple of `dp`; rank `dp_index` owns the
    `dp_index`-th 1/dp of every chunk (`shard` elements in all, equal on every rank). It keeps the AdamW
    moments of only that share, as one Parameter pair per parameter its share touches (a "segment").
    construct(grads, lr, step, grad_scale, allow) takes the full all-reduced gradients (ZeRO-1: the gradient
    reduction is the unsharded one), computes the global norm from all of them (clipping and the non-finite
    rule see what `AdamW` sees) and updates its share with the same scalars as `AdamW`:

    - in place (`in_place`, CPU with a compiler: model/train_kernels.cc ZeroAdamW, a custom op): per segment one kernel
      reads the full gradient and the full parameter at the segment's offset, applies the clip/unscale
      factor itself and writes the moments and the parameter's owned range in place, with the arithmetic
      of MindSpore's fused `AdamWeightDecay`. No master copy (the parameters are fp32, under fp16 compute
      too), no slice or scaled-gradient temporaries: 8 bytes of state per owned element.
    - otherwise MindSpore's `AdamWeightDecay` on an fp32 master copy of the share (it cannot write into a
      slice of a Parameter), fed `reshape(grad)[a:b] * coef`: 12 bytes per owned element, plus those
      temporaries, which the CPU graph executor keeps for the whole step.

    `rebuild()` (called by `TrainStep` after every applied update) AllGathers the updated shares chunk by
    chunk over the world group (the data-parallel group, since tensor parallel is 1) and writes the full
    parameters back, identical on every rank. It runs one chunk at a time, one small compiled graph per
    chunk: compiled as one graph, or gathered in one piece, its buffers would be ~12 bytes per parameter of
    extra peak memory (measured), more than the sharding saves.
    """

    def __init__(self, params: list[Parameter], *, beta1: float, beta2: float, eps: float,
                 weight_decay: float, grad_clip: float | None, decay_mask: list[bool], dp: int, dp_index: int,
                 chunk_elements: int = 2**20, in_place: bool = True):
        """`in_place=False` forces the master-share path (what runs without a compiler)."""
        super().__init__()
        import numpy as np

        self.params = ParameterTuple(params)
        self.dp, self.dp_index = int(dp), int(dp_index)
        self.shapes = tuple(tuple(int(d) for d in p.shape) for p in params)
        self.sizes = tuple(int(np.prod(s)) if s else 1 for s in self.shapes)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.sizes[:-1]))
        self.numel = int(sum(self.sizes))
        if self.numel < self.dp:
            raise ValueError(f"optimizer_shard: {self.numel} trainable elements cannot be split over {self.dp} ranks")
        # chunks of whole parameters (~chunk_elements each, at least the largest parameter), each padded to a
        # multiple of dp; rank r owns the r-th 1/dp of every chunk. The rebuild gathers one chunk at a time, so its
        # transient buffers are bounded by a chunk, not the model (one chunk: the plain contiguous 1/dp split).
        target = max(max(self.sizes), int(chunk_elements))
        chunks, first, acc = [], 0, 0
        for i, n in enumerate(self.sizes):
            if acc and acc + n > target:
                chunks.append((first, i, acc))
                first, acc = i, 0
            acc += n
        chunks.append((first, len(self.sizes), acc))
        self.chunks = tuple(chunks)
        segs, pads = [], []
        for first, end, numel in chunks:
            piece = -(-numel // self.dp)
            lo, hi = self.dp_index * piece, min(numel, (self.dp_index + 1) * piece)
            covered = 0
            for i in range(first, end):
                o, n = self.offsets[i] - self.offsets[first], self.sizes[i]
                a, b = max(lo, o) - o, min(hi, o + n) - o
                if a < b:
                    segs.append((i, a, b))
                    covered += b - a
            pads.append(piece - covered)
        self.chunk_pads = tuple(pads)
        self.shard = sum(-(-numel // self.dp) for _, _, numel in chunks)
        self.segments = tuple(segs)
        self.pad = sum(pads)
        self.names = tuple(p.name for p in params)

        def state(prefix: str) -> ParameterTuple:  # lazily zero-initialised (no host copy held, as `clone(init=)`)
            from mindspore.common.initializer import initializer

            return ParameterTuple([Parameter(initializer("zeros", (b - a,), ms.float32), name=f"{prefix}.{self.names[i]}",
                                             requires_grad=False) for i, a, b in segs])

        # the in-place kernel: CPU, fp32 parameters (the fp16 path keeps fp32 master Parameters too), a compiler
        self.kernel = None
        if in_place and ms.get_context("device_target") == "CPU" and all(p.dtype == ms.float32 for p in params):
            from model.kernels import zero_ops

            k = zero_ops()
            self.kernel = k.adamw if k is not None else None
        self.in_place = self.kernel is not None
        self.master = ParameterTuple([]) if self.in_place else state("zero_master")
        self.exp_avg, self.exp_avg_sq = state("adam_m"), state("adam_v")
        self.seg_offset = tuple(Tensor(np.array([a], np.int32)) for _, a, _ in segs)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.seg_wd = tuple((weight_decay if decay_mask[i] else 0.0) for i, _, _ in segs)
        self.seg_param = tuple(i for i, _, _ in segs)
        self.seg_a = tuple(a for _, a, _ in segs)
        self.seg_b = tuple(b for _, _, b in segs)
        self.nseg = len(segs)
        self.clip = grad_clip if grad_clip is not None else 0.0
        self.n = len(params)
        self.adam = ops.AdamWeightDecay()
        self.sync_master()

    def construct(self, grads, lr: Tensor, step: Tensor, grad_scale: Tensor, allow: Tensor):
        sq = ops.stack([sum_sq(g) for g in grads])
        gnorm = ops.sqrt(ops.sum(sq)) / grad_scale  # the global norm, from the full gradients (as AdamW)
        finite = ops.isfinite(gnorm)
        coef = clip_coefficient(gnorm, self.clip, grad_scale)
        bc1, sbc2, lr_f, eps_f, b1, b2 = folded_adam_scalars(lr, step, self.beta1, self.beta2, self.eps)
        if self.in_place:
            # no control flow: the kernel writes nothing when `apply` is 0. Its inputs hang on coef, hence on every
            # gradient, so all reads of the old parameters in the step come first; its outputs are kept by depend.
            apply = ops.cast(ops.logical_and(finite, allow), ms.float32)
            for j in range(self.nseg):
                wd_f = self.seg_wd[j] * bc1 / sbc2
                i = self.seg_param[j]
                done = self.kernel(self.params[i], grads[i], self.exp_avg[j], self.exp_avg_sq[j], self.seg_offset[j],
                                   lr_f, b1, b2, eps_f, wd_f, coef, apply)
                gnorm = ops.depend(gnorm, done)
            return gnorm, finite
        if ops.logical_and(finite, allow):
            for j in range(self.nseg):
                wd_f = self.seg_wd[j] * bc1 / sbc2
                g = ops.reshape(grads[self.seg_param[j]], (-1,))[self.seg_a[j]:self.seg_b[j]]
                self.adam(self.master[j], self.exp_avg[j], self.exp_avg_sq[j], lr_f, b1, b2, eps_f, wd_f, g * coef)
        return gnorm, finite

    def rebuild_fn(self):
        """A `() -> Tensor` that AllGathers every rank's updated share and assigns the full parameters.

        One small jit graph per chunk, called one after another: each graph holds one collective (so the
        ranks, whose graphs differ in their segments, cannot order collectives differently) and buffers of one
        chunk (concatenated share, gathered chunk), freed before the next. Eager ops cost ~15 ms each here
        (0.85 s per step on `small`); one graph for all chunks would hold every chunk's buffers at once."""
        from mindspore.communication import GlobalComm

        gather = ops.AllGather(group=GlobalComm.WORLD_COMM_GROUP)
        master, params = self.master, self.params
        offsets, sizes, shapes, segments, in_place = self.offsets, self.sizes, self.shapes, self.segments, self.in_place

        def chunk_fn(first, end, mine, pad):
            base = offsets[first]

            def share(j):  # this rank's updated values of segment j: the parameter's own range, or the master share
                i, a, b = segments[j]
                return ops.reshape(params[i], (-1,))[a:b] if in_place else master[j]

            @ms.jit
            def rebuild_chunk():
                parts = [share(j) for j in mine]
                if pad:
                    parts.append(ops.zeros((pad,), ms.float32))
                flat = gather(ops.concat(parts) if len(parts) > 1 else parts[0] * 1.0)
                out = flat[0:1]
                for i in range(first, end):
                    o = offsets[i] - base
                    out = ops.depend(out, ops.assign(params[i], ops.reshape(flat[o:o + sizes[i]], shapes[i])))
                return out

            return rebuild_chunk

        fns = [chunk_fn(first, end, [j for j, (i, _, _) in enumerate(self.segments) if first <= i < end],
                        self.chunk_pads[c]) for c, (first, end, _) in enumerate(self.chunks)]

        def rebuild():
            out = None
            for fn in fns:
                out = fn()
                out.asnumpy()  # this chunk's gather is complete on this rank before the next is issued
            return out

        return rebuild

    # ---- checkpoint state: flat shards on disk, per-parameter full arrays in between layouts

    def layout(self) -> dict:
        """What state.json's layout records so that any layout can rebuild the full moments."""
        return {"data_parallel": self.dp, "numel": self.numel, "shard_numel": self.shard,
                "chunks": [[end - first, numel] for first, end, numel in self.chunks],
                "params": [[name, list(shape)] for name, shape in zip(self.names, self.shapes)]}

    def shard_state(self) -> dict:
        """This rank's share of the flat moment buffers: {"adam_m": [shard], "adam_v": [shard]} (zero-padded)."""
        import numpy as np

        out = {}
        for key, ps in (("adam_m", self.exp_avg), ("adam_v", self.exp_avg_sq)):
            parts = []
            for c, (first, end, _) in enumerate(self.chunks):
                parts += [ps[j].asnumpy().reshape(-1) for j, (i, _, _) in enumerate(self.segments) if first <= i < end]
                parts.append(np.zeros(self.chunk_pads[c], np.float32))
            out[key] = np.concatenate(parts).astype(np.float32)
        return out

    def load_full(self, opt: dict, what: str) -> None:
        """Cut this rank's share out of full per-parameter moments (`adam_m.<name>`, `adam_v.<name>`)."""
        from tasks.training.checkpoint import CheckpointError

        want = [f"{k}.{n}" for k in ("adam_m", "adam_v") for n in self.names]
        missing = [k for k in want if k not in opt]
        if missing:
            raise CheckpointError(f"{what} lacks optimizer state {missing[:3]}; it belongs to another model")
        for j, (i, a, b) in enumerate(self.segments):
            for key, ps in (("adam_m", self.exp_avg), ("adam_v", self.exp_avg_sq)):
                full = opt[f"{key}.{self.names[i]}"]
                if tuple(full.shape) != self.shapes[i]:
                    raise CheckpointError(f"{what}: {key}.{self.names[i]} has shape {full.shape}, model wants "
                                          f"{self.shapes[i]}")
                ps[j].set_data(Tensor(full.reshape(-1)[a:b].copy()))

    def sync_master(self) -> None:
        """Copy this rank's share of the current parameters into the master share (at construction and after
        loading weights). Host-side on purpose: a compiled graph built before `assign(params, ...)` keeps
        reading the parameters' old values (a resumed run then diverged at its first update). In place: nothing
        to copy (the kernel updates the parameters themselves)."""
        if self.in_place:
            return
        flat = {i: self.params[i].asnumpy().reshape(-1) for i in set(self.seg_param)}
        for j, (i, a, b) in enumerate(self.segments):
            self.master[j].set_data(Tensor(flat[i][a:b].copy()))


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

    def __init__(self, max_abs_weight: float, *, beta1: float, beta2: float, weight_decay: float,
                 limit: float = 1e37):
        self.bound = float(max_abs_weight)
        self.beta1, self.beta2, self.wd, self.limit = beta1, beta2, weight_decay, limit

    @staticmethod
    def max_abs(arrays) -> float:
        """max |w| over numpy arrays (inf when any is non-finite)."""
        import numpy as np

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

    def __init__(self, loss_fn, params: list[Parameter], optimizer: AdamW, accumulation: int = 1,
                 loss_scale: float = 1.0, dp_group: str | None = None, dp: int = 1):
        """`dp_group` (data parallel): gradients and the reported loss are averaged over its `dp` ranks
        (MindSpore's `nn.DistributedGradReducer`) before clipping and the update."""
        self.optimizer = optimizer
        self.k = accumulation
        self.loss_scale = loss_scale
        self.dp = dp if dp_group is not None else 1
        self._count_sum = ops.AllReduce(group=dp_group) if self.dp > 1 else None
        zero = hasattr(optimizer, "rebuild_fn")
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

        self._fused, self._micro, self._apply = fused, micro, apply
        # ZeRO-1 (ShardedAdamW): after an applied update, the ranks' updated shares are gathered into the parameters
        self._rebuild = optimizer.rebuild_fn() if hasattr(optimizer, "rebuild_fn") else None

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
        losses = [float(self._micro(Tensor(ids), Tensor(labels), scale, w).asnumpy())
                  for (ids, labels), w in zip(micro_batches, weights)]
        gnorm, finite, loss = self._apply(lr_t, step_t, Tensor(s * self.k, ms.float32),
                                          Tensor(sum(losses) / len(losses), ms.float32), allow_t)
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
        import numpy as np

        counts = [int(np.count_nonzero(np.asarray(y) != -100)) for y in labels]
        total = sum(counts)
        if self._count_sum is not None:  # the other ranks' tokens (one scalar AllReduce per step)
            # float32 only on CPU: send total // 4096 and total % 4096, both summed exactly (< 2^24)
            hi, lo = self._count_sum(Tensor([total >> 12, total & 4095], ms.float32)).asnumpy()
            total = (int(hi) << 12) + int(lo)
        n = len(counts) * self.dp
        return [c * n / total if total else 0.0 for c in counts]


def causal_lm_loss_fn(net):
    """`loss_fn(input_ids, labels) -> scalar` of a causal LM: what the train step, validation and the
    benchmarks differentiate (pretrain and finetune share it)."""
    from model.llama import causal_lm_loss

    if getattr(net, "fused_kernels", False):  # the fused cross-entropy (model/llama.py LlamaForCausalLM.loss)
        def fused_loss_fn(ids, labels):
            return net.loss(ids, labels)

        return fused_loss_fn

    def loss_fn(ids, labels):  # a def, not a lambda: MindSpore's jit parser needs it on its own line
        return causal_lm_loss(net(ids), labels)

    return loss_fn


def causal_lm_train_step(net, params: list[Parameter], *, weight_decay: float = 0.1, grad_clip: float | None = 1.0,
                         beta1: float = 0.9, beta2: float = 0.95, eps: float = 1e-8, accumulation: int = 1,
                         mesh=None, fused: bool = True) -> TrainStep:
    """A compiled next-token train step for `net` over `params` with AdamW (norms/embeddings not decayed).

    What the benchmarks, the memory measurement and the optimizer tests use; the trainer builds
    the same pieces from its LoopConfig. With a `mesh` (tasks/runtime/distributed.py) the step averages
    gradients over its data-parallel group and clips by the norm over its tensor-parallel slices.
    `fused=False` keeps the optimizer on MindSpore's own kernels, as pretrain.fused_kernels: false does
    (the model's fused ops are the model's: LlamaForCausalLM(fused_kernels=...)).
    """

    sharded, tp_group, dp_group, dp = None, None, None, 1
    if mesh is not None:
        sharded, tp_group, dp_group, dp = mesh.sharded(params), mesh.tp_group, mesh.dp_group, mesh.dp
    mask = [decays(p.name, decay_norms_and_biases=False, decay_embeddings=False) for p in params]
    if mesh is not None and getattr(mesh, "zero", False):
        opt = ShardedAdamW(params, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip,
                           decay_mask=mask, dp=mesh.dp, dp_index=mesh.dp_index, in_place=fused)
    else:
        opt = AdamW(params, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, grad_clip=grad_clip,
                    decay_mask=mask, sharded=sharded, tp_group=tp_group, fused=fused)

    return TrainStep(causal_lm_loss_fn(net), params, opt, accumulation=accumulation, dp_group=dp_group, dp=dp)
