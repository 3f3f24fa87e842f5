"""The compiled train step: schedule, AdamW against a numpy reference, accumulation, non-finite skipping."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from helpers import decoder_reduction, fp32_tol
from mindspore import Parameter, Tensor

from model.config import ModelConfig
from model.llama import LlamaForCausalLM
from tasks.training.adamw import AdamW, decays
from tasks.training.layerwise import causal_lm_train_step
from tasks.training.schedule import lr_at


def test_lr_schedule_shapes():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=4, max_steps=14)
    assert [lr_at(s, decay="cosine", **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    # float64 closed forms of the schedule (no sums): pytest.approx's 1e-6 relative is rounding room, not tuned
    assert lr_at(4, decay="cosine", **kw) == pytest.approx(1.0)
    assert lr_at(9, decay="cosine", **kw) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(14, decay="cosine", **kw) == pytest.approx(0.1)
    assert lr_at(9, decay="linear", **kw) == pytest.approx(0.55)
    assert lr_at(12, decay="linear", **kw) == pytest.approx(1.0 - 0.9 * 0.8)
    assert lr_at(12, decay="constant", **kw) == 1.0


def test_weight_decay_mask():
    kw = dict(decay_norms_and_biases=False, decay_embeddings=False)
    assert decays("layers.0.mlp.up_proj.weight", **kw)
    assert not decays("layers.0.input_layernorm.weight", **kw)
    assert not decays("embed_tokens.weight", **kw)
    assert decays("embed_tokens.weight", decay_norms_and_biases=False, decay_embeddings=True)


def _numpy_adamw(p, grads, lr, b1, b2, eps, wd, clip):
    m = np.zeros_like(p)
    v = np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        norm = np.sqrt((g.astype(np.float64) ** 2).sum())
        g = g * min(1.0, clip / (norm + 1e-6))
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * ((m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * p)
    return p


def test_adamw_matches_numpy_reference():
    rng = np.random.default_rng(0)
    p0 = rng.standard_normal((5, 3)).astype(np.float32)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) * s for s in (0.5, 3.0, 0.1)]
    p = Parameter(Tensor(p0), name="w")
    opt = AdamW([p], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0, decay_mask=[True])
    for t, g in enumerate(grads, start=1):
        opt(
            (Tensor(g),),
            Tensor(0.01, ms.float32),
            Tensor(float(t), ms.float32),
            Tensor(1.0, ms.float32),
            Tensor(True, ms.bool_),
        )
    ref = _numpy_adamw(p0.astype(np.float64), grads, 0.01, 0.9, 0.95, 1e-8, 0.1, 1.0)
    # float32 against float64 over 3 steps: each sums the 15 squares of the clip norm, the rest is elementwise
    # (a few ulps of the weights and of lr x the moment ratio)
    np.testing.assert_allclose(p.asnumpy(), ref, rtol=0, atol=fp32_tol(np.abs(ref).max() + 0.01, 3 * 15))


def test_nonfinite_gradient_skips_the_update():
    p = Parameter(Tensor(np.ones((2, 2), np.float32)), name="w")
    opt = AdamW([p], beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, grad_clip=None, decay_mask=[True])
    g = np.array([[np.nan, 1.0], [1.0, 1.0]], np.float32)
    gnorm, finite = opt(
        (Tensor(g),), Tensor(0.1, ms.float32), Tensor(1.0, ms.float32), Tensor(1.0, ms.float32), Tensor(True, ms.bool_)
    )
    assert not bool(finite.asnumpy())
    np.testing.assert_array_equal(p.asnumpy(), np.ones((2, 2), np.float32))
    np.testing.assert_array_equal(opt.exp_avg[0].asnumpy(), np.zeros((2, 2), np.float32))


def _setup(k: int, seed: int = 0):
    cfg = ModelConfig.from_name("tiny")
    net = LlamaForCausalLM(cfg, seed=seed)
    return cfg, net, causal_lm_train_step(net, net.trainable_params(), accumulation=k)


@pytest.mark.integration  # ~11 s: two GRAPH-mode train steps compiled
def test_gradient_accumulation_equals_large_batch_weighted_by_tokens():
    """Two micro-batches equal one big batch, also where response-only masks leave them with different token
    counts (the step weights tokens, not micro-batches). One pair of compiled steps serves both cases."""
    cfg, net1, step1 = _setup(1)
    _, net2, step2 = _setup(2)
    rng = np.random.default_rng(1)
    plain = rng.integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    masked = rng.integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    y_masked = masked[:, 1:].copy()
    y_masked[:2, :12] = -100  # the first micro-batch counts 8 tokens, the second 32
    batches = [(plain[:, :-1], plain[:, 1:])] * 2 + [(masked[:, :-1], y_masked)] * 2
    for s, (x, y) in enumerate(batches, start=1):
        l1, g1, _ = step1([(x, y)], 1e-3, s)
        l2, g2, _ = step2([(x[:2], y[:2]), (x[2:], y[2:])], 1e-3, s)
        # another batch shape: float32 sums in another order. The loss passes the decoder's reductions, the
        # vocabulary's log-sum-exp and the mean over 64 positions; the gradient norm those backward and its sum
        # of squares over every parameter
        n = decoder_reduction(cfg, 16) + cfg.vocab_size + 64
        assert abs(l1 - l2) <= fp32_tol(abs(l1) + 1.0, n), (s, l1, l2)
        assert abs(g1 - g2) <= fp32_tol(abs(g1), 2 * n + cfg.num_parameters), (s, g1, g2)
    assert step2.token_weights([y_masked[:2], y_masked[2:]]) == [2 * 8 / 40, 2 * 32 / 40]
    for a, b in zip(net1.trainable_params(), net2.trainable_params()):
        # Not fp32_tol: Adam divides by sqrt(v), so a gradient element near 0 turns its float32 noise into an
        # update of up to lr per step of either sign: two runs can part by at most 2 * lr per step, 4 steps at lr 1e-3
        # (the losses above are the fp32_tol check; this one bounds what Adam can amplify)
        np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=0, atol=2 * 1e-3 * 4)


def test_jit_train_step_lowers_loss_and_is_deterministic():
    cfg, _, step = _setup(1)
    _, _, step_b = _setup(1)
    ids = np.random.default_rng(2).integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    losses = [step([(ids[:, :-1], ids[:, 1:])], 3e-3, s)[0] for s in range(1, 7)]
    losses_b = [step_b([(ids[:, :-1], ids[:, 1:])], 3e-3, s)[0] for s in range(1, 7)]
    assert losses[-1] < losses[0] - 0.3
    assert losses == losses_b  # bit-identical across two identical runs on CPU
