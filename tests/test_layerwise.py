"""The train step one decoder layer at a time (tasks/training/layerwise.py) against the whole-model step: the same
losses, gradient norms and updates, with the fused cells; where it cannot run, the whole-model step and why."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from helpers import decoder_reduction, fp32_tol, use_threads
from mindspore import Tensor

from model.config import ModelConfig
from model.cpu import matmul_isa
from tasks.modeling.build import build_network
from tasks.training.layer_grad import functional_unsupported
from tasks.training.layerwise import LayerwiseTrainStep, causal_lm_train_step, layerwise_unsupported, train_step
from tasks.training.step import TrainStep, causal_lm_loss_fn


def _net(tied: bool, fused: bool = True):
    cfg = ModelConfig.from_dict({**ModelConfig.from_name("tiny").to_dict(), "tie_embeddings": tied})
    built = build_network("llama", cfg, seed=0, fused_kernels=fused)  # the trainer's cells (plain where none build)
    # norm weights apart from 1 and from each other: a layer run with another layer's norm weight shows
    rng = np.random.default_rng(3)
    for name, p in built.net.parameters_and_names():
        if "norm" in name:
            p.set_data(Tensor(rng.uniform(0.5, 1.5, p.shape).astype(np.float32)))
    return cfg, built


@pytest.mark.integration  # ~10 s each: both steps compiled
@pytest.mark.parametrize(
    "tied,fused,lora,cap",
    [
        (True, True, False, ""),
        (False, True, False, ""),
        (True, False, False, ""),
        (True, True, True, ""),
        (False, True, False, "AVX2"),
    ],
    ids=["tied", "untied", "tied-builtin-ops", "lora", "untied-avx2-head"],
)
def test_layer_at_a_time_equals_the_whole_model_step(tied, fused, lora, cap, monkeypatch):
    """Three steps of two masked micro-batches (accumulation, token weights, clipping active), then a non-finite
    step (loss scale 0) that must change nothing: the same loss and gradient norm each step, the same weights.
    With the fused kernels the layers run the written-out backward (tasks/training/layer_grad.py), with MindSpore's
    own ops the autodiff layer graph. LoRA (q, v and down, rank 4, B random: at B = 0 a wrong d A would hide): only
    the adapters' gradients, through frozen base weights and head; the base weights do not move. With MatMul capped at
    AVX2 (ONEDNN_MAX_CPU_ISA, as on an AVX2-only CPU) both steps take the head's weight gradient through the
    transposed dlogits (model/fused_cells.py FusedHeadMatMul)."""
    from model.fused_cells import FusedHeadMatMul
    from model.lora import inject_lora, mark_only_lora_trainable

    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)

    runs = []
    for layerwise in (False, True):
        cfg, built = _net(tied, fused)
        net = built.net
        if cap:
            assert isinstance(net.lm_head.matmul, FusedHeadMatMul) == (matmul_isa() == "avx2")
        params = net.trainable_params()
        if lora:
            inject_lora(net, "q_proj,v_proj,down_proj", rank=4, alpha=8.0)
            rng = np.random.default_rng(7)
            for name, p in net.parameters_and_names():
                if name.endswith("lora_B"):
                    p.set_data(Tensor(rng.normal(0, 0.05, p.shape).astype(np.float32)))
            base = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
            params = mark_only_lora_trainable(net)
        step = causal_lm_train_step(
            net, params, accumulation=2, grad_clip=0.5, in_place=built.kernels.optimizer, layerwise=layerwise
        )
        assert isinstance(step, LayerwiseTrainStep) == layerwise
        if layerwise:
            assert (step.fn is not None) == built.kernels.fused, functional_unsupported(net)
            assert step.lora == lora
        rng = np.random.default_rng(1)
        out = []
        for s in range(1, 4):
            tok = rng.integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
            y = tok[:, 1:].copy()
            y[0, :9] = -100  # the first micro-batch counts 24 tokens, the second 32
            out.append(step([(tok[:2, :-1], y[:2]), (tok[2:, :-1], y[2:])], 1e-2, s))
        before = {p.name: p.asnumpy().copy() for p in net.trainable_params()}
        loss, gnorm, finite = step([(tok[:2, :-1], y[:2]), (tok[2:, :-1], y[2:])], 1e-2, 4, loss_scale=0.0)
        assert not finite
        for p in net.trainable_params():
            np.testing.assert_array_equal(p.asnumpy(), before[p.name], err_msg=p.name)
        if lora:  # frozen: the base weights, norms and embedding exactly as before the steps
            for p in net.get_parameters():
                if p.name in base and not p.requires_grad:
                    np.testing.assert_array_equal(p.asnumpy(), base[p.name], err_msg=p.name)
        runs.append((out, before))
    (whole, w_params), (layer, l_params) = runs
    n = decoder_reduction(cfg, 16) + cfg.vocab_size + 64
    for s, ((l1, g1, f1), (l2, g2, f2)) in enumerate(zip(whole, layer), start=1):
        assert f1 and f2
        # (+ 1.0: the masked mean's terms include the log-sum-exp, ~log V, beside |loss|)
        assert abs(l1 - l2) <= fp32_tol(abs(l1) + 1.0, n), (s, l1, l2)
        # the norm: every gradient's squares summed (another order: the host's float32 dots)
        assert abs(g1 - g2) <= fp32_tol(g1, 2 * n + cfg.num_parameters), (s, g1, g2)
    # three AdamW updates of lr 1e-2 from gradients that agree to fp32 rounding. AdamW's update m / (sqrt(v) + eps)
    # is at most ~lr per step whatever the gradient, so no element can part by more than 2 lr per step (checked for
    # every element); it is scale-free, so an element's update carries its gradient's relative error, and an element
    # whose gradient cancelled to near its own rounding carries a large one (measured: one embedding element of
    # 32768 at 4e-5, 0.4% of lr). So every element within the hard bound, and all but a rare few (under 1% of a
    # tensor) within the rounding bound: the weight's own rounding (fp32_tol at |w| + 3 lr) plus 3 lr times the
    # gradient's relative rounding. A wrong gradient moves most elements of a tensor by about lr each step.
    tight = 3 * 1e-2 * fp32_tol(1.0, n)
    for name, w in w_params.items():
        diff = np.abs(l_params[name] - w)
        assert diff.max() <= 2 * 1e-2 * 3, (name, diff.max())
        outside = int((diff > fp32_tol(np.abs(w).max() + 3e-2, n) + tight).sum())
        assert outside < 0.01 * w.size, (name, outside, w.size, diff.max())


@pytest.mark.integration  # ~5 s
def test_written_out_layer_backward_equals_autodiff():
    """One layer (grouped-query heads, norm weights apart from 1): the written-out forward and backward
    (tasks/training/layer_grad.py) against the layer cell and GradOperation on it, from the same input and upstream
    gradient. A wrong term (a transposed MatMul, RoPE's sign, a missing residual, the 1/sqrt(hd) scale) is off by
    the gradient's own size; another order of the same sums by fp32 rounding."""
    from mindspore import nn, ops

    from model.runtime import actor_thread_branch
    from tasks.training.layer_grad import layer_functions
    from tasks.training.layerwise import _Graph, _prologue

    cfg, built = _net(True)
    net = built.net
    fn = layer_functions(net)
    if fn is None:
        pytest.skip(f"the written-out backward needs the fused kernels: {functional_unsupported(net)}")
    layer = net.layers[1]
    flag = Tensor(0, ms.int32)
    rng = np.random.default_rng(5)
    ids = Tensor(rng.integers(0, cfg.vocab_size, (2, 16)).astype(np.int32))
    (x, cos, sin, mask), _ = ms.jit(_Graph(net, _prologue))(ids, flag)
    ws = [Tensor(p.asnumpy()) for _, p in layer.parameters_and_names()]
    y, *saved, _ = fn.forward(x, cos, sin, flag, *ws)
    dy = Tensor(rng.normal(size=y.shape).astype(np.float32))
    dx, *dws, _ = fn.backward(x, cos, sin, flag, dy, *saved, *ws)

    class Reference(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer, self.weights = layer, ms.ParameterTuple(p for _, p in layer.parameters_and_names())
            self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

        def run(self, x, cos, sin, mask):
            return self.layer(x, cos, sin, mask)

        def construct(self, x, cos, sin, mask, dy, flag):
            return (
                self.run(x, cos, sin, mask),
                self.grad(self.run, self.weights)(x, cos, sin, mask, dy),
                actor_thread_branch(flag),
            )

    y_ref, ((dx_ref, *_), dws_ref), _ = ms.jit(Reference())(x, cos, sin, mask, dy, flag)
    n = decoder_reduction(ModelConfig.from_dict({**cfg.to_dict(), "num_layers": 1}), 16) + 2 * 32  # + backward's
    names = ["y", "dx"] + [name for name, _ in layer.parameters_and_names()]
    for name, a, b in zip(names, [y, dx, *dws], [y_ref, dx_ref, *dws_ref]):
        a, b = a.asnumpy(), b.asnumpy()
        assert a.shape == b.shape, name
        np.testing.assert_allclose(a, b, rtol=0, atol=fp32_tol(np.abs(b).max(), n), err_msg=name)


def test_where_it_cannot_run_the_whole_model_step_runs_and_says_why(monkeypatch):
    cfg, built = _net(True)
    net = built.net
    params = net.trainable_params()
    from types import SimpleNamespace

    from tasks.runtime.mesh import Mesh
    from tasks.training.optimizer import parallelize_optimizer

    train = SimpleNamespace(
        optimizer=SimpleNamespace(
            beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, decay_norms_and_biases=False, decay_embeddings=False
        ),
        loop=SimpleNamespace(grad_clip=1.0),
    )
    subset = [p for p in params if "layers.0." in p.name]  # as LoRA: a part of the model trained
    opt = parallelize_optimizer(subset, train, Mesh(), False)
    step, how = train_step(net, causal_lm_loss_fn(net), subset, opt, layerwise=True)
    assert type(step) is TrainStep and how.startswith("whole model: ") and "subset" in how
    step, how = train_step(net, causal_lm_loss_fn(net), params, parallelize_optimizer(params, train, Mesh(), False))
    assert type(step) is LayerwiseTrainStep and how == "layer at a time"  # the default, as train.layerwise's
    step, how = train_step(net, causal_lm_loss_fn(net), params, step.optimizer, layerwise=False)
    assert type(step) is TrainStep and how == "whole model"
    assert layerwise_unsupported(net, params) is None
    assert "tensor parallel" in layerwise_unsupported(net, params, SimpleNamespace(tp=2))
    real = ms.get_context  # on a device the gradients would pass through host memory: the whole-model step there
    monkeypatch.setattr(ms, "get_context", lambda key: "Ascend" if key == "device_target" else real(key))
    assert layerwise_unsupported(net, params).startswith("device target Ascend")
    monkeypatch.undo()
    # the written-out layer backward needs the fused fp32 kernels; elsewhere the autodiff layer graph runs
    assert functional_unsupported(net) is None or not built.kernels.fused
    assert functional_unsupported(_net(True, fused=False)[1].net) == "the fused kernels are off"
    half = build_network("llama", cfg, seed=0, precision="fp16", fused_kernels=True).net
    assert functional_unsupported(half) == "fp16 compute"


@pytest.mark.integration  # ~10 s
def test_layer_at_a_time_validation_loss_equals_the_model_loss():
    cfg, built = _net(True)
    net = built.net
    step = causal_lm_train_step(net, net.trainable_params(), layerwise=True)
    tok = np.random.default_rng(2).integers(0, cfg.vocab_size, (2, 17)).astype(np.int32)
    ids, labels = Tensor(tok[:, :-1]), Tensor(tok[:, 1:])
    ours = float(step.eval_loss(ids, labels).asnumpy())
    ref = float(ms.jit(causal_lm_loss_fn(net))(ids, labels).asnumpy())
    assert abs(ours - ref) <= fp32_tol(abs(ref) + 1.0, decoder_reduction(cfg, 16) + cfg.vocab_size + 32)


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


@pytest.mark.integration  # ~15 s: a model whose gradients (~110 MB) stand out of the process's noise
def test_layer_at_a_time_memory_stays_flat_after_the_first_step():
    """A compiled graph keeps its last call's inputs alive until its next call (docs/MINDSPORE_CPU.md, "Memory"):
    with fresh gradient arrays every step, the update graph held the previous step's while the next step made its
    own, and the process grew by a set of gradients after the first step. The step's arrays are allocated once."""
    cfg = ModelConfig.from_dict(
        {
            **ModelConfig.from_name("tiny").to_dict(),
            "vocab_size": 49152,
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_heads": 8,
            "num_kv_heads": 8,
            "tie_embeddings": False,
        }
    )
    built = build_network("llama", cfg, seed=0, fused_kernels=True)
    net = built.net
    grad_bytes = sum(int(np.prod(p.shape)) * 4 for p in net.trainable_params())
    step = causal_lm_train_step(net, net.trainable_params(), in_place=built.kernels.optimizer, layerwise=True)
    assert isinstance(step, LayerwiseTrainStep)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 33)).astype(np.int32)
    batch = [(ids[:, :-1], ids[:, 1:])]
    rss = []
    for s in range(4):
        step(batch, 1e-4, s + 1)
        rss.append(_rss_bytes())
    # the first step allocates the moments and the gradient arrays; after it the process may move by allocator
    # noise, far less than half a set of gradients (the old behaviour grew by a whole set)
    assert rss[3] - rss[0] < grad_bytes / 2, (rss, grad_bytes)


