"""Megatron-style tensor parallelism on MindSpore's collectives (runs on CPU, GPU and Ascend).

    tp = TensorParallel(size=2, rank=r, group="tp_0")     # `group` from mindspore.communication.create_group
    net = LlamaForCausalLM(config, seed=0, tensor_parallel=tp)

Each rank holds a slice of every attention and MLP matrix: q/k/v and gate/up are split by
output rows (column-parallel: whole heads / hidden units per rank), o_proj and down_proj by
input columns (row-parallel). Embedding, norms and the LM head are replicated. Two
collectives per block keep the math of one device:

- `CopyToTP` on the block's input: identity forward, AllReduce of the gradient backward
  (each rank's slice contributes part of d(input));
- `ReduceFromTP` on the block's output: AllReduce of the partial sums forward, identity
  backward (the custom bprop: MindSpore's default AllReduce bprop all-reduces the gradient
  again, which would multiply it by the group size).

Only AllReduce(sum) is used: it is the collective MindSpore's CPU backend supports.
Parameter names are those of the unsplit model; `split_axis(name)` says which axis a
parameter (or its AdamW moment) is split along, which is what checkpoints reshard by.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mindspore import nn, ops

COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # split along rows (axis 0)
ROW = ("o_proj", "down_proj")                                     # split along columns (axis 1)


@dataclass(frozen=True)
class TensorParallel:
    size: int
    rank: int
    group: str

    def rows(self, full: np.ndarray) -> np.ndarray:
        """This rank's block of rows of `full` (column-parallel weight)."""
        n = full.shape[0] // self.size
        return np.ascontiguousarray(full[self.rank * n:(self.rank + 1) * n])

    def cols(self, full: np.ndarray) -> np.ndarray:
        """This rank's block of columns of `full` (row-parallel weight)."""
        n = full.shape[1] // self.size
        return np.ascontiguousarray(full[:, self.rank * n:(self.rank + 1) * n])


def split_axis(name: str) -> int | None:
    """Axis along which tensor parallel splits parameter `name` (any prefix, e.g. adam_m.), None if replicated."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-1] == "weight":
        if parts[-2] in COLUMN:
            return 0
        if parts[-2] in ROW:
            return 1
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
