"""Native kernels as MindSpore custom ops on CPU: built with g++ on first use, optional everywhere.

    lib = build(Path("model/train_kernels.cc"))   # path of the .so, or None (no compiler, a failed build, disabled)
    k = train_ops()                               # the fused train-step ops, or None: callers keep MindSpore's own ops
    probs = k.causal_softmax(scores)              # [N, T, S] -> [N, T, S]

`ops.Custom(..., func_type="aot")` runs a C++ function inside the compiled graph like any kernel. The
sources live next to this file; each builds once per (source, compiler, flags, CPU features) into
$MSLLM_KERNEL_CACHE (default ~/.cache/msllm/kernels), atomically (concurrent builders never load a
half-written file). Without g++ (or with MSLLM_FUSED_KERNELS=0) nothing is built and the model runs
on MindSpore's built-in kernels: the same math, slower (docs/MINDSPORE_CPU.md).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from types import SimpleNamespace

FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-pthread"]
TRAIN_SOURCE = Path(__file__).with_name("train_kernels.cc")
_built: dict[str, str | None] = {}
_train_ops: list = []  # memo of train_ops(): [] not yet asked, [None] unavailable, [ns]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def build(source: Path, openmp: bool = False) -> str | None:
    """Path of `source` compiled to a shared library, or None. With `openmp`, -fopenmp when the compiler
    has it (else one thread)."""
    cxx = shutil.which(os.environ.get("CXX", "g++"))
    if cxx is None or not source.is_file():
        return None
    src = source.read_bytes()
    key = hashlib.sha256(src + " ".join([cxx, *FLAGS, str(openmp)]).encode() + _cpu_flags().encode()).hexdigest()[:16]
    if key in _built:
        return _built[key]
    cache = Path(os.environ.get("MSLLM_KERNEL_CACHE") or Path.home() / ".cache" / "msllm" / "kernels")
    lib = cache / f"{source.stem}-{key}.so"
    if not lib.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
            os.close(fd)
            ok = False
            for extra in ((["-fopenmp"], []) if openmp else ([],)):
                r = subprocess.run([cxx, *FLAGS, *extra, str(source), "-o", tmp], capture_output=True, timeout=300)
                if r.returncode == 0:
                    ok = True
                    break
            if ok:
                os.replace(tmp, lib)
            else:
                os.unlink(tmp)
        except (OSError, subprocess.SubprocessError):
            pass
    _built[key] = str(lib) if lib.is_file() else None
    return _built[key]


def train_ops() -> SimpleNamespace | None:
    """The fused train-step ops of model/train_kernels.cc (fp32), or None where they cannot be built.

    causal_softmax(scores [N, T, S]) -> probs, queries at the last T of S key positions;
    softmax_grad(probs, dprobs) -> dscores; swiglu(gate, up) -> silu(gate) * up;
    swiglu_grad(gate, up, dout) -> (dgate, dup); rms_norm(x [N, H], weight [H], eps [1]) -> y;
    rms_norm_grad(x, weight, eps, dy) -> (dx, dweight); cross_entropy(logits [N, V], labels [N] int32) ->
    (nll [N], logsumexp [N]); cross_entropy_grad(logits, labels, logsumexp, dnll) -> dlogits.
    """
    if _train_ops:
        return _train_ops[0]
    lib = None if os.environ.get("MSLLM_FUSED_KERNELS", "1") == "0" else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:
        from mindspore import ops

        def op(name, shape, dtype):
            return ops.Custom(f"{lib}:{name}", out_shape=shape, out_dtype=dtype, func_type="aot")

        ns = SimpleNamespace(
            lib=lib,
            causal_softmax=op("CausalSoftmax", lambda x: x, lambda x: x),
            softmax_grad=op("SoftmaxGrad", lambda p, d: p, lambda p, d: p),
            swiglu=op("SwiGLU", lambda g, u: g, lambda g, u: g),
            swiglu_grad=op("SwiGLUGrad", lambda g, u, d: (g, g), lambda g, u, d: (g, g)),
            rms_norm=op("RMSNorm", lambda x, w, e: x, lambda x, w, e: x),
            rms_norm_grad=op("RMSNormGrad", lambda x, w, e, d: (x, w), lambda x, w, e, d: (x, w)),
            cross_entropy=op("CrossEntropy", lambda x, y: ([x[0]], [x[0]]), lambda x, y: (x, x)),
            cross_entropy_grad=op("CrossEntropyGrad", lambda x, y, lse, d: x, lambda x, y, lse, d: x),
        )
    _train_ops.append(ns)
    return ns


_zero_ops: list = []  # memo of zero_ops(), as _train_ops


def zero_ops() -> SimpleNamespace | None:
    """The in-place AdamW op (ZeroAdamW in model/train_kernels.cc), or None where it cannot be built (no compiler, or
    MSLLM_FUSED_KERNELS=0): tasks/training/optim.py ShardedAdamW then keeps its fp32 master share and
    MindSpore's AdamWeightDecay.

    adamw(param [n], grad [n], m [k], v [k], offset [1] int32, lr, beta1, beta2, eps, decay, coef, apply) -> [1]:
    updates m, v and param[offset:offset + k] in place (fp32; scalars 0-d fp32; apply 0 writes nothing).
    """
    if _zero_ops:
        return _zero_ops[0]
    lib = None if os.environ.get("MSLLM_FUSED_KERNELS", "1") == "0" else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:
        from mindspore import ops
        from mindspore.ops import signature as sig

        class ZeroAdamW(ops.Custom):
            """Declared as writing param, m and v (RW_WRITE, side_effect_mem), as MindSpore's own AdamWeightDecay:
            without it a graph run under the PYNATIVE context (mindspore.jit) hands the kernel a copy of a
            Parameter the step also reads elsewhere, and the update is lost; with it the update is ordered after
            every earlier read of those Parameters in the graph (auto-monad)."""

            __mindspore_signature__ = (
                sig.make_sig("param", sig.sig_rw.RW_WRITE), sig.make_sig("grad"),
                sig.make_sig("m", sig.sig_rw.RW_WRITE), sig.make_sig("v", sig.sig_rw.RW_WRITE),
                *(sig.make_sig(n) for n in ("offset", "lr", "beta1", "beta2", "eps", "decay", "coef", "apply")))

            def __init__(self):
                super().__init__(f"{lib}:ZeroAdamW", out_shape=lambda *s: [1], out_dtype=lambda *t: t[0],
                                 func_type="aot")
                self.add_prim_attr("side_effect_mem", True)

        ns = SimpleNamespace(lib=lib, adamw=ZeroAdamW())
    _zero_ops.append(ns)
    return ns
