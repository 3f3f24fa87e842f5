"""ZeRO-1: AdamW with its state split over the data-parallel ranks (`ShardedAdamW`).

Same arithmetic as tasks/training/adamw.py `AdamW`; applied to a model and optimizer by
tasks/modeling/parallelize.py when parallel.optimizer_shard is set.
"""

from __future__ import annotations

import mindspore as ms
import numpy as np
from mindspore import Parameter, ParameterTuple, Tensor, nn, ops
from mindspore.common.initializer import initializer
from mindspore.communication import GlobalComm

from model.kernel_ops import zero_ops
from tasks.store.tensors import CheckpointError
from tasks.training.adamw import clip_coefficient, folded_adam_scalars, sum_sq


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
        dp: int,
        dp_index: int,
        chunk_elements: int = 2**20,
        in_place: bool = True,
    ):
        """`in_place=False` forces the master-share path (what runs without a compiler)."""
        super().__init__()
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
            return ParameterTuple(
                [
                    Parameter(
                        initializer("zeros", (b - a,), ms.float32),
                        name=f"{prefix}.{self.names[i]}",
                        requires_grad=False,
                    )
                    for i, a, b in segs
                ]
            )

        # the in-place kernel (the build's decision, `in_place`) where the kernel library builds
        k = zero_ops() if in_place else None
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
                done = self.kernel(
                    self.params[i],
                    grads[i],
                    self.exp_avg[j],
                    self.exp_avg_sq[j],
                    self.seg_offset[j],
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
        if ops.logical_and(finite, allow):
            for j in range(self.nseg):
                wd_f = self.seg_wd[j] * bc1 / sbc2
                g = ops.reshape(grads[self.seg_param[j]], (-1,))[self.seg_a[j] : self.seg_b[j]]
                self.adam(self.master[j], self.exp_avg[j], self.exp_avg_sq[j], lr_f, b1, b2, eps_f, wd_f, g * coef)
        return gnorm, finite

    def rebuild_fn(self):
        """A `() -> Tensor` that AllGathers every rank's updated share and assigns the full parameters.

        One small jit graph per chunk, called one after another: each graph holds one collective (so the
        ranks, whose graphs differ in their segments, cannot order collectives differently) and buffers of one
        chunk (concatenated share, gathered chunk), freed before the next. Eager ops cost ~15 ms each here
        (0.85 s per step on `small`); one graph for all chunks would hold every chunk's buffers at once."""
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
                    out = ops.depend(out, ops.assign(params[i], ops.reshape(flat[o : o + sizes[i]], shapes[i])))
                return out

            return rebuild_chunk

        fns = [
            chunk_fn(
                first, end, [j for j, (i, _, _) in enumerate(self.segments) if first <= i < end], self.chunk_pads[c]
            )
            for c, (first, end, _) in enumerate(self.chunks)
        ]

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
        return {
            "data_parallel": self.dp,
            "numel": self.numel,
            "shard_numel": self.shard,
            "chunks": [[end - first, numel] for first, end, numel in self.chunks],
            "params": [[name, list(shape)] for name, shape in zip(self.names, self.shapes)],
        }

    def shard_state(self) -> dict:
        """This rank's share of the flat moment buffers: {"adam_m": [shard], "adam_v": [shard]} (zero-padded)."""
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
        want = [f"{k}.{n}" for k in ("adam_m", "adam_v") for n in self.names]
        missing = [k for k in want if k not in opt]
        if missing:
            raise CheckpointError(f"{what} lacks optimizer state {missing[:3]}; it belongs to another model")
        for j, (i, a, b) in enumerate(self.segments):
            for key, ps in (("adam_m", self.exp_avg), ("adam_v", self.exp_avg_sq)):
                full = opt[f"{key}.{self.names[i]}"]
                if tuple(full.shape) != self.shapes[i]:
                    raise CheckpointError(
                        f"{what}: {key}.{self.names[i]} has shape {full.shape}, model wants {self.shapes[i]}"
                    )
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
