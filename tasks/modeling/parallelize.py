"""Parallelism applied from outside the model, in one place (torchtitan's `parallelize`), from a `Mesh`
(tasks/runtime/mesh.py: dp × tp ranks, optimizer_shard):

    parallelize(net, mesh)                                  # tensor parallel: TP_PLAN slices, copy/reduce per block
    optimizer = parallelize_optimizer(params, train, mesh, in_place=kernels.optimizer)  # tasks/training/optimizer.py
    step = TrainStep(loss_fn, params, optimizer, dp_group=mesh.dp_group, dp=mesh.dp)   # DP gradient reduction

The network's split lives here, beside the build (tasks/modeling/build.py), so that inference (eval, serving,
export) builds its network without the training room; the optimizer's (AdamW over the slices, ZeRO-1) is
tasks/training/optimizer.py.

- tensor parallel (Megatron-style, on MindSpore's collectives: CPU, GPU and Ascend): `TP_PLAN` names, by
  projection, how each weight is split. Column-parallel q/k/v and gate/up keep whole heads / hidden units per rank
  (rows of the [out, in] weight); row-parallel o_proj and down_proj split their input columns. Embedding, norms
  and the LM head stay replicated. Each attention and MLP block is wrapped in `TensorParallelBlock`: `CopyToTP`
  on its input (identity forward, AllReduce of the gradient backward: each rank's slice contributes part of
  d(input)) and `ReduceFromTP` on its output (AllReduce of the partial sums forward, identity backward: the
  custom bprop, as MindSpore's default AllReduce bprop would all-reduce the gradient again and multiply it by
  the group size). Only AllReduce(sum) is used: the collective MindSpore's CPU backend supports.
- data parallel: the gradient reduction over `mesh.dp_group` (TrainStep, MindSpore's DistributedGradReducer; under
  ZeRO-1 chained AllReduces in backward order);
- ZeRO-1 (`parallel.optimizer_shard`, dp > 1, tp == 1): ShardedAdamW keeps 1/dp of the moments per rank and
  gathers the updated shares after each applied update (tasks/training/zero.py).

Parameter names stay those of the unsplit model; `split_axis(name)` says which axis a parameter (or its AdamW
moment) is split along, which is what checkpoints reshard by (`shard` / `unshard`).
"""

from __future__ import annotations

import numpy as np
from mindspore import Tensor, nn, ops

TP_PLAN: dict[str, str] = {
    "q_proj": "col",
    "k_proj": "col",
    "v_proj": "col",  # whole query / KV heads per rank
    "o_proj": "row",  # this rank's heads' share of the output
    "gate_proj": "col",
    "up_proj": "col",  # f/tp hidden units per rank
    "down_proj": "row",
}
"""How tensor parallelism splits each projection's [out, in] weight: "col" (column-parallel) by output rows
(axis 0), "row" (row-parallel) by input columns (axis 1). Any parameter not named here is replicated."""
_AXIS = {"col": 0, "row": 1}


def split_axis(name: str) -> int | None:
    """Axis along which tensor parallel splits parameter `name` (any prefix, e.g. adam_m.), None if replicated."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in TP_PLAN:
        return _AXIS[TP_PLAN[parts[-2]]]
    return None


def shard(arrays: dict[str, np.ndarray], size: int, rank: int) -> dict[str, np.ndarray]:
    """Rank `rank`'s slices of full (unsplit) arrays."""
    out = {}
    for k, v in arrays.items():
        ax = split_axis(k)
        if ax is None or size == 1:
            out[k] = v
            continue
        if v.shape[ax] % size:
            raise ValueError(f"{k}: axis {ax} of shape {v.shape} does not split into {size} equal parts")
        n = v.shape[ax] // size
        out[k] = np.ascontiguousarray(np.take(v, np.arange(rank * n, (rank + 1) * n), axis=ax))
    return out


def unshard(shards: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Full arrays from every rank's slices (in rank order); replicated arrays are taken from rank 0."""
    if len(shards) == 1:
        return dict(shards[0])
    out = {}
    for k in shards[0]:
        ax = split_axis(k)
        out[k] = shards[0][k] if ax is None else np.concatenate([s[k] for s in shards], axis=ax)
    return out


class CopyToTP(nn.Cell):
    """Identity forward; AllReduce(sum) of the gradient over the tensor-parallel group backward."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return x * 1.0

    def bprop(self, x, out, dout):
        return (self.all_reduce(dout),)


class ReduceFromTP(nn.Cell):
    """AllReduce(sum) of the ranks' partial outputs forward; identity backward."""

    def __init__(self, group: str):
        super().__init__()
        self.all_reduce = ops.AllReduce(group=group)

    def construct(self, x):
        return self.all_reduce(x)

    def bprop(self, x, out, dout):
        return (dout,)


class TensorParallelBlock(nn.Cell):
    """A block (Attention or MLP) holding this rank's slices: CopyToTP on its input, ReduceFromTP on its output.
    Carries the block's `num_heads` and `softmax` (the model builds its mask from them once for all layers)."""

    def __init__(self, block: nn.Cell, group: str):
        super().__init__(auto_prefix=False)
        self.block = block
        self.enter, self.leave = CopyToTP(group), ReduceFromTP(group)
        self.num_heads = getattr(block, "num_heads", 0)
        if hasattr(block, "softmax"):
            self.softmax = block.softmax

    def construct(self, x, *args):
        return self.leave(self.block(self.enter(x), *args))


def _slice(param, axis: int, size: int, rank: int) -> None:
    full = param.asnumpy()
    n = full.shape[axis] // size
    part = np.ascontiguousarray(np.take(full, np.arange(rank * n, (rank + 1) * n), axis=axis))
    param.set_data(Tensor(part), slice_shape=True)


def parallelize(net: nn.Cell, mesh) -> nn.Cell:
    """Apply tensor parallelism (TP_PLAN) to `net` in place for this rank of `mesh`; a no-op when mesh.tp == 1.

    Slices each planned projection's weight (the full matrices were drawn in the same order as on one device, so
    the init is the same at any tp), sets each attention's head counts to this rank's share, and wraps every
    attention and MLP block in TensorParallelBlock. Parameter names stay those of the unsplit model."""
    if mesh.tp == 1:
        return net
    cfg, t = net.config, mesh.tp
    if cfg.num_kv_heads % t or cfg.intermediate_size % t:
        raise ValueError(
            f"tensor_parallel={t} must divide num_kv_heads={cfg.num_kv_heads} "
            f"and intermediate_size={cfg.intermediate_size}"
        )
    names = {id(p): p.name for p in net.get_parameters()}
    for layer in net.layers:
        for block in (layer.self_attn, layer.mlp):
            for proj, kind in TP_PLAN.items():
                cell = getattr(block, proj, None)
                if cell is None:
                    continue
                _slice(cell.weight, _AXIS[kind], t, mesh.tp_index)
                if kind == "col":
                    cell.out_features //= t
        layer.self_attn.num_heads //= t
        layer.self_attn.num_kv_heads //= t
        layer.self_attn = TensorParallelBlock(layer.self_attn, mesh.tp_group)
        layer.mlp = TensorParallelBlock(layer.mlp, mesh.tp_group)
    for p in net.get_parameters():  # MindSpore renames on re-parenting; the unsplit model's names are the contract
        p.name = names[id(p)]
    net.tensor_parallel = t
    return net
