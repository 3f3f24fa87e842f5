"""The optimizer for this rank of a mesh (tasks/runtime/mesh.py): AdamW over the tensor-parallel slices, or ZeRO-1's
ShardedAdamW under data parallel with `parallel.optimizer_shard` (the network's own split is
tasks/modeling/parallelize.py's, which `split_axis` describes)."""

from __future__ import annotations

from tasks.modeling.parallelize import split_axis
from tasks.training.adamw import AdamW, decays
from tasks.training.zero import ShardedAdamW


def parallelize_optimizer(params, train, mesh, in_place: bool, decay_mask: list[bool] | None = None):
    """The optimizer over `params` for this rank of `mesh`, from a `train` section (tasks.config.schema.TrainSection,
    or anything with .optimizer and .loop.grad_clip). `in_place`: the build's kernel decision for the optimizer
    (tasks/modeling/build.py `Kernels.optimizer`). `decay_mask` defaults to the optimizer section's rule (norms,
    biases and embeddings undecayed unless it says otherwise)."""
    o = train.optimizer
    if decay_mask is None:
        decay_mask = [
            decays(p.name, decay_norms_and_biases=o.decay_norms_and_biases, decay_embeddings=o.decay_embeddings)
            for p in params
        ]
    common = dict(
        beta1=o.beta1,
        beta2=o.beta2,
        eps=o.eps,
        weight_decay=o.weight_decay,
        grad_clip=train.loop.grad_clip,
        decay_mask=decay_mask,
    )
    if getattr(mesh, "zero", False):
        return ShardedAdamW(params, dp=mesh.dp, dp_index=mesh.dp_index, in_place=in_place, **common)
    sharded = [mesh.tp > 1 and split_axis(p.name) is not None for p in params]
    return AdamW(params, sharded=sharded, tp_group=mesh.tp_group, in_place=in_place, **common)
