"""Parallelism applied from outside the model, in one place (torchtitan's `parallelize`), from a `Mesh`
(tasks/runtime/distributed.py: dp × tp ranks, optimizer_shard):

    net = build_model(...)                                  # the model (its tensor-parallel slice: see below)
    optimizer = parallelize_optimizer(params, train, mesh)   # AdamW (TP-aware clipping) or ZeRO-1 ShardedAdamW
    step = TrainStep(loss_fn, params, optimizer, dp_group=mesh.dp_group, dp=mesh.dp)   # DP gradient reduction

- data parallel: the gradient reduction over `mesh.dp_group` (TrainStep, MindSpore's DistributedGradReducer; under
  ZeRO-1 chained AllReduces in backward order);
- ZeRO-1 (`parallel.optimizer_shard`, dp > 1, tp == 1): ShardedAdamW keeps 1/dp of the moments per rank and
  gathers the updated shares after each applied update (tasks/training/zero.py);
- tensor parallel: the global gradient norm sums the slices' squares over `mesh.tp_group` (AdamW), and the model is
  built as this rank's slice: `model.parallel.TensorParallel` handed to the model constructor, loaded weights cut
  by `model.parallel.shard` (`tensor_parallel_weights` below). The slicing itself still lives in the model's
  Attention/MLP constructors (model/llama.py); moving it here is the remaining step of issue 26.

The native-kernel question (in-place AdamW or MindSpore's AdamWeightDecay) is `model.kernels.enabled`, asked by
the optimizers with train.fused_kernels.
"""

from __future__ import annotations


def parallelize_optimizer(params, train, mesh, decay_mask: list[bool] | None = None):
    """The optimizer over `params` for this rank of `mesh`, from a `train` section (tasks.config.TrainSection,
    or anything with .optimizer, .loop.grad_clip and .fused_kernels). `decay_mask` defaults to the optimizer
    section's rule (norms, biases and embeddings undecayed unless it says otherwise)."""
    from tasks.training.adamw import AdamW, decays
    from tasks.training.zero import ShardedAdamW

    o = train.optimizer
    if decay_mask is None:
        decay_mask = [decays(p.name, decay_norms_and_biases=o.decay_norms_and_biases,
                             decay_embeddings=o.decay_embeddings) for p in params]
    common = dict(beta1=o.beta1, beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay,
                  grad_clip=train.loop.grad_clip, decay_mask=decay_mask)
    if getattr(mesh, "zero", False):
        return ShardedAdamW(params, dp=mesh.dp, dp_index=mesh.dp_index, in_place=train.fused_kernels, **common)
    return AdamW(params, sharded=mesh.sharded(params), tp_group=mesh.tp_group, fused=train.fused_kernels, **common)


def tensor_parallel_weights(weights: dict, mesh) -> dict:
    """Full (unsplit) weights cut to this rank's tensor-parallel slices (unchanged when tp == 1)."""
    if mesh.tp == 1:
        return weights
    from model.parallel import shard

    return shard(weights, mesh.tp, mesh.tp_index)
