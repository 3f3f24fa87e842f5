"""model/spin_wait.cc through model/runtime.py `spin_waits`: MindSpore's thread pool spins while it waits instead of
calling sched_yield, which on Linux's EEVDF scheduler hands the core to a `nice -n 19` process for a whole slice
(docs/MINDSPORE_CPU.md, "Threads"; the speed itself is scripts/bench/train.py --load's, not a test's).

The GOT walk is checked on a library of our own, built three ways (full RELRO with BIND_NOW, lazy binding, no PLT:
a GLOB_DAT slot), in a fresh process so nothing else calls the spin meanwhile; then on MindSpore's own libraries.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from model import runtime
from model.kernel_build import SPIN_SOURCE, build_kernel

CXX = shutil.which(os.environ.get("CXX", "g++"))
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler (the spin-wait patch is built with g++)")
ROOT = Path(__file__).resolve().parents[1]

YIELDS = 'extern "C" int yield_n(int n) { for (int i = 0; i < n; ++i) sched_yield(); return n; }\n'

CHILD = r"""
import ctypes, json, sys
spin = ctypes.CDLL(sys.argv[1])
spin.msllm_patch_yield.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
spin.msllm_yield_target.restype = ctypes.c_void_p
spin.msllm_yield_target.argtypes = [ctypes.c_char_p]
spin_at = ctypes.cast(spin.msllm_spin_yield, ctypes.c_void_p).value
out = {}
for path in sys.argv[2:]:
    lib = ctypes.CDLL(path)
    lib.yield_n(10)  # bind the lazy slot first: the patch must replace a resolved address too
    def perms():
        return sorted(line.split()[1] for line in open("/proc/self/maps") if line.rstrip().endswith(path))
    before, maps = spin.msllm_yield_target(path.encode()), perms()
    libraries = ctypes.c_int()
    slots = spin.msllm_patch_yield(path.encode(), ctypes.byref(libraries))
    calls = spin.msllm_spin_yield_calls()
    lib.yield_n(1000)
    out[path] = {
        "slots": slots, "libraries": libraries.value, "calls": spin.msllm_spin_yield_calls() - calls,
        "before_is_spin": before == spin_at, "after_is_spin": spin.msllm_yield_target(path.encode()) == spin_at,
        "maps_kept": perms() == maps,
    }
