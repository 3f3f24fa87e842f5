"""Run under msrun with 2 workers (tests/test_distributed.py): a tensor-parallel tiny LLaMA against one device.

Every rank builds the single-device model and its own tensor-parallel slice from the same seed (both through
tasks/modeling/build.py `build_network`, the second with the mesh),
then compares logits and one AdamW training step (loss, gradient norm, updated parameters
against the matching slices of the single-device ones). Writes OUT/rank<r>.json.
"""

import json
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repo, not tests/
    import mindspore as ms
    import numpy as np

    from model.config import ModelConfig
    from model.llama import causal_lm_loss
    from tasks.modeling.build import build_network
    from tasks.modeling.parallelize import shard
    from tasks.runtime.mesh import Mesh
    from tasks.training.layerwise import causal_lm_train_step

    out = Path(sys.argv[1])
    ms.set_device("CPU")
    mesh = Mesh.init(dp=1, tp=2)
    cfg = ModelConfig.from_name("tiny")
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
    labels = np.roll(ids, -1, axis=1)
    labels[:, -1] = -100

    def train_step(net, mesh):
        params = net.trainable_params()

        def loss_fn(i, y):
            return causal_lm_loss(net(i), y)

        grads = ms.jit(ms.value_and_grad(loss_fn, None, weights=params))(ms.Tensor(ids), ms.Tensor(labels))[1]
        grads = {p.name: g.asnumpy().copy() for p, g in zip(params, grads)}
        # lr 1e-3: AdamW's first update is lr·g/(|g|+eps), which turns float noise in near-zero
        # gradient entries into differences up to 2·lr; the gradients themselves are compared exactly above
        step = causal_lm_train_step(net, params, grad_clip=0.5, mesh=mesh)  # clipping active: norm 1.8 > 0.5
        loss, gnorm, finite = step([(ids, labels)], 1e-3, 1)
        return loss, gnorm, {p.name: p.asnumpy().copy() for p in params}, grads

    single = build_network("llama", cfg, seed=0).net
    tp_net = build_network("llama", cfg, seed=0, mesh=mesh).net
    names_equal = [p.name for p in single.trainable_params()] == [p.name for p in tp_net.trainable_params()]
    full0 = {p.name: p.asnumpy().copy() for p in single.trainable_params()}
    mine0 = {p.name: p.asnumpy().copy() for p in tp_net.trainable_params()}
    init_equal = all(np.array_equal(v, shard(full0, 2, mesh.tp_index)[k]) for k, v in mine0.items())

    def forward_single(i):
        return single(i)

    def forward_tp(i):
        return tp_net(i)

    logits_single = ms.jit(forward_single)(ms.Tensor(ids)).asnumpy()
    logits_tp = ms.jit(forward_tp)(ms.Tensor(ids)).asnumpy()
    loss_s, gnorm_s, after_s, grads_s = train_step(single, None)
    loss_t, gnorm_t, after_t, grads_t = train_step(tp_net, mesh)
    want = shard(after_s, 2, mesh.tp_index)
    want_g = shard(grads_s, 2, mesh.tp_index)
    moved = max(float(np.abs(after_s[k] - full0[k]).max()) for k in after_s)
    result = {
        "rank": mesh.rank,
        "init_equal": bool(init_equal),
        "names_equal": names_equal,
        "local_shapes": {k: list(v.shape) for k, v in mine0.items() if "layers.0." in k},
        "logits_max_abs_diff": float(np.abs(logits_single - logits_tp).max()),
        "logits_scale": float(np.abs(logits_single).max()),
        "loss": [loss_s, loss_t],
        "grad_norm": [gnorm_s, gnorm_t],
        "grad_max_abs_diff": max(float(np.abs(want_g[k] - grads_t[k]).max()) for k in grads_t),
        "grad_scale": max(float(np.abs(g).max()) for g in grads_s.values()),
        "param_max_abs_diff": max(float(np.abs(want[k] - after_t[k]).max()) for k in after_t),
        "param_update_max": moved,
        "param_scale": max(float(np.abs(w).max()) for w in want.values()),
    }
    (out / f"rank{mesh.rank}.json").write_text(json.dumps(result))
    print(json.dumps(result), flush=True)
