"""The fused train-step kernels (model/train_kernels.cc via model/kernel_ops.py and the cells of model/fused_cells.py)
against MindSpore's own ops.

Skipped only where no C++ compiler exists (or MSLLM_FUSED_KERNELS=0 says so); where one exists and the
kernels do not build, they fail. The model then runs MindSpore's own ops, which the fallback test checks.
The ISA bodies against the scalar reference, the probe and the build cache: tests/test_kernel_isa.py."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import threading
import time

import mindspore as ms
import numpy as np
import pytest
from helpers import decoder_reduction, fp32_tol, use_threads
from mindspore import Tensor

from model import runtime
from model.config import ModelConfig
from model.fused_cells import FusedSwiGLU
from model.kernel_build import disabled_reason, kernel_path
from model.kernel_ops import KernelShapeError, train_ops
from model.llama import LlamaForCausalLM
from model.rope import rope_tables
from tasks.modeling.build import Kernels, build_network

K = train_ops()
CXX = shutil.which(os.environ.get("CXX", "g++"))
needs_kernels = pytest.mark.skipif(
    CXX is None or bool(disabled_reason()),
    reason="no C++ compiler (or MSLLM_FUSED_KERNELS=0): the fused kernels cannot run here",
)


@needs_kernels
def test_the_kernels_build_where_a_compiler_exists():
    assert K is not None, f"a C++ compiler exists ({CXX}) but the fused kernels are {kernel_path()}"
    assert kernel_path() in ("avx512", "avx2", "neon", "scalar")


@needs_kernels
def test_bad_operands_are_a_clear_error_not_a_write_out_of_bounds():
    x = Tensor(np.zeros((2, 9, 5), np.float32))
    with pytest.raises(KernelShapeError, match=r"CausalSoftmax: T = 9 queries exceed S = 5 keys"):
        K.causal_softmax(x)
    with pytest.raises(KernelShapeError, match=r"RMSNorm: weight must have H = 8 elements, got shape \[7\]"):
        K.rms_norm(Tensor(np.ones((4, 8), np.float32)), Tensor(np.ones(7, np.float32)), Tensor(np.ones(1, np.float32)))
    with pytest.raises(KernelShapeError, match=r"SwiGLU: operands must have one shape"):
        K.swiglu(Tensor(np.ones((4, 8), np.float32)), Tensor(np.ones((4, 9), np.float32)))
    with pytest.raises(KernelShapeError, match=r"CrossEntropy: labels must be int32"):
        K.cross_entropy(Tensor(np.ones((4, 8), np.float32)), Tensor(np.ones(4, np.float32)))
    with pytest.raises(KernelShapeError, match=r"Transpose: x must be 2-D \[R, C\], got shape \[4, 2, 3\]"):
        K.transpose(Tensor(np.ones((4, 2, 3), np.float32)))
    with pytest.raises(KernelShapeError, match=r"CausalAttention: q's 3 heads must be a multiple of k's 2"):
        K.causal_attention(Tensor(np.ones((1, 3, 4, 8), np.float32)), *(Tensor(np.ones((1, 2, 4, 8), np.float32)),) * 2)
    with pytest.raises(KernelShapeError, match=r"CausalAttention: T = 5 queries exceed S = 4 keys"):
        K.causal_attention(Tensor(np.ones((1, 2, 5, 8), np.float32)), *(Tensor(np.ones((1, 2, 4, 8), np.float32)),) * 2)
    cs = Tensor(np.ones((4, 8), np.float32))
    with pytest.raises(KernelShapeError, match=r"RopeHeads: y must be \[B·T, n·hd\] for T = 4, hd = 8, got \[6, 16\]"):
        K.rope_heads(Tensor(np.ones((6, 16), np.float32)), cs, cs, Tensor(np.ones(1, np.float32)))
    with pytest.raises(KernelShapeError, match=r"RopeTokens: cos must be \[T, hd\] with T > 0 and an even hd"):
        odd = Tensor(np.ones((4, 7), np.float32))
        K.rope_tokens(Tensor(np.ones((1, 2, 4, 7), np.float32)), odd, odd, Tensor(np.ones(1, np.float32)))
    with pytest.raises(KernelShapeError, match=r"SwiGLU: gate must be float32"):
        K.swiglu(Tensor(np.ones(4, np.float16)), Tensor(np.ones(4, np.float16)))


def _ref_causal_softmax(x: np.ndarray) -> np.ndarray:
    n, t, s = x.shape
    keep = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)  # [T, S]
    z = np.where(keep, x.astype(np.float64), -np.inf)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.fixture(params=["1", "3"])
def threads(request, monkeypatch):
    return use_threads(monkeypatch, request.param)  # read at every call: results must not depend on it


@needs_kernels
@pytest.mark.parametrize(
    "t,s", [(37, 37), (5, 21), (64, 64)]
)  # odd widths hit the scalar tails; S > T: queries at the end
def test_causal_softmax_and_its_gradient(t, s, threads):
    rng = np.random.default_rng(t * s)
    x = (rng.standard_normal((3, t, s)) * 4).astype(np.float32)
    probs = K.causal_softmax(Tensor(x)).asnumpy()
    want = _ref_causal_softmax(x)
    # float32 kernels against float64 references (here and below): fp32_tol of the reduction each output sums
    # (the S keys of a row; the hidden width; the rows of a weight gradient; the vocabulary) at its terms' scale
    assert np.abs(probs - want).max() <= fp32_tol(1.0, s)
    assert (probs[:, np.arange(s)[None, :] > np.arange(t)[:, None] + (s - t)] == 0).all()  # masked: exactly 0
    dp = rng.standard_normal((3, t, s)).astype(np.float32)
    got = K.softmax_grad(Tensor(probs), Tensor(dp)).asnumpy()
    want_g = want * (dp - (dp * want).sum(-1, keepdims=True))
    assert np.abs(got - want_g).max() <= fp32_tol(np.abs(dp).max(), s)


@needs_kernels
def test_swiglu_and_its_gradient(threads):
    rng = np.random.default_rng(0)
    g = (rng.standard_normal((2, 7, 53)) * 6).astype(np.float32)  # |g| up to ~25: sigmoid saturates both ways
    u, d = rng.standard_normal((2, 2, 7, 53)).astype(np.float32)
    gd = g.astype(np.float64)
    s = 1 / (1 + np.exp(-gd))
    want, want_dg, want_du = gd * s * u, d * u * (s + gd * s * (1 - s)), d * gd * s
    # elementwise (no sum): a few ulps of exp, the division and the products, at each output's scale
    assert np.abs(K.swiglu(Tensor(g), Tensor(u)).asnumpy() - want).max() <= fp32_tol(np.abs(want).max())
    dg, du = (a.asnumpy() for a in K.swiglu_grad(Tensor(g), Tensor(u), Tensor(d)))
    scale_dg = np.abs(d * u * (1 + np.abs(gd) * s)).max()  # s + g s - g s^2: its terms before they cancel
    assert np.abs(dg - want_dg).max() <= fp32_tol(scale_dg)
    assert np.abs(du - want_du).max() <= fp32_tol(np.abs(want_du).max())


@needs_kernels
@pytest.mark.parametrize("n,h", [(70, 64), (5, 37)])  # rows not a multiple of the 32-row dweight block; odd width
def test_rms_norm_and_its_gradient(n, h, threads):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n, h)) * 3).astype(np.float32)
    w, eps = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32), 1e-6
    dy = rng.standard_normal((n, h)).astype(np.float32)
    e = Tensor(np.array([eps], np.float32))
    xd = x.astype(np.float64)
    inv = 1 / np.sqrt((xd**2).mean(-1, keepdims=True) + eps)
    y = xd * inv * w
    assert np.abs(K.rms_norm(Tensor(x), Tensor(w), e).asnumpy() - y).max() <= fp32_tol(np.abs(y).max(), h)
    dx, dw = (a.asnumpy() for a in K.rms_norm_grad(Tensor(x), Tensor(w), e, Tensor(dy)))
    g = dy * w
    want_dx = inv * g - xd * inv**3 * (g * xd).mean(-1, keepdims=True)
    scale_dx = np.abs(inv * g).max() + np.abs(xd * inv**3 * (g * xd).mean(-1, keepdims=True)).max()
    assert np.abs(dx - want_dx).max() <= fp32_tol(scale_dx, h)
    assert (np.abs(dw - (dy * xd * inv).sum(0)) <= fp32_tol(np.abs(dy * xd * inv).sum(0), n + h)).all()


@needs_kernels
def test_cross_entropy_and_its_gradient(threads):
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 37)) * 5).astype(np.float32)
    y = rng.integers(0, 37, 9).astype(np.int32)
    y[[2, 7]] = -100  # ignored rows: nll 0, gradient 0
    d = rng.standard_normal(9).astype(np.float32)
    nll, lse = (a.asnumpy() for a in K.cross_entropy(Tensor(x), Tensor(y)))
    xd = x.astype(np.float64)
    want_lse = np.log(np.exp(xd - xd.max(-1, keepdims=True)).sum(-1)) + xd.max(-1)
    keep = y >= 0
    assert np.abs(lse - want_lse).max() <= fp32_tol(np.abs(xd).max(), 37)
    assert np.abs(nll - np.where(keep, want_lse - xd[np.arange(9), np.maximum(y, 0)], 0)).max() <= fp32_tol(
        np.abs(xd).max(), 37
    )
    got = K.cross_entropy_grad(Tensor(x), Tensor(y), Tensor(lse), Tensor(d)).asnumpy()
    want = np.exp(xd - want_lse[:, None])
    want[np.arange(9), np.maximum(y, 0)] -= 1
    want = np.where(keep[:, None], want * d[:, None], 0)
    assert np.abs(got - want).max() <= fp32_tol(np.abs(d).max(), 37)
    # both in one pass (the written-out head): the same nll bits (the same max, exps and sum), and the gradient as
    # exp(x - max) / sum x d: within the reference's bound too; ignored rows exactly 0
    nll_once, got_once = (a.asnumpy() for a in K.cross_entropy_with_grad(Tensor(x), Tensor(y), Tensor(d)))
    np.testing.assert_array_equal(nll_once, nll)
    assert np.abs(got_once - want).max() <= fp32_tol(np.abs(d).max(), 37)
    assert not got_once[~keep].any()


@needs_kernels
@pytest.mark.parametrize("r,c", [(128, 192), (130, 70), (1, 5), (64, 1)])  # whole 64 x 64 tiles (AVX2's 8 x 8
def test_transpose_moves_every_element_exactly(r, c, threads):  # register blocks), tails, a row, a column
    x = np.random.default_rng(4).standard_normal((r, c)).astype(np.float32)
    np.testing.assert_array_equal(K.transpose(Tensor(x)).asnumpy(), x.T)


def _ref_rope_heads(y, cos, sin, scale, hd):
    """[B·T, n·hd] -> [B, n, T, hd], RoPE'd (rotate-half) and scaled, in float64."""
    t = cos.shape[0]
    z = y.astype(np.float64).reshape(-1, t, y.shape[1] // hd, hd).transpose(0, 2, 1, 3)  # [B, n, T, hd]
    rot = np.concatenate([-z[..., hd // 2 :], z[..., : hd // 2]], axis=-1)
    return scale * (z * cos.astype(np.float64) + rot * sin.astype(np.float64))


@needs_kernels
@pytest.mark.parametrize("b,t,n,hd", [(2, 37, 3, 16), (1, 5, 9, 64), (3, 8, 2, 6)])  # odd T; SmolLM2's hd; hd/2 odd
def test_rope_to_heads_and_its_transpose(b, t, n, hd, threads):
    rng = np.random.default_rng(b * t * n + hd)
    y = rng.standard_normal((b * t, n * hd)).astype(np.float32)
    d = rng.standard_normal((b, n, t, hd)).astype(np.float32)
    cos, sin = (a[11 : 11 + t] for a in rope_tables(hd, 64, 10000.0))  # positions 11.., as a continued chunk
    scale = np.float32(hd**-0.5)
    args = (Tensor(cos), Tensor(sin), Tensor(np.array([scale], np.float32)))
    got = K.rope_heads(Tensor(y), *args).asnumpy()
    want = _ref_rope_heads(y, cos, sin, float(scale), hd)
    # each output: two fp32 products, a sum and the scale's product: within 4 roundings of the terms' magnitude
    bound = 4 * np.finfo(np.float32).eps * float(scale) * (np.abs(y).max() * (np.abs(cos).max() + np.abs(sin).max()))
    assert got.shape == (b, n, t, hd) and np.abs(got - want).max() <= bound
    back = K.rope_tokens(Tensor(d), *args).asnumpy()
    assert back.shape == (b * t, n * hd)
    # the transpose: <heads(y), d> == <y, tokens(d)> for every y (checked on the basis: the matrix itself)
    eye = np.eye(n * hd, dtype=np.float64)
    forward = np.stack([_ref_rope_heads(np.tile(e, (b * t, 1)), cos, sin, float(scale), hd) for e in eye])
    want_back = np.einsum("kbntd,bntd->btk", forward, d.astype(np.float64)).reshape(b * t, n * hd)
    bound = 4 * np.finfo(np.float32).eps * float(scale) * (np.abs(d).max() * (np.abs(cos).max() + np.abs(sin).max()))
    assert np.abs(back - want_back).max() <= bound


@needs_kernels
@pytest.mark.parametrize("tied", [True, False])
def test_head_matmul_gradients_through_the_transpose_match_mindspores(tied, monkeypatch):
    """FusedHeadMatMul: the logits as MatMul's, dx and dW within fp32 rounding of what autodiff of the plain MatMul
    gives (dW sums the N token rows in oneDNN's order for another product), and the build swaps it in exactly where
    MatMul runs oneDNN's AVX2 path (capped here through ONEDNN_MAX_CPU_ISA, as on an AVX2-only CPU)."""
    from model.cpu import matmul_isa
    from model.fused_cells import FusedHeadMatMul

    rng = np.random.default_rng(6)
    n, h, v = 70, 24, 131
    x, w, g = (rng.standard_normal(s).astype(np.float32) for s in ((n, h), (v, h), (n, v)))
    cell, plain = FusedHeadMatMul(K), ms.ops.MatMul(transpose_b=True)
    np.testing.assert_array_equal(cell(Tensor(x), Tensor(w)).asnumpy(), plain(Tensor(x), Tensor(w)).asnumpy())
    grads = [
        ms.grad(lambda a, b, f=f: (f(a, b) * Tensor(g)).sum(), grad_position=(0, 1))(Tensor(x), Tensor(w))
        for f in (cell, plain)
    ]
    (dx, dw), (want_dx, want_dw) = ([t.asnumpy() for t in pair] for pair in grads)
    assert np.abs(dx - want_dx).max() <= fp32_tol(np.abs(g).sum(1).max() * np.abs(w).max(), v)
    assert np.abs(dw - want_dw).max() <= fp32_tol(np.abs(g).sum(0).max() * np.abs(x).max(), n)
    assert np.abs(dw - g.T.astype(np.float64) @ x).max() <= fp32_tol(np.abs(g).sum(0).max() * np.abs(x).max(), n)
    cfg = ModelConfig.from_dict({**ModelConfig.from_name("tiny").to_dict(), "tie_embeddings": tied})
    for cap in ("AVX2", "AVX512_CORE"):
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        net = build_network("llama", cfg, seed=0, fused_kernels=True).net
        head = net.tied_matmul if tied else net.lm_head.matmul
        assert isinstance(head, FusedHeadMatMul) == (matmul_isa() == "avx2"), (cap, matmul_isa())


def _ref_attention(q, k, v):
    """float64 causal GQA attention (queries the last T of S keys): out, probabilities, k and v repeated per head."""
    rep, t, s = q.shape[1] // k.shape[1], q.shape[2], k.shape[2]
    kk, vv = (np.repeat(a, rep, 1).astype(np.float64) for a in (k, v))
    scores = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)
    scores = np.where(np.arange(s)[None, :] > np.arange(t)[:, None] + (s - t), -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ vv, p, kk, vv


@needs_kernels
@pytest.mark.parametrize("b,nh,nkv,t,s,hd", [(2, 4, 2, 70, 75, 24), (1, 3, 3, 130, 130, 16), (2, 2, 1, 5, 9, 7)])
def test_causal_attention_and_its_gradient(b, nh, nkv, t, s, hd, threads):
    """Against float64 numpy: GQA (heads sharing a kv head), queries the last T of S keys, T past one 64-query block,
    head dims below a vector and not a multiple of one; masked keys get probability exactly 0 (a key past its query
    moved nothing), and the log-sum-exp is the rows' own."""
    from model.fused_cells import FusedCausalAttention

    rng = np.random.default_rng(8)
    q = (rng.standard_normal((b, nh, t, hd)) * 0.6).astype(np.float32)
    k, v = rng.standard_normal((2, b, nkv, s, hd)).astype(np.float32)
    g = rng.standard_normal((b, nh, t, hd)).astype(np.float32)
    out, lse = (a.asnumpy() for a in K.causal_attention(Tensor(q), Tensor(k), Tensor(v)))
    want, p, kk, vv = _ref_attention(q, k, v)
    mag = np.abs(q).max() * np.abs(k).max() * hd  # a score's |terms| bound: softmax's argument error is eps x this
    assert np.abs(out - want).max() <= fp32_tol(np.abs(v).max() * (1 + mag), hd + s)
    scores = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)
    keep = np.arange(s)[None, :] <= np.arange(t)[:, None] + (s - t)
    want_lse = np.log(np.where(keep, np.exp(scores - scores.max(-1, keepdims=True)), 0).sum(-1)) + scores.max(-1)
    assert np.abs(lse - want_lse).max() <= fp32_tol(mag + np.abs(want_lse).max(), hd + s)
    v2 = v.copy()
    v2[:, :, -1] += 100.0  # the last key is visible only to the last query: the others must not move
    out2 = K.causal_attention(Tensor(q), Tensor(k), Tensor(v2))[0].asnumpy()
    np.testing.assert_array_equal(out2[:, :, :-1], out[:, :, :-1])
    cell = FusedCausalAttention(K)
    grads = ms.grad(lambda a, c, d: (cell(a, c, d)[0] * Tensor(g)).sum(), grad_position=(0, 1, 2))(
        Tensor(q), Tensor(k), Tensor(v)
    )
    dq, dk, dv = (a.asnumpy() for a in grads)
    gd, rep = g.astype(np.float64), nh // nkv
    dp = gd @ vv.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    sum_heads = lambda a: a.reshape(b, nkv, rep, s, hd).sum(2)  # noqa: E731  (a kv head's query heads)
    scale = np.abs(g).max() * (np.abs(v).max() + np.abs(want).max()) * max(np.abs(k).max(), np.abs(q).max()) * (1 + mag)
    n = 2 * hd + 2 * s + t * rep
    assert np.abs(dq - ds @ kk).max() <= fp32_tol(scale, n)
    assert np.abs(dk - sum_heads(ds.transpose(0, 1, 3, 2) @ q.astype(np.float64))).max() <= fp32_tol(scale * t, n)
    assert np.abs(dv - sum_heads(p.transpose(0, 1, 3, 2) @ gd)).max() <= fp32_tol(np.abs(g).max() * t * rep, n)


@needs_kernels
def test_results_do_not_depend_on_the_thread_count(monkeypatch):
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((2, 301, 48)).astype(np.float32)
    w, e = Tensor(np.ones(48, np.float32)), Tensor(np.array([1e-6], np.float32))
    q = rng.standard_normal((3, 6, 32, 16)).astype(np.float32)  # 3 query heads on each kv head (GQA): the
    kv = rng.standard_normal((2, 3, 2, 32, 16)).astype(np.float32)  # attention's dk and dv sum over them; 6 units
    dout = Tensor(rng.standard_normal(q.shape).astype(np.float32))
    outs = []
    y = rng.standard_normal((2 * 32, 6 * 16)).astype(np.float32)
    cos, sin = (Tensor(a[:32]) for a in rope_tables(16, 64, 10000.0))
    scale = Tensor(np.array([0.25], np.float32))
    counts = []
    for t in ("1", "2", "5"):
        counts.append(use_threads(monkeypatch, t))
        outs.append(_thread_outputs(x, dy, w, e, q, kv, dout, y, cos, sin, scale))
    assert len(set(counts)) == min(3, len(os.sched_getaffinity(0)))  # the counts did differ (where CPUs allow)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


@needs_kernels
def test_pieces_a_waiting_thread_takes_give_the_same_bits(monkeypatch):
    """One kernel thread (the trainer's count) with a thread that does what MindSpore's waiting pool threads do once
    `lend_idle_threads` hooks their waits (MsllmHelp in a loop): the pieces it takes give the bits the caller alone
    gives. Calls repeat until it has taken some: on 2 cores MindSpore's own threads spin beside the call too, so the
    helper gets a core only now and then; each call lasts several scheduler slices (~1 GFLOP of attention)."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU")
    use_threads(monkeypatch, "1")
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 8, 512, 64)).astype(np.float32)  # 2 x 4 (batch, kv head) units: 8 pieces
    kv = rng.standard_normal((2, 2, 4, 512, 64)).astype(np.float32)
    dout = Tensor(rng.standard_normal(q.shape).astype(np.float32))
    x, dy = rng.standard_normal((2, 2048, 96)).astype(np.float32)
    w, e = Tensor(rng.standard_normal(96).astype(np.float32)), Tensor(np.array([1e-6], np.float32))

    def outputs():
        att, lse = K.causal_attention(Tensor(q), Tensor(kv[0]), Tensor(kv[1]))
        grads = K.causal_attention_grad(Tensor(q), Tensor(kv[0]), Tensor(kv[1]), att, lse, dout)
        return [a.asnumpy() for a in (att, lse, *grads, *K.rms_norm_grad(Tensor(x), w, e, Tensor(dy)))]

    lib = ctypes.CDLL(K.lib)
    with helper(lib, False):
        alone = outputs()
    with helper(lib, True) as helped:
        for _ in range(40):
            for a, b in zip(outputs(), alone):
                np.testing.assert_array_equal(a, b)
            if helped() > 0:
                break
        assert helped() > 0  # the helper did take pieces of these calls


@contextlib.contextmanager
def helper(lib, on: bool):
    """With `on`, a thread that does what MindSpore's waiting pool threads do once `lend_idle_threads` hooks their
    waits: call MsllmHelp in a loop (MsllmHelpUntil); yields a function giving the pieces it ran so far."""
    lib.MsllmHelpedPieces.restype = ctypes.c_long
    before = lib.MsllmHelpedPieces()
    if not on:
        lib.MsllmLendIdleThreads(0)  # the caller alone (MindSpore's pool threads take no piece either)
        try:
            yield lambda: 0
        finally:
            lib.MsllmLendIdleThreads(int(bool(runtime._lent)))
        return
    flag = ctypes.c_int(0)
    lib.MsllmLendIdleThreads(1)  # on here even where this process's waits are not patched
    th = threading.Thread(target=lib.MsllmHelpUntil, args=(ctypes.byref(flag),))
    th.start()
    while flag.value != 1:  # the helper is in its loop (its start needs the GIL, which the ops may not release)
        time.sleep(0.001)
    try:
        yield lambda: lib.MsllmHelpedPieces() - before
    finally:
        flag.value = 2
        th.join()
        lib.MsllmLendIdleThreads(int(bool(runtime._lent)))  # as the process had it


def _thread_outputs(x, dy, w, e, q, kv, dout, y, cos, sin, scale):
    """Every threaded kernel once on the same operands (the thread-count test compares these bit for bit)."""
    dx, dw = K.rms_norm_grad(Tensor(x), w, e, Tensor(dy))
    att, lse = K.causal_attention(Tensor(q), Tensor(kv[0]), Tensor(kv[1]))
    grads = K.causal_attention_grad(Tensor(q), Tensor(kv[0]), Tensor(kv[1]), att, lse, dout)
    return (
        dx.asnumpy(),
        dw.asnumpy(),
        K.causal_softmax(Tensor(np.stack([x[:48], x[48:96]]))).asnumpy(),
        att.asnumpy(),
        lse.asnumpy(),
        *(a.asnumpy() for a in grads),
        K.rope_heads(Tensor(y), cos, sin, scale).asnumpy(),
        K.rope_tokens(Tensor(q), cos, sin, scale).asnumpy(),
    )


def _loss_and_grads(net, ids, labels):
    grad_fn = ms.value_and_grad(lambda x, y: net.loss(x, y), None, net.trainable_params())
    loss, grads = grad_fn(Tensor(ids), Tensor(labels))
    return float(loss), [g.asnumpy() for g in grads]


@needs_kernels
@pytest.mark.parametrize("cap", ["", "AVX2"])  # AVX2: the LM head's weight gradient through the transposed dlogits
def test_fused_model_matches_builtin_ops_forward_and_backward(cap, monkeypatch):
    if cap:
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    cfg = ModelConfig.from_name("tiny")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 33)).astype(np.int32)
    base, built = LlamaForCausalLM(cfg, seed=0), build_network("llama", cfg, seed=0, fused_kernels=True)
    fused = built.net
    assert built.kernels.fused and isinstance(fused.layers[0].mlp.swiglu, FusedSwiGLU)  # convert swapped the cells
    a, b = base(Tensor(ids)).asnumpy(), fused(Tensor(ids)).asnumpy()
    n = decoder_reduction(cfg, 33)  # the fused kernels sum the same terms as MindSpore's ops, in their own order
    assert np.abs(a - b).max() <= fp32_tol(np.abs(a).max(), n)
    labels = ids[:, 1:].copy()
    labels[0, :5] = -100  # ignored positions (a finetune prompt): the fused cross-entropy skips them too
    la, ga = _loss_and_grads(base, ids[:, :-1], labels)
    lb, gb = _loss_and_grads(fused, ids[:, :-1], labels)
    # the loss (~6.27) adds the log-sum-exp over the vocabulary and the mean over 2 x 32 positions; a gradient
    # passes the decoder's reductions again backward and sums a weight's over those positions
    assert abs(la - lb) <= fp32_tol(abs(la) + np.abs(a).max(), n + cfg.vocab_size + 64)
    for x, y in zip(ga, gb):
        assert np.abs(x - y).max() <= fp32_tol(max(np.abs(x).max(), 1e-6), 2 * n + cfg.vocab_size + 64)


def test_fallback_without_kernels_and_in_fp16(monkeypatch):
    cfg = ModelConfig.from_name("tiny")
    half = build_network("llama", cfg, seed=0, precision="fp16", fused_kernels=True)
    assert half.kernels.model == "off: fp16 compute (the fused kernels are fp32)" and half.kernels.optimizer
    import model.kernel_ops as kernel_ops

    monkeypatch.setattr(kernel_ops, "_train_ops", [])
    monkeypatch.setenv("MSLLM_FUSED_KERNELS", "0")  # as on a machine without g++: built-in ops, same results
    built = build_network("llama", cfg, seed=0, fused_kernels=True)
    assert built.kernels == Kernels("off: MSLLM_FUSED_KERNELS=0", False)
    net = built.net
    assert not isinstance(net.layers[0].mlp.swiglu, FusedSwiGLU)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9)).astype(np.int32)
    np.testing.assert_array_equal(net(Tensor(ids)).asnumpy(), LlamaForCausalLM(cfg, seed=0)(Tensor(ids)).asnumpy())


def test_build_without_a_compiler_gives_none(monkeypatch, tmp_path):
    import model.kernel_build as kernel_build

    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setattr(kernel_build, "_builds", {})
    assert kernel_build.build(kernel_build.TRAIN_SOURCE) is None
    assert kernel_build.kernel_path().startswith("off: no C++ compiler")