print(json.dumps(out))
"""


def _spin_lib() -> str:
    built = build_kernel(SPIN_SOURCE, say=False)
    assert built.lib, built.reason
    return built.lib


def test_sched_yield_imports_of_a_library_are_pointed_at_the_spin_however_it_was_linked(tmp_path):
    src = tmp_path / "yields.cc"
    src.write_text("#include <sched.h>\n" + YIELDS)
    libs = []
    for name, flags in {
        "relro-now": ["-Wl,-z,relro,-z,now"],  # the GOT is read-only once relocated: must be opened and closed again
        "lazy": ["-Wl,-z,lazy"],  # a JUMP_SLOT in a writable .got.plt
        "no-plt": ["-fno-plt", "-Wl,-z,relro,-z,now"],  # called through a GLOB_DAT slot
    }.items():
        out = tmp_path / f"libyields-{name}.so"
        subprocess.run([CXX, "-O1", "-shared", "-fPIC", *flags, str(src), "-o", str(out)], check=True, timeout=120)
        libs.append(str(out))
    r = subprocess.run(
        [sys.executable, "-c", CHILD, _spin_lib(), *libs], capture_output=True, text=True, timeout=120, check=True
    )
    for path, got in json.loads(r.stdout).items():
        name = Path(path).name
        assert got["libraries"] == 1 and got["slots"] >= 1, (name, got)
        assert not got["before_is_spin"] and got["after_is_spin"], (name, got)
        assert got["calls"] == 1000, (name, got)  # every sched_yield of the library now lands in the spin
        assert got["maps_kept"], (name, got)  # RELRO pages are read-only again; nothing else changed protection


def test_mindspore_thread_pool_spins_after_setup_and_computes_the_same():
    runtime.setup_mindspore()
    assert runtime.SPIN_WAIT.startswith("spin ("), runtime.SPIN_WAIT
    spin = ctypes.CDLL(_spin_lib())  # the same library (dlopen hands back the loaded one)
    spin.msllm_yield_target.restype = ctypes.c_void_p
    spin.msllm_yield_target.argtypes = [ctypes.c_char_p]
    at = ctypes.cast(spin.msllm_spin_yield, ctypes.c_void_p).value
    assert spin.msllm_yield_target(b"libmindspore_core") == at
    assert spin.msllm_yield_target(b"numpy.libs/libopenblas") == at  # NumPy's OpenBLAS pool (host work) too
    calls = spin.msllm_spin_yield_calls()
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((384, 256), np.float32), rng.standard_normal((256, 320), np.float32)
    got = ms.ops.matmul(ms.Tensor(a), ms.Tensor(b)).asnumpy()  # oneDNN on MindSpore's two-thread pool
    assert spin.msllm_spin_yield_calls() > calls  # the pool's waits went through the spin
    # fp32 sums of 256 products: within 256 * eps32 of the magnitude of the terms, whatever the summation order
    bound = 256 * np.finfo(np.float32).eps * (np.abs(a) @ np.abs(b))
    assert np.all(np.abs(got - a.astype(np.float64) @ b) <= bound)


def test_msllm_spin_wait_0_keeps_mindspore_s_sched_yield():
    code = (
        "import ctypes, sys; from model import runtime; runtime.setup_mindspore(); print(runtime.SPIN_WAIT); "
        "spin = ctypes.CDLL(sys.argv[1]); spin.msllm_yield_target.restype = ctypes.c_void_p; "
        "spin.msllm_yield_target.argtypes = [ctypes.c_char_p]; "
        "at = ctypes.cast(spin.msllm_spin_yield, ctypes.c_void_p).value; "
        "print(spin.msllm_yield_target(b'libmindspore_core') == at)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, _spin_lib()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "MSLLM_SPIN_WAIT": "0"},
        check=True,
    )
    assert r.stdout.split("\n")[:2] == ["yield: MSLLM_SPIN_WAIT=0", "False"], r.stdout


def test_graphs_back_to_back_hold_the_pool_s_spin_count_drop_until_they_end():
    """MindSpore drops its pool's spin count after every graph run (ThreadPool::SetSpinCountMinValue); inside
    `runtime.graphs_back_to_back()` (the layer-at-a-time train step) those drops are held, and one is made on leaving
    it; outside, every drop goes straight to MindSpore's own function."""
    runtime.setup_mindspore()
    assert "SetSpinCountMinValue" in runtime.SPIN_WAIT, runtime.SPIN_WAIT
    spin = ctypes.CDLL(_spin_lib())
    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((64, 64), np.float32))

    @ms.jit
    def f(x):
        return ms.ops.matmul(x, x) + 1.0

    f(a).asnumpy()
    held = spin.msllm_spin_min_deferred()
    f(a).asnumpy()
    assert spin.msllm_spin_min_deferred() == held  # outside a hold: nothing deferred
    with runtime.graphs_back_to_back():
        outs = [f(a).asnumpy() for _ in range(3)]
    assert spin.msllm_spin_min_deferred() >= held + 3  # each graph's drop came through the hold
    want = a.asnumpy().astype(np.float64) @ a.asnumpy() + 1.0
    bound = 64 * np.finfo(np.float32).eps * (np.abs(a.asnumpy()) @ np.abs(a.asnumpy()) + 1.0)
    assert all(np.all(np.abs(o - want) <= bound) for o in outs)


def test_the_pool_s_waiting_threads_run_pieces_of_the_train_kernels(monkeypatch):
    """With the waits patched and the train kernels built, MindSpore's idle pool thread spinning beside a fused
    kernel runs some of its pieces (model/train_kernels.cc MsllmHelp, hooked into msllm_spin_yield by
    `runtime.lend_idle_threads`), and the kernel computes what it computes alone, bit for bit."""
    from model.kernel_ops import train_ops

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no pool thread waits beside the kernel")
    runtime.setup_mindspore()
    k = train_ops()
    if k is None:
        pytest.skip("the train kernels are not built here")
    assert runtime._lent, "the kernels' MsllmHelp is not hooked into the pool's waits"
    lib = ctypes.CDLL(k.lib)
    lib.MsllmHelpedPieces.restype = ctypes.c_long
    monkeypatch.setenv("MSLLM_KERNEL_THREADS", "1")  # the trainer's count (MindSpore's OMP_NUM_THREADS=1 on 2 cores)
    rng = np.random.default_rng(0)
    w = ms.Tensor(rng.standard_normal((256, 256), np.float32) * 0.06)
    x = ms.Tensor(rng.standard_normal((8 * 128, 256), np.float32))

    @ms.jit
    def f(x, w):  # a MatMul on the pool's two threads, then the attention on the graph's thread
        q = ms.ops.matmul(x, w).reshape(8, 128, 8, 32).transpose(0, 2, 1, 3)
        return k.causal_attention(q, q, q)[0]

    def run(helpers: int):
        lib.MsllmLendIdleThreads(helpers)
        before = lib.MsllmHelpedPieces()
        with runtime.graphs_back_to_back():
            outs = [f(x, w).asnumpy() for _ in range(4)]
        return outs, lib.MsllmHelpedPieces() - before

    try:
        alone, none_helped = run(0)
        for _ in range(10):  # until the pool thread has come by during a call (it spins: it nearly always does)
            lent, helped = run(1)
            for a in alone + lent:
                np.testing.assert_array_equal(a, alone[0])
            if helped:
                break
    finally:
        lib.MsllmLendIdleThreads(1)
    assert none_helped == 0 and helped > 0