def test_gradient_writes_on_the_kernels_threads_copy_add_and_square(monkeypatch):
    """model/kernel_ops.py grad_put (MsllmGradPut): the layer-at-a-time step's gradient writes. The copy and the sum
    are exact (a float32 add is one rounding, as NumPy's); Σ dst² of non-negative terms is within n·u of the float64
    sum, n the longest chain of float32 additions (a run of kPutRun = 1024 terms, plus a lane reduction of at most
    16), and the same bits at 1 and 2 threads (fixed blocks summed in order)."""
    from model.kernel_ops import grad_put

    put = grad_put()
    if put is None:
        pytest.skip("the kernel library is not built (no compiler)")
    rng = np.random.default_rng(5)
    n = 3 * (1 << 14) * 8 + 77  # several blocks per thread and a ragged tail
    src, add = rng.standard_normal(n, np.float32), rng.standard_normal(n, np.float32)
    dst = np.full(n, np.nan, np.float32)
    assert put(dst, src, False, False) == 0.0
    assert np.array_equal(dst, src)
    squares = put(dst, add, True, True)
    want = src + add
    assert np.array_equal(dst, want)
    exact = float(np.dot(want.astype(np.float64), want.astype(np.float64)))
    assert abs(squares - exact) <= (1024 + 16) * np.finfo(np.float32).eps / 2 * exact
    by_threads = []
    for threads in ("1", "2"):
        use_threads(monkeypatch, threads)  # asserts the kernels report that count (at most the CPUs)
        by_threads.append(put(np.empty_like(want), want, False, True))
    assert by_threads[0] == by_threads[1] == squares
    with pytest.raises(ValueError, match="float32 C-contiguous"):
        put(dst, src.astype(np.float64), False, True)


