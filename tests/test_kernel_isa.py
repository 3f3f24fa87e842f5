"""The native kernels' ISA bodies, their selection, and their build cache (model/cpu.py, model/kernel_build.py, simd.h).

Every body this CPU can run is called directly through ctypes (MindSpore's aot calling convention, no
graph) and compared with the scalar body, the reference. The bounds are derived from float32's unit
roundoff u = 2^-24 and each kernel's reduction length (both bodies err, so twice a one-sided bound), not
tuned to this machine. Skipped only where no C++ compiler exists; a compiler that fails to build them fails.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
from helpers import q8_0_activations

import model.kernel_build as kernel_build  # the build cache's private memo and helpers
from model.cpu import cpu_levels, matmul_isa, select_isa
from model.kernel_build import DECODE_SOURCE, TRAIN_SOURCE, build_kernel, kernel_path

CXX = shutil.which(os.environ.get("CXX", "g++"))
needs_cxx = pytest.mark.skipif(CXX is None, reason="no C++ compiler: the native kernels cannot be built here")
U = 2.0**-24  # float32 unit roundoff

X86_AVX512 = (
    "processor\t: 0\nflags\t\t: fpu sse2 ssse3 cx16 sse4_1 sse4_2 movbe popcnt xsave avx f16c lahf_lm abm "
    "fma bmi1 avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni\n"
)
X86_AVX2 = X86_AVX512.split("avx512f")[0] + "\n"  # a Zen 2 / Haswell: v3, no AVX-512
X86_OLD = "flags\t\t: fpu sse2 ssse3 sse4_1 sse4_2 popcnt\n"
ARM = "processor\t: 0\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm\n"


def test_probe_parses_cpuinfo_into_levels():
    assert cpu_levels(X86_AVX512, "x86_64") == ("avx512", "avx2", "scalar")
    assert cpu_levels(X86_AVX2, "x86_64") == ("avx2", "scalar")
    assert cpu_levels(X86_AVX2.replace(" movbe", ""), "x86_64") == ("scalar",)  # v3 needs all of its flags
    assert cpu_levels(X86_OLD, "x86_64") == ("scalar",)
    assert cpu_levels(ARM, "aarch64") == ("neon", "scalar")
    assert cpu_levels(ARM.replace(" atomics", ""), "aarch64") == ("scalar",)  # ARMv8.0: no armv8.2-a body
    assert cpu_levels("", "x86_64") == ("scalar",)
    assert cpu_levels(X86_AVX512, "riscv64") == ()


def test_matmul_isa_is_the_cpus_level_capped_as_onednn_caps_it():
    assert matmul_isa(X86_AVX512, "x86_64", "") == "avx512"
    assert matmul_isa(X86_AVX512, "x86_64", "avx512_core_vnni") == "avx512"
    assert matmul_isa(X86_AVX512, "x86_64", "AVX2") == "avx2"  # the benchmarks' --isa avx2
    assert matmul_isa(X86_AVX512, "x86_64", "AVX2_VNNI") == "avx2"
    assert matmul_isa(X86_AVX2, "x86_64", "") == "avx2"  # an AVX2-only CPU
    assert matmul_isa(X86_AVX2, "x86_64", "AVX512_CORE") == "avx2"  # a cap above the CPU changes nothing
    assert matmul_isa(X86_AVX512, "x86_64", "SSE41") == "scalar"
    assert matmul_isa(X86_OLD, "x86_64", "") == "scalar"
    assert matmul_isa(ARM, "aarch64", "") == ""


def test_override_forces_a_level_the_cpu_runs_and_refuses_others():
    assert select_isa("", X86_AVX512, "x86_64") == ("avx512", "")
    assert select_isa("avx2", X86_AVX512, "x86_64") == ("avx2", "")
    assert select_isa("scalar", ARM, "aarch64") == ("scalar", "")
    isa, why = select_isa("avx512", X86_AVX2, "x86_64")
    assert isa is None and "cannot run it (it runs avx2, scalar)" in why
    isa, why = select_isa("sse9", X86_AVX2, "x86_64")
    assert isa is None and "MSLLM_KERNEL_ISA=sse9 is not one of" in why
    assert select_isa("", X86_AVX2, "riscv64")[0] is None


# ----------------------------------------------------------------------------- calling the kernels directly


def _call(lib: str, name: str, *arrays: np.ndarray) -> int:
    """Call an aot kernel as MindSpore does: int f(nparam, params, ndims, shapes, dtypes, stream, extra)."""
    fn = getattr(ctypes.CDLL(lib), name)
    n = len(arrays)
    shapes = [(ctypes.c_int64 * max(a.ndim, 1))(*a.shape) for a in arrays]
    return fn(
        n,
        (ctypes.c_void_p * n)(*[a.ctypes.data for a in arrays]),
        (ctypes.c_int * n)(*[a.ndim for a in arrays]),
        (ctypes.POINTER(ctypes.c_int64) * n)(*[ctypes.cast(s, ctypes.POINTER(ctypes.c_int64)) for s in shapes]),
        (ctypes.c_char_p * n)(*[str(a.dtype).encode() for a in arrays]),
        None,
        None,
    )


def _lib(isa: str, source: Path = TRAIN_SOURCE, openmp: bool = False) -> str:
    b = build_kernel(source, openmp, isa=isa)
    assert b.lib, f"{source.name} did not build for {isa} although a compiler exists: {b.reason}"
    return b.lib


QEMU = shutil.which("qemu-x86_64")


@pytest.mark.integration
@pytest.mark.skipif(
    os.uname().machine != "x86_64" or QEMU is None, reason="needs an x86_64 host with qemu-x86_64 (Debian's qemu-user)"
)
def test_probe_follows_cpuid_where_cpuinfo_is_the_hosts():
    """Under qemu-user /proc/cpuinfo is the host's (AVX-512 here, perhaps) but CPUID is the emulated AVX2 core's:
    the probe must not pick a body that would fault (the run below would die of SIGILL in the kernel call)."""
    import subprocess
    import sys

    code = (
        "import ctypes, numpy as np, sys; sys.path.insert(0, sys.argv[1])\n"
        "from model.cpu import cpu_levels\n"
        "from model.kernel_build import build_kernel, TRAIN_SOURCE\n"
        "b = build_kernel(TRAIN_SOURCE)\n"
        "x = np.zeros((1, 4, 40), np.float32); y = np.full_like(x, np.nan); arrays = (x, y)\n"
        "shapes = [(ctypes.c_int64 * 3)(*a.shape) for a in arrays]\n"
        "rc = ctypes.CDLL(b.lib).CausalSoftmax(2, (ctypes.c_void_p * 2)(*[a.ctypes.data for a in arrays]), "
        "(ctypes.c_int * 2)(3, 3), (ctypes.POINTER(ctypes.c_int64) * 2)(*[ctypes.cast(s, "
        "ctypes.POINTER(ctypes.c_int64)) for s in shapes]), (ctypes.c_char_p * 2)(b'float32', b'float32'), "
        "None, None)\n"
        # keys end-aligned; a row of zeros softmaxes to 1/40 each: exp(0) = 1 exactly, one sum of 40 ones (exact)
        # and a division, so an ulp or two of 1/40, inside allclose's 1e-5 relative whatever the order
        "assert rc == 0 and np.allclose(y[0, 3], 1 / 40) and (y[0, 0, 37:] == 0).all(), (rc, y[0])\n"
        "print(','.join(cpu_levels()), b.isa, flush=True)\n"
    )
    python = os.path.realpath(getattr(sys, "_base_executable", sys.executable))  # the ELF, not a venv shim
    r = subprocess.run(
        [
            QEMU,
            "-cpu",
            "EPYC-Milan",
            "-0",
            sys.executable,
            python,
            "-c",
            code,
            str(Path(__file__).resolve().parents[1]),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MSLLM_KERNEL_ISA": ""},
    )
    assert r.returncode == 0, r.stderr[-2000:]
    levels, isa = r.stdout.split()
    assert levels == "avx2,scalar" and isa == "avx2"


def _run(isa: str, name: str, inputs, outputs) -> list[np.ndarray]:
    outs = [np.full(shape, np.nan, dt) for shape, dt in outputs]
    assert _call(_lib(isa), name, *inputs, *outs) == 0
    return outs


BODIES = [isa for isa in cpu_levels() if isa != "scalar"]


@needs_cxx
def test_library_reports_the_level_it_was_built_for(monkeypatch):
    for isa in cpu_levels():
        f = ctypes.CDLL(_lib(isa)).MsllmKernelIsa
        f.restype = ctypes.c_char_p
        assert f().decode() == isa
    monkeypatch.setenv("MSLLM_KERNEL_ISA", "scalar")  # what a benchmark of the scalar body does
    assert build_kernel(TRAIN_SOURCE).isa == "scalar" and kernel_path() == "scalar"


@needs_cxx
@pytest.mark.parametrize("isa", BODIES)
def test_every_body_matches_the_scalar_reference(isa):
    rng = np.random.default_rng(7)
    both = lambda *a: (_run(isa, *a), _run("scalar", *a))  # noqa: E731

    # causal softmax [N, T, S], S = 45 (tails at every width) with T < S; its gradient
    x = (rng.standard_normal((3, 13, 45)) * 4).astype(np.float32)
    (p,), (q,) = both("CausalSoftmax", [x], [(x.shape, np.float32)])
    s = x.shape[2]
    assert (np.abs(p - q) <= (2 * s + 8) * 2 * U * np.maximum(p, q)).all()  # exp 2u, sum s*u, divide u; both bodies
    assert ((p == 0) == (q == 0)).all()
    dp = rng.standard_normal(x.shape).astype(np.float32)
    (g,), (h,) = both("SoftmaxGrad", [q, dp], [(x.shape, np.float32)])
    dot = np.abs((q * dp).sum(-1, keepdims=True))
    assert (np.abs(g - h) <= (2 * s + 4) * 2 * U * q * (np.abs(dp).max(-1, keepdims=True) + dot) + 1e-37).all()

    # SwiGLU and its gradient, element-wise; |g| up to ~25: the sigmoid saturates both ways
    gate, up, d = (rng.standard_normal((3, 1037)) * [[6], [1], [1]]).astype(np.float32)
    (o,), (r,) = both("SwiGLU", [gate, up], [(gate.shape, np.float32)])
    assert (np.abs(o - r) <= 16 * U * np.abs(r) + 1e-30).all()  # exp 2u, 1 + e, divide, 3 products
    (dg, du), (rg, ru) = both("SwiGLUGrad", [gate, up, d], [(gate.shape, np.float32)] * 2)
    gd = gate.astype(np.float64)
    sg = 1 / (1 + np.exp(-gd))
    cancel = (np.abs(1 + gd) + np.abs(gd * sg)) / np.maximum(np.abs(1 + gd - gd * sg), 1e-30)  # (1 + g) - silu(g)
    assert (np.abs(dg - rg) <= (16 + 4 * cancel) * U * np.abs(rg) + 1e-30).all()
    assert (np.abs(du - ru) <= 16 * U * np.abs(ru) + 1e-30).all()

    # RMSNorm [N, H], H = 77, and its gradient (dweight sums N = 70 rows)
    n, hh = 70, 77
    xs = (rng.standard_normal((n, hh)) * 3).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(hh)).astype(np.float32)
    eps = np.array([1e-6], np.float32)
    dy = rng.standard_normal((n, hh)).astype(np.float32)
    (y,), (ry,) = both("RMSNorm", [xs, w, eps], [(xs.shape, np.float32)])
    assert (np.abs(y - ry) <= 2 * (hh + 6) * U * np.abs(ry)).all()
    (dx, dw), (rdx, rdw) = both("RMSNormGrad", [xs, w, eps, dy], [(xs.shape, np.float32), ((hh,), np.float32)])
    inv = 1 / np.sqrt((xs.astype(np.float64) ** 2).mean(-1, keepdims=True))
    terms = inv * np.abs(dy * w) + inv * np.abs(xs) * inv**2 * np.abs(dy * w * xs).mean(-1, keepdims=True)
    assert (np.abs(dx - rdx) <= 2 * (2 * hh + 10) * U * terms).all()
    assert (np.abs(dw - rdw) <= 2 * (n + hh + 10) * U * (np.abs(dy * xs) * inv).sum(0)).all()

    # cross-entropy [N, V], V = 301, with an ignored row, and its gradient
    v = 301
    logits = (rng.standard_normal((9, v)) * 5).astype(np.float32)
    labels = rng.integers(0, v, 9).astype(np.int32)
    labels[4] = -100
    (nll, lse), (rn, rl) = both("CrossEntropy", [logits, labels], [((9,), np.float32)] * 2)
    assert (np.abs(lse - rl) <= 2 * (v + 4) * U + 2 * U * np.abs(rl)).all()
    assert (np.abs(nll - rn) <= 2 * (v + 4) * U + 4 * U * (np.abs(rl) + np.abs(rn))).all() and nll[4] == rn[4] == 0
    dn = rng.standard_normal(9).astype(np.float32)
    (gl,), (rgl,) = both("CrossEntropyGrad", [logits, labels, rl, dn], [(logits.shape, np.float32)])
    mag = np.abs(logits) + np.abs(rl)[:, None]  # x - lse: an absolute error of u * mag in exp's argument
    assert (np.abs(gl - rgl) <= (8 + 2 * mag) * 2 * U * (np.abs(rgl) + np.abs(dn)[:, None])).all()
    # both in one pass: exp(x - max) / sum against the scalar body's, the sum's rounding (v terms) on top
    outs = [((9,), np.float32), (logits.shape, np.float32)]
    (n1, g1), (rn1, rg1) = both("CrossEntropyWithGrad", [logits, labels, dn], outs)
    assert (np.abs(n1 - rn1) <= 2 * (v + 4) * U + 4 * U * (np.abs(rl) + np.abs(rn1))).all() and n1[4] == rn1[4] == 0
    assert (np.abs(g1 - rg1) <= (v + 8 + 2 * mag) * 2 * U * (np.abs(rg1) + np.abs(dn)[:, None])).all()

    # the AdamW update: the same correctly rounded operations per element in every body: the same bits
    k = 1001
    pw, grad = rng.standard_normal((2, k)).astype(np.float32)
    m0, v0 = rng.standard_normal(k).astype(np.float32), np.abs(rng.standard_normal(k)).astype(np.float32)
    scal = [np.array(a, np.float32) for a in (1e-3, 0.9, 0.95, 1e-8, 0.1, 0.5, 1.0)]
    res = {}
    for body in (isa, "scalar"):
        arrs = [pw.copy(), grad, m0.copy(), v0.copy(), np.array([0], np.int32), *scal, np.zeros(1, np.float32)]
        assert _call(_lib(body), "ZeroAdamW", *arrs) == 0
        res[body] = arrs[:4]
    for a, b in zip(res[isa], res["scalar"]):
        np.testing.assert_array_equal(a, b)

    # the transpose: whole 64 x 64 tiles (8 x 8 register blocks where the body has AVX2) and tails; exact
    xt = rng.standard_normal((130, 200)).astype(np.float32)
    (tt,), (rt,) = both("Transpose", [xt], [((200, 130), np.float32)])
    np.testing.assert_array_equal(tt, xt.T)
    np.testing.assert_array_equal(rt, xt.T)

    # RoPE to heads and back: two products, a sum and the scale per element (a body may fuse a product into the sum)
    bt, nr, hr, tr = 3 * 11, 3, 20, 11
    yr = rng.standard_normal((bt, nr * hr)).astype(np.float32)
    ang = rng.uniform(0, 6.3, (tr, hr))
    cr, sr = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    sc = np.array([0.3], np.float32)
    (hh_,), (rh,) = both("RopeHeads", [yr, cr, sr, sc], [((3, nr, tr, hr), np.float32)])
    assert np.abs(hh_ - rh).max() <= 4 * U * 0.3 * 2 * np.abs(yr).max()
    (tk,), (rtk,) = both("RopeTokens", [rh, cr, sr, sc], [((bt, nr * hr), np.float32)])
    assert np.abs(tk - rtk).max() <= 4 * U * 0.3 * 2 * np.abs(rh).max()

    # causal attention [B, nh, T, hd] over [B, nkv, S, hd]: GQA, T past one 64-query block, hd 20 (vector tails)
    b, nh, nkv, t, s, hd = 2, 4, 2, 70, 73, 20
    q = (rng.standard_normal((b, nh, t, hd)) * 0.5).astype(np.float32)
    (
        k,
        v,
    ) = rng.standard_normal((2, b, nkv, s, hd)).astype(np.float32)
    (o, lse), (ro, rlse) = both("CausalAttention", [q, k, v], [(q.shape, np.float32), ((b, nh, t), np.float32)])
    mag = np.abs(q).max() * np.abs(k).max() * hd  # |scores| bound: exp's argument is off by eps x this
    assert np.abs(o - ro).max() <= 4 * (hd + s + mag) * U * np.abs(v).max()
    assert np.abs(lse - rlse).max() <= 4 * (hd + s + mag) * U * (1 + np.abs(rlse).max())
    do = rng.standard_normal(q.shape).astype(np.float32)
    grads = both(
        "CausalAttentionGrad",
        [q, k, v, ro, rlse, do],
        [(q.shape, np.float32), (k.shape, np.float32), (k.shape, np.float32)],
    )
    bound = 4 * (2 * hd + 2 * s + t * 2 + mag) * U * np.abs(do).max() * (1 + mag) * t
    for got, want in zip(*grads):
        assert np.abs(got - want).max() <= bound * max(np.abs(v).max(), np.abs(k).max(), np.abs(q).max())


@needs_cxx
@pytest.mark.parametrize("isa", BODIES)
def test_decode_gemv_matches_the_scalar_reference(isa):
    rng = np.random.default_rng(3)
    rows, n = 37, 333
    wm, x = rng.standard_normal((rows, n)).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    out = {}
    for body in (isa, "scalar"):
        f = ctypes.CDLL(_lib(body, DECODE_SOURCE, openmp=True)).Gemv
        f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        y = np.zeros(rows, np.float32)
        f(wm.ctypes.data, x.ctypes.data, y.ctypes.data, rows, n, 1)
        out[body] = y
    assert (np.abs(out[isa] - out["scalar"]) <= 2 * n * U * np.abs(wm * x).sum(1)).all()


@needs_cxx
@pytest.mark.parametrize("isa", cpu_levels())
def test_q8_0_gemv_is_ggmls_integer_dot_in_every_body(isa):
    """decode_kernel.cc GemvQ8 (the Q8_0 decode GEMV: Q8_0 weights times Q8_0-quantized activations) in each body:
    the activations' int8 values are exactly ggml's (tests: q8_0_activations), each block's 32 products an exact
    int32 sum, and y within the float32 rounding of its n/32 block terms (scale products and their sum; twice the
    recursive-summation bound over nb + 8 terms, 8 for the lanes). Rows 37 (not a 4-row multiple), n 320; a block of
    zeros in x (scale 0) and a weight block at -128 (ggml's quantizer never writes it; a hub file may)."""
    import gguf

    from model.fused_decode import q8_0_blocks

    rng = np.random.default_rng(11)
    rows, n = 37, 320
    wm = rng.standard_normal((rows, n)).astype(np.float32)
    x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n))).astype(np.float32)
    x[64:96] = 0
    blocks = np.ascontiguousarray(q8_0_blocks(wm))
    raw = blocks.view(np.uint8).reshape(rows, n // 32, 34)
    raw[5, 2, 2 + 7] = 0x80  # qs[7] of row 5's third block: -128
    d_w = raw[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [rows, nb]
    q_w = raw[:, :, 2:].copy().view(np.int8).astype(np.int64)  # [rows, nb, 32]
    q_x, d_x = q8_0_activations(x)
    isum = (q_w * q_x.reshape(1, -1, 32)).sum(2)  # exact
    scale = (d_w * d_x[None, :]).astype(np.float32)  # float32 products, as the kernel's
    terms = scale.astype(np.float64) * isum
    want = terms.sum(1)
    bound = 2 * (n // 32 + 8) * U * (np.abs(scale) * np.abs(q_w * q_x.reshape(1, -1, 32)).sum(2)).sum(1)
    assert gguf.GGMLQuantizationType.Q8_0 and (np.abs(q_x) <= 127).all()
    for body in (isa, "scalar"):
        f = ctypes.CDLL(_lib(body, DECODE_SOURCE, openmp=True)).GemvQ8
        f.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
        for threads in (1, 2):
            y = np.full(rows, np.nan, np.float32)
            assert f(raw.ctypes.data, x.ctypes.data, y.ctypes.data, rows, n, threads) == 0
            assert (np.abs(y - want) <= bound).all(), (body, threads, np.abs(y - want).max(), bound.min())
    # the float path's products (x unquantized) differ by the activations' rounding: the test can tell them apart
    exact = (d_w[:, :, None] * q_w * x.reshape(1, -1, 32)).sum((1, 2))
    assert (np.abs(exact - want) > 10 * bound).any()
    assert f(raw.ctypes.data, x.ctypes.data, y.ctypes.data, rows, n - 1, 1) == 3  # not whole blocks: refused


@needs_cxx
@pytest.mark.parametrize("isa", BODIES)
def test_chunk_attention_matches_the_scalar_reference(isa):
    """decode_kernel.cc ChunkAttention (the prefill's RoPE + cache write + attention) in each SIMD body against the
    scalar one: the same cache rows, and outputs within the reordered sums' rounding (scores over hd terms, the
    softmax and the weighted values over up to P slots, the polynomial exp: ~1 ulp each)."""
    rng = np.random.default_rng(5)
    nkv, n_rep, hd, s, t, start = 3, 3, 64, 96, 13, 37  # 13: a partial 4-query block; P = 50 slots: a partial vector
    ang = np.arange(s)[:, None] * (1e-2 ** (np.arange(hd // 2) / (hd // 2)))[None, :]
    cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
    q = rng.standard_normal((t, nkv * n_rep * hd)).astype(np.float32)
    k = rng.standard_normal((t, nkv * hd)).astype(np.float32)
    v = rng.standard_normal((t, nkv * hd)).astype(np.float32)
    caches = rng.standard_normal((2, nkv, s, hd)).astype(np.float32)
    res = {}
    for body in (isa, "scalar"):
        kc, vc = caches[0].copy(), caches[1].copy()
        out = np.full((t, nkv * n_rep * hd), np.nan, np.float32)
        lib = _lib(body, DECODE_SOURCE, openmp=True)
        assert (
            _call(
                lib,
                "ChunkAttention",
                q,
                k,
                v,
                np.array(start, np.int32),
                cos,
                sin,
                kc,
                vc,
                np.array([0.125, 2], np.float32),
                out,
            )
            == 0
        )
        res[body] = (kc, vc, out)
    np.testing.assert_array_equal(res[isa][1], res["scalar"][1])  # v rows are copied
    # RoPE is elementwise (k * cos +- k' * sin): two products and a sum, a few roundings of |k|, no reduction
    np.testing.assert_allclose(res[isa][0], res["scalar"][0], rtol=0, atol=4 * U * np.abs(k).max())
    bound = 4 * (hd + start + t) * U * np.abs(v).max()
    assert np.isfinite(res[isa][2]).all() and np.abs(res[isa][2] - res["scalar"][2]).max() <= bound


def _whole_model(rng, L=2, V=37, H=40, nh=4, nkv=2, hd=10, F=52, S=24):
    """A random LLaMA for decode_kernel.cc's whole-model ops (widths that are not whole vectors or 4-row blocks):
    (weights in the ops' operand order after `consts`, caches [2, L, nkv, S, hd])."""
    ang = np.arange(S)[:, None] * (1e-2 ** (np.arange(hd // 2) / (hd // 2)))[None, :]
    cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # noqa: E731
    ones = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731
    weights = [w(V, H) * np.sqrt(H), ones(H), w(V, H), cos, sin]
    for _ in range(L):
        weights += [
            ones(H),
            w(nh * hd, H),
            w(nkv * hd, H),
            w(nkv * hd, H),
            w(H, nh * hd),
            ones(H),
            w(F, H),
            w(F, H),
            w(H, F),
        ]
    return weights, rng.standard_normal((2, L, nkv, S, hd)).astype(np.float32)


@needs_cxx
@pytest.mark.parametrize("isa", BODIES)
def test_prefill_step_matches_decode_steps_and_the_scalar_body(isa):
    """decode_kernel.cc PrefillStep (a prompt chunk through the whole model, GEMMs over the chunk) against DecodeStep
    run token by token from the same caches, and against its own scalar body: the same cache rows and logits of the
    chosen row, within the rounding of reordered fp32 sums (per layer: reductions over H, F and the P visible
    slots, ~1 ulp of the magnitude each, relative; 8x for the two sides' errors and the exp / rsqrt); the cache
    slots outside the chunk's rows 0..last untouched (the rows past `last`, a short prompt's padding, are not
    computed, so padding may pass the cache); a row `last` past the cache, a `last` outside the chunk and a token
    outside the vocabulary refused (4) before anything is written."""
    rng = np.random.default_rng(7)
    weights, caches = _whole_model(rng)
    L, S, V, H, F = 2, caches.shape[3], weights[0].shape[0], weights[0].shape[1], 52
    consts = np.array([1e-5, 10**-0.5, 3], np.float32)
    start, T = 3, 7  # a chunk after three cached slots; T = 7: a partial 4-token block
    tokens = rng.integers(0, V, (1, T)).astype(np.int32)

    def prefill(lib, last, toks=tokens, at=start):
        kv = caches.copy()
        logits = np.full((1, V), np.nan, np.float32)
        rc = _call(lib, "PrefillStep", toks, np.array([at, last], np.int32), consts, *weights, *kv[0], *kv[1], logits)
        return rc, kv, logits

    def decode(lib):
        kv, out = caches.copy(), []
        for i in range(T):
            logits = np.full((1, V), np.nan, np.float32)
            assert (
                _call(
                    lib,
                    "DecodeStep",
                    tokens[:, i : i + 1].copy(),
                    np.array(start + i, np.int32),
                    consts,
                    *weights,
                    *kv[0],
                    *kv[1],
                    logits,
                )
                == 0
            )
            out.append(logits[0])
        return kv, np.stack(out)

    lib = _lib(isa, DECODE_SOURCE, openmp=True)
    kv_dec, logits_dec = decode(lib)
    bound = lambda ref: 8 * L * (H + F + start + T) * U * np.abs(ref).max()  # noqa: E731
    for last in (0, T - 1):
        rc, kv, logits = prefill(lib, last)
        assert rc == 0 and np.isfinite(logits).all()
        np.testing.assert_array_equal(kv[:, :, :, :start], caches[:, :, :, :start])  # slots before the chunk
        end = start + last + 1
        np.testing.assert_array_equal(kv[:, :, :, end:], caches[:, :, :, end:])  # and after row `last`
        assert np.abs(kv[:, :, :, :end] - kv_dec[:, :, :, :end]).max() <= bound(kv_dec)
        assert np.abs(logits[0] - logits_dec[last]).max() <= bound(logits_dec[last])
        rc, kv_s, logits_s = prefill(_lib("scalar", DECODE_SOURCE, openmp=True), last)
        assert rc == 0 and np.abs(logits - logits_s).max() <= bound(logits_s) and np.abs(kv - kv_s).max() <= bound(kv_s)
    # a chunk whose padding (the rows past `last`) would pass the cache: those rows are not computed, so it is fine
    rc, kv, logits = prefill(lib, T - 2, at=S - T + 1)
    assert rc == 0 and np.isfinite(logits).all()
    np.testing.assert_array_equal(kv[:, :, :, : S - T + 1], caches[:, :, :, : S - T + 1])
    for rc, kv, logits in (
        prefill(lib, T),
        prefill(lib, -1),
        prefill(lib, T - 1, at=S - T + 1),  # row `last` past the cache
        prefill(lib, 0, toks=np.where(np.arange(T) == 2, V, tokens).astype(np.int32)),
    ):
        assert rc == 4 and np.array_equal(kv, caches) and np.isnan(logits).all()


def _as_dtype(weights, dtype):
    """`_whole_model`'s weights with the matrices (embedding, LM head, each layer's seven projections) in `dtype`."""
    mat = lambda i: i in (0, 2) or (i >= 5 and (i - 5) % 9 not in (0, 5))  # noqa: E731
    return [w.astype(dtype) if mat(i) else w for i, w in enumerate(weights)]


@needs_cxx
@pytest.mark.parametrize("isa", cpu_levels())
@pytest.mark.parametrize("dtype,H", [(np.float32, 40), (np.float32, 48), (np.float16, 40)])
def test_batch_decode_step_is_each_rows_decode_step_in_every_body(isa, dtype, H):
    """decode_kernel.cc BatchDecodeStep (one token of each of B sequences, caches [NS, nkv, S, hd], a slot each):
    every row's logits and the cache rows it writes equal, bit for bit, DecodeStep run on that sequence alone in the
    same body (each row summed in DecodeStep's order; widths that are not whole vectors or 4-row groups, and H = 48,
    whose rows take AVX-512's aligned 4-row path; 7 rows: whole register-blocked passes of several vectors and the
    rows left over; float32 and binary16 weights); a slot not in the step is untouched. PrefillStep with
    [start, last, slot] writes that slot exactly as it writes a cache of its own. Two rows in one slot, a position
    past the cache or more rows than slots are refused before anything is written."""
    rng = np.random.default_rng(11)
    weights, caches = _whole_model(rng, H=H)
    weights = _as_dtype(weights, dtype)
    L, nkv, S, hd = caches.shape[1:]
    V = weights[0].shape[0]
    consts = np.array([1e-5, 10**-0.5, 3], np.float32)
    NS = 8
    slots = rng.standard_normal((2, L, NS, nkv, S, hd)).astype(np.float32)
    where = [[2, 5], [0, S - 1], [1, 0], [6, 7], [4, 11], [3, 1], [5, 20]]
    rows = np.array(where, np.int32)  # (slot, position); slot 7 sits out
    tokens = rng.integers(0, V, len(rows)).astype(np.int32)
    lib = _lib(isa, DECODE_SOURCE, openmp=True)

    def batch(toks, where):
        kv, logits = slots.copy(), np.full((len(toks), V), np.nan, np.float32)
        return _call(lib, "BatchDecodeStep", toks, where, consts, *weights, *kv[0], *kv[1], logits), kv, logits

    rc, kv, logits = batch(tokens, rows)
    assert rc == 0
    for b, (slot, pos) in enumerate(rows):
        one, out = slots[:, :, slot].copy(), np.full((1, V), np.nan, np.float32)
        args = (tokens[b : b + 1].reshape(1, 1), np.array(pos, np.int32), consts, *weights, *one[0], *one[1], out)
        assert _call(lib, "DecodeStep", *args) == 0
        np.testing.assert_array_equal(logits[b], out[0], err_msg=f"row {b}")
        np.testing.assert_array_equal(kv[:, :, slot], one, err_msg=f"slot {slot}")
    np.testing.assert_array_equal(kv[:, :, 7], slots[:, :, 7])
    chunk = rng.integers(0, V, (1, 6)).astype(np.int32)
    one, out = slots[:, :, 1].copy(), np.full((1, V), np.nan, np.float32)
    assert _call(lib, "PrefillStep", chunk, np.array([2, 5], np.int32), consts, *weights, *one[0], *one[1], out) == 0
    kv, got = slots.copy(), np.full((1, V), np.nan, np.float32)
    assert _call(lib, "PrefillStep", chunk, np.array([2, 5, 1], np.int32), consts, *weights, *kv[0], *kv[1], got) == 0
    np.testing.assert_array_equal(got, out)
    np.testing.assert_array_equal(kv[:, :, 1], one)
    np.testing.assert_array_equal(np.delete(kv, 1, axis=2), np.delete(slots, 1, axis=2))
    for toks, where, code in (
        (tokens[:2], np.array([[1, 3], [1, 4]], np.int32), 4),  # one slot twice
        (tokens[:1], np.array([[0, S]], np.int32), 4),  # past the cache
        (tokens[:1], np.array([[NS, 0]], np.int32), 4),  # no such slot
        (rng.integers(0, V, NS + 1).astype(np.int32), np.zeros((NS + 1, 2), np.int32), 3),  # more rows than slots
    ):
        rc, kv, logits = batch(toks, where)
        assert rc == code and np.array_equal(kv, slots) and np.isnan(logits).all(), (where.tolist(), rc)


@needs_cxx
@pytest.mark.parametrize("isa", cpu_levels())
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_packed_prefill_is_each_prompts_prefill_step(isa, dtype):
    """decode_kernel.cc PackedPrefillStep (several prompts in one pass: one GEMM over all their rows, each prompt's
    own attention over its slot): each prompt's logits and cache rows equal, bit for bit, PrefillStep on that prompt
    alone in the same body; slots not in the list, and a prompt's slots past its tokens, untouched; the output rows
    past the list untouched. Two prompts in one slot, more tokens than the chunk, a position past the cache, a token
    outside the vocabulary or an empty list are refused (4) before anything is written."""
    rng = np.random.default_rng(5)
    weights, _ = _whole_model(rng, H=48)
    weights = _as_dtype(weights, dtype)
    L, V, NS, S, nkv, hd = 2, weights[0].shape[0], 6, 24, 2, 10
    consts = np.array([1e-5, 10**-0.5, 3], np.float32)
    slots = rng.standard_normal((2, L, NS, nkv, S, hd)).astype(np.float32)
    prompts = [(4, 0, 5), (1, 3, 1), (0, 9, 7), (5, 0, 13)]  # (slot, start, n): slots 2 and 3 sit out
    P, K = 32, 5
    toks = rng.integers(0, V, P).astype(np.int32)
    table = np.zeros((K, 3), np.int32)
    table[: len(prompts)] = prompts
    lib = _lib(isa, DECODE_SOURCE, openmp=True)

    def packed(tokens, where):
        kv, out = slots.copy(), np.full((len(where), V), np.nan, np.float32)
        return (
            _call(lib, "PackedPrefillStep", tokens.reshape(1, -1), where, consts, *weights, *kv[0], *kv[1], out),
            kv,
            out,
        )

    rc, kv, out = packed(toks, table)
    assert rc == 0
    at = 0
    for i, (slot, start, n) in enumerate(prompts):
        alone, one = np.full((1, V), np.nan, np.float32), slots.copy()
        where = np.array([start, n - 1, slot], np.int32)
        assert _call(lib, "PrefillStep", toks[None, at : at + n], where, consts, *weights, *one[0], *one[1], alone) == 0
        np.testing.assert_array_equal(out[i], alone[0], err_msg=f"prompt {i}")
        np.testing.assert_array_equal(kv[:, :, slot], one[:, :, slot], err_msg=f"slot {slot}")
        np.testing.assert_array_equal(kv[:, :, slot, :, start + n :], slots[:, :, slot, :, start + n :])
        at += n
    assert np.isnan(out[len(prompts) :]).all()
    np.testing.assert_array_equal(kv[:, :, 2:4], slots[:, :, 2:4])
    bad_token = toks.copy()
    bad_token[3] = V
    for tokens, where in (
        (toks, np.array([[1, 0, 4], [1, 5, 2], [0, 0, 0]], np.int32)),  # one slot twice
        (toks, np.array([[1, 0, 20], [2, 0, 13], [0, 0, 0]], np.int32)),  # 33 tokens in a chunk of 32
        (toks, np.array([[1, S - 2, 3], [0, 0, 0]], np.int32)),  # past the cache
        (toks, np.array([[NS, 0, 3], [0, 0, 0]], np.int32)),  # no such slot
        (bad_token, np.array([[1, 0, 5], [0, 0, 0]], np.int32)),  # a token outside the vocabulary
        (toks, np.zeros((2, 3), np.int32)),  # no prompt
    ):
        rc, kv, out = packed(tokens, where)
        assert rc == 4 and np.array_equal(kv, slots) and np.isnan(out).all(), where.tolist()


# ----------------------------------------------------------------------------- operand checks in the kernels


@needs_cxx
@pytest.mark.parametrize("isa", cpu_levels())
def test_kernels_refuse_bad_operands_before_touching_memory(isa):
    lib = _lib(isa)
    f32 = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    # T > S: the queries would index keys past the row; an error, not an out-of-bounds write
    assert _call(lib, "CausalSoftmax", f32(2, 9, 5), f32(2, 9, 5)) == 3
    assert _call(lib, "SoftmaxGrad", f32(2, 9, 5), f32(2, 9, 5), f32(2, 9, 5)) == 3
    assert _call(lib, "CausalSoftmax", f32(2, 5, 9), f32(2, 5, 8)) == 3  # output smaller than input
    assert _call(lib, "CausalSoftmax", f32(2, 5, 9).astype(np.float64), f32(2, 5, 9)) == 2
    assert _call(lib, "RMSNorm", f32(4, 8), f32(7), f32(1), f32(4, 8)) == 3  # weight of the wrong width
    assert _call(lib, "RMSNormGrad", f32(4, 8), f32(8), f32(1), f32(4, 7), f32(4, 8), f32(8)) == 3
    assert _call(lib, "SwiGLU", f32(4, 8), f32(4, 9), f32(4, 8)) == 3
    assert _call(lib, "SwiGLUGrad", f32(4, 8), f32(4, 8), f32(4, 8), f32(4, 8), f32(3, 8)) == 3
    assert _call(lib, "CrossEntropy", f32(4, 8), np.zeros(4, np.float32), f32(4), f32(4)) == 2  # labels not int32
    assert _call(lib, "CrossEntropy", f32(4, 8), np.zeros(5, np.int32), f32(4), f32(4)) == 3
    labels4 = np.zeros(4, np.int32)
    assert _call(lib, "CrossEntropyWithGrad", f32(4, 8), labels4, f32(4), f32(4)) == 1  # no d logits operand
    assert _call(lib, "CrossEntropyWithGrad", f32(4, 8), labels4, f32(4), f32(4), f32(4, 7)) == 3  # d logits' shape
    assert _call(lib, "CrossEntropyWithGrad", f32(4, 8), labels4, f32(3), f32(4), f32(4, 8)) == 3  # dnll [N]
    assert _call(lib, "SwiGLU", f32(4), f32(4)) == 1
    assert _call(lib, "Transpose", f32(4, 8), f32(4, 8)) == 3  # the output not [C, R]
    assert _call(lib, "RopeHeads", f32(6, 16), f32(4, 8), f32(4, 8), f32(1), f32(1, 2, 4, 8)) == 3  # 6 rows, T = 4
    assert _call(lib, "RopeHeads", f32(8, 16), f32(4, 8), f32(4, 8), f32(1), f32(2, 2, 4, 9)) == 3  # output's hd
    assert _call(lib, "RopeTokens", f32(1, 2, 4, 7), f32(4, 7), f32(4, 7), f32(1), f32(4, 14)) == 3  # odd hd
    assert _call(lib, "RopeTokens", f32(1, 2, 4, 8), f32(4, 8), f32(4, 8), f32(1), f32(4, 8)) == 3  # output too small
    assert (
        _call(lib, "CausalAttention", f32(1, 3, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 3, 4, 8), f32(1, 3, 4))
        == 3
    )  # 3 query heads on 2 kv heads
    assert (
        _call(lib, "CausalAttention", f32(1, 2, 5, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 5, 8), f32(1, 2, 5))
        == 3
    )  # T > S
    assert (
        _call(lib, "CausalAttention", f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 4, 8), f32(1, 2, 3))
        == 3
    )  # lse too small


# ----------------------------------------------------------------------------- the build cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    d = tmp_path / "kcache"
    monkeypatch.setenv("MSLLM_KERNEL_CACHE", str(d))
    monkeypatch.setattr(kernel_build, "_builds", {})
    return d


SMALL = (
    '#include "simd.h"\n'
    'extern "C" const char *MsllmKernelIsa() { return MSLLM_ISA; }\n'
    'extern "C" int Two() { return 2; }\n'
)


@pytest.fixture
def small_source(tmp_path):
    p = tmp_path / "small_kernel.cc"
    p.write_text(SMALL)
    return p


@needs_cxx
@pytest.mark.parametrize("damage", ["truncated", "random bytes"])
def test_a_corrupt_cached_library_is_rebuilt(cache, small_source, damage, capfd):
    first = build_kernel(small_source, isa="scalar")
    lib = Path(first.lib)
    good = lib.read_bytes()
    assert (lib.parent / (lib.name + ".sha256")).read_text().split()[0] == kernel_build._sha256(lib)
    lib.write_bytes(good[: len(good) // 3] if damage == "truncated" else os.urandom(len(good)))
    kernel_build._builds.clear()  # a new process
    capfd.readouterr()
    again = build_kernel(small_source, isa="scalar")
    err = capfd.readouterr().err
    assert again.lib == first.lib
    assert (lib.parent / (lib.name + ".sha256")).read_text().split()[0] == kernel_build._sha256(lib)
    assert ctypes.CDLL(again.lib).Two() == 2
    lines = [ln for ln in err.splitlines() if "does not match its checksum" in ln]
    assert len(lines) == 1 and str(lib) in lines[0]


@needs_cxx
def test_a_missing_checksum_is_rebuilt_too(cache, small_source):
    lib = Path(build_kernel(small_source, isa="scalar").lib)
    (lib.parent / (lib.name + ".sha256")).unlink()
    kernel_build._builds.clear()
    assert build_kernel(small_source, isa="scalar").lib == str(lib)
    assert (lib.parent / (lib.name + ".sha256")).is_file()


def _fake_cxx(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "fake-g++"
    p.write_text(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'fake-g++ 0.1'; exit 0; fi\nfor a; do out=$a; done\n" + body
    )  # the last argument is after -o
    p.chmod(0o755)
    return p


@pytest.mark.parametrize(
    "body,why",
    [
        ('head -c 4096 /dev/urandom > "$out"; exit 0\n', "not an ELF file"),
        ('printf "\\177ELF garbage" > "$out"; exit 0\n', "does not load"),
    ],
)
def test_a_compiler_that_writes_garbage_is_not_loaded(cache, small_source, tmp_path, monkeypatch, body, why):
    monkeypatch.setenv("CXX", str(_fake_cxx(tmp_path, body)))
    b = build_kernel(small_source, isa="scalar")
    assert b.lib is None and why in b.reason and "exited 0" in b.reason
    assert not list(cache.glob("*.so"))  # nothing cached


@needs_cxx
def test_a_library_without_the_kernels_functions_is_not_loaded(cache, small_source, tmp_path, monkeypatch):
    # a real shared library, but not of this source: it lacks Two()
    src = tmp_path / "other.cc"
    src.write_text('extern "C" const char *MsllmKernelIsa() { return "scalar"; }\n')
    monkeypatch.setenv("CXX", str(_fake_cxx(tmp_path, f'{CXX} -shared -fPIC {src} -o "$out"\n')))
    b = build_kernel(small_source, isa="scalar")
    assert b.lib is None and "lacks its functions" in b.reason and "Two" in b.reason


def test_a_failed_build_says_why_with_the_compilers_stderr(cache, small_source, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CXX", str(_fake_cxx(tmp_path, 'echo "small_kernel.cc:3: error: boom" >&2; exit 1\n')))
    b = build_kernel(small_source, isa="scalar")
    assert b.lib is None and "failed to build small_kernel.cc" in b.reason and "error: boom" in b.reason
    assert b.path.startswith("off: ") and "error: boom" in capfd.readouterr().err


def test_no_compiler_is_off_with_a_reason(cache, small_source, tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    b = build_kernel(small_source, isa="scalar")
    assert b.lib is None and "no C++ compiler" in b.reason


def test_a_cache_others_can_write_is_refused(cache, small_source):
    cache.mkdir(mode=0o700)
    cache.chmod(0o777)
    b = build_kernel(small_source, isa="scalar")
    assert b.lib is None and "writable by other users" in b.reason and str(cache) in b.reason
    cache.chmod(0o700)
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_the_compiler_version_is_in_the_cache_key(cache, small_source, tmp_path, monkeypatch):
    cxx = _fake_cxx(tmp_path, "exit 1\n")
    monkeypatch.setenv("CXX", str(cxx))
    key = lambda: kernel_build._cache_key(small_source, False, "scalar", str(cxx))  # noqa: E731
    kernel_build._compiler_versions.clear()
    k1 = key()
    cxx.write_text(cxx.read_text().replace("fake-g++ 0.1", "fake-g++ 0.2"))
    kernel_build._compiler_versions.clear()
    assert key() != k1
