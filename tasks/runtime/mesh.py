"""This process's place in a dp × tp layout of ranks (the mesh that tasks/modeling/parallelize.py applies to a
model), and the collectives the trainer needs outside the train step.

    mesh = Mesh.init(dp=2, tp=1, optimizer_shard=True)   # inside an msrun job: joins it, creates the groups
    mesh = Mesh()                                          # one process, no collectives
    mesh.dp_index, mesh.tp_index, mesh.zero                # which data replica / tensor slice, ZeRO-1 on?

The runtime (tasks/runtime/) starts the ranks; it does not know the model. This module knows the layout; the
tensor-parallel plan by parameter name is tasks/modeling/parallelize.py's. MindSpore loads inside the methods that
talk to other ranks (lazy): the training stages' parents import this module (a `Mesh()` needs no MindSpore).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Mesh:
    """This process's place in a dp × tp layout; a single process is Mesh() (no collectives)."""

    dp: int = 1
    tp: int = 1
    rank: int = 0
    dp_group: str | None = None
    """Group of the ranks holding the same model slice (gradients averaged over it); None when dp == 1."""
    tp_group: str | None = None
    """Group of the ranks sharing one replica's tensor-parallel slices; None when tp == 1."""
    optimizer_shard: bool = False
    """parallel.optimizer_shard: ZeRO-1 (tasks/training/zero.py ShardedAdamW) when dp > 1 and tp == 1."""

    @property
    def zero(self) -> bool:
        """Whether each data-parallel rank keeps only its share of the optimizer state."""
        return self.optimizer_shard and self.dp > 1 and self.tp == 1

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def dp_index(self) -> int:
        return self.rank // self.tp

    @property
    def tp_index(self) -> int:
        return self.rank % self.tp

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def layout(self) -> dict[str, int]:
        """{data_parallel, tensor_parallel}: the layout as the parallel section names it (what checkpoints and
        manifests record)."""
        return {"data_parallel": self.dp, "tensor_parallel": self.tp}

    @property
    def writes_checkpoint(self) -> bool:
        """Data-parallel replica 0 writes the checkpoint shards (the other replicas hold copies)."""
        return self.dp_index == 0

    @classmethod
    def init(cls, dp: int, tp: int, optimizer_shard: bool = False) -> Mesh:
        """Join the job msrun started (mindspore.communication.init) and create this rank's groups."""
        from mindspore.communication import GlobalComm, create_group, get_group_size, get_rank, init

        init()
        world, rank = get_group_size(), get_rank()
        if world != dp * tp:
            raise RuntimeError(
                f"msrun started {world} workers but parallel.data_parallel × tensor_parallel = "
                f"{dp}×{tp} = {dp * tp}; set parallel.device_num to match"
            )
        d, t = rank // tp, rank % tp
        dp_group = tp_group = None
        if dp > 1:
            dp_group = GlobalComm.WORLD_COMM_GROUP if tp == 1 else f"dp_{t}"
            if tp > 1:
                create_group(dp_group, [i * tp + t for i in range(dp)])
        if tp > 1:
            tp_group = GlobalComm.WORLD_COMM_GROUP if dp == 1 else f"tp_{d}"
            if dp > 1:
                create_group(tp_group, [d * tp + i for i in range(tp)])
        return cls(dp=dp, tp=tp, rank=rank, dp_group=dp_group, tp_group=tp_group, optimizer_shard=optimizer_shard)

    def barrier(self) -> None:
        """Wait for every rank (an AllReduce of one number: MindSpore's Barrier has no CPU kernel)."""
        if not self.distributed:
            return
        import mindspore as ms
        from mindspore import ops
        from mindspore.communication import GlobalComm

        ops.AllReduce(group=GlobalComm.WORLD_COMM_GROUP)(ms.Tensor([1.0], ms.float32)).asnumpy()

    def check_replicas(self, arrays: dict[str, np.ndarray]) -> str:
        """sha256 of this rank's tensors, checked equal across the data-parallel replicas (RuntimeError if not).

        The replicas start from the same seed and apply the same averaged gradients, so their
        parameters must agree bit for bit; the digests travel by AllGather (every rank must call this).
        """
        h = hashlib.sha256()
        for k in sorted(arrays):
            h.update(k.encode())
            h.update(np.ascontiguousarray(arrays[k]).tobytes())
        digest = h.hexdigest()
        if self.dp_group is None:
            return digest
        import mindspore as ms
        from mindspore import ops
        from mindspore.communication import GlobalComm

        mine = np.frombuffer(bytes.fromhex(digest), dtype=np.int32).reshape(1, -1)
        # over the world group (the only one AllGather supports on CPU); row r is rank r's digest
        everyone = ops.AllGather(group=GlobalComm.WORLD_COMM_GROUP)(ms.Tensor(mine)).asnumpy()
        replicas = everyone[self.tp_index :: self.tp]  # the ranks holding the same slice as this one
        if not (replicas == mine).all():
            raise RuntimeError(
                f"data-parallel replicas diverged: rank {self.rank}'s parameters differ from another "
                f"replica's (sha256 {digest[:16]}…); gradients were not averaged identically"
            )
        return digest