def test_embedding_gradient_rows_on_the_kernels_threads(monkeypatch):
    """model/kernel_ops.py embed_grad (MsllmEmbedGrad): dx's rows added onto the embedding gradient's rows `ids`, in
    token order, after zeroing (an untied head) or onto what is there (the tied head's gradient); Σ e² as grad_put's.
    Each element's sum is a chain of float32 adds in token order, the same chain as the loop below: exact; the same
    bits at 1 and 2 threads; an id outside the table writes nothing."""
    from model.kernel_ops import embed_grad

    add = embed_grad()
    if add is None:
        pytest.skip("the kernel library is not built (no compiler)")
    rng = np.random.default_rng(7)
    rows, h, n = 300, 72, 500  # h: a 64-column block and a ragged one; repeated ids
    ids = rng.integers(0, rows, n).astype(np.int32)
    ids[:5] = 17  # one row hit several times in a row
    dx = rng.standard_normal((n, h), np.float32)
    head = rng.standard_normal((rows, h), np.float32)

    def reference(start):
        e = start.copy()
        for i, r in enumerate(ids):
            e[r] += dx[i]
        return e

    e = np.full((rows, h), np.nan, np.float32)
    assert add(e, dx, ids, True, False) == 0.0  # zeroed first: the NaNs are gone
    assert np.array_equal(e, reference(np.zeros_like(head)))
    e = head.copy()
    squares = add(e, dx, ids, False, True)
    want = reference(head)
    assert np.array_equal(e, want)
    exact = float(np.sum(want.astype(np.float64) ** 2))
    assert abs(squares - exact) <= (1024 + 16) * np.finfo(np.float32).eps / 2 * exact
    by_threads = []
    for threads in ("1", "2"):
        use_threads(monkeypatch, threads)
        e = head.copy()
        by_threads.append((add(e, dx, ids, False, True), e))
    assert by_threads[0][0] == by_threads[1][0] == squares
    assert np.array_equal(by_threads[0][1], by_threads[1][1])
    bad = ids.copy()
    bad[-1] = rows
    e = head.copy()
    with pytest.raises(ValueError, match=r"a token id outside \[0, 300\)"):
        add(e, dx, bad, True, True)
    assert np.array_equal(e, head)  # nothing written, not even the zeroing
