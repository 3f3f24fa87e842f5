"""What machine a benchmark figure ran on, and how a run emulates a lesser CPU (`--isa avx2`).

    from host import add_isa_arg, apply_isa, describe
    ap = argparse.ArgumentParser(); add_isa_arg(ap); a = ap.parse_args()
    apply_isa(a.isa)          # before MindSpore, torch or numpy load: sets the environment and re-execs once
    res = {**describe(threads=2), ...}

`describe` labels every JSON line with the date, the CPU model, the ISA levels this CPU runs (the one
hardware probe, `model.cpu.cpu_levels`), the level emulated (`--isa`, or none) and the native
kernel body forced by MSLLM_KERNEL_ISA (or "auto": the best level the CPU runs).

What `--isa avx2` emulates, for every process of the run (ours and PyTorch's; children inherit it):

| library | variable | effect (checked on this machine) |
|---|---|---|
| our kernels (model/train_kernels.cc, decode_kernel.cc) | MSLLM_KERNEL_ISA=avx2 | the x86-64-v3 body is built and loaded |
| oneDNN in MindSpore (MatMul, BatchMatMul) and in PyTorch (mkldnn) | ONEDNN_MAX_CPU_ISA=AVX2 | `ONEDNN_VERBOSE=1` prints `isa:Intel AVX2` in both |
| PyTorch's ATen vectorized kernels and inductor's generated C++ | ATEN_CPU_CAPABILITY=avx2 | `torch.backends.cpu.get_cpu_capability()` says AVX2; inductor's `pick_vec_isa` reads it |
| MKL (PyTorch's sgemm) | MKL_ENABLE_INSTRUCTIONS=AVX2 | caps MKL's code path (on an AMD CPU MKL takes its AVX2 path anyway) |
| numpy's OpenBLAS (GEMV/sgemm references) | OPENBLAS_CORETYPE=Haswell | `OPENBLAS_VERBOSE=2` prints `Core: Haswell` |
| numpy's own SIMD loops (sum, add) | NPY_DISABLE_CPU_FEATURES=<its AVX512* dispatch targets> | `__cpu_features__['AVX512F']` is False |
| the theoretical peak (MFU) | flags passed to `theoretical_peak_flops` | 8 fp32 lanes instead of 16 |

Not emulated: MindSpore's own non-oneDNN CPU kernels (nnacl element-wise, reductions, softmax, Adam),
which pick their SIMD body at run time with no override we know of; glibc's string/memory functions
(EVEX variants stay in use); libgomp (no SIMD of its own); and everything that is not an instruction set:
the clock (no AVX-512 frequency offset on this AMD CPU, where an Intel AVX2 part may run faster or
slower), cache sizes and memory bandwidth. So an emulated figure says how the code paths of an AVX2 CPU
behave on this CPU's memory system, not what a real AVX2 machine would measure.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.cpu import cpu_flags, cpu_levels, cpu_model  # noqa: E402  (after the sys.path insert)
from tasks.training.hardware import process_cpu_seconds  # noqa: E402

_MARK = "MSLLM_BENCH_EMULATED_ISA"  # set once the environment is applied: the re-exec'd process sees it


def add_isa_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--isa",
        choices=["avx512", "avx2"],
        default=None,
        help="kernel body and library ISA cap for every process of the run (avx2: emulate an "
        "AVX2-only CPU; scripts/bench/host.py says what is and is not emulated)",
    )


def isa_env(isa: str) -> dict[str, str]:
    """The environment that makes this run's processes behave as on a CPU of level `isa`."""
    if isa == "avx512":
        return {"MSLLM_KERNEL_ISA": "avx512"}  # the libraries' own best already is AVX-512 on such a CPU
    if isa == "avx2":
        env = {
            "MSLLM_KERNEL_ISA": "avx2",
            "ONEDNN_MAX_CPU_ISA": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2",
            "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "OPENBLAS_CORETYPE": "Haswell",
        }
        try:
            from numpy.core._multiarray_umath import __cpu_dispatch__
        except ImportError:  # another numpy layout: its own SIMD stays as it is
            return env
        avx512 = [f for f in __cpu_dispatch__ if f.startswith("AVX512")]
        if avx512:
            env["NPY_DISABLE_CPU_FEATURES"] = " ".join(avx512)
        return env
    raise ValueError(f"--isa {isa}: one of avx512, avx2")


def apply_isa(isa: str | None) -> None:
    """Run this process (and its children) under `isa_env(isa)`: the variables must be set before the
    libraries load, so this sets them and re-execs the script once. No-op without `isa`."""
    if not isa or os.environ.get(_MARK) == isa:
        return
    if isa not in cpu_levels():
        raise SystemExit(f"--isa {isa}: this CPU runs {', '.join(cpu_levels()) or 'no kernel level'}")
    env = dict(os.environ, **isa_env(isa), **{_MARK: isa})
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def emulated_isa() -> str | None:
    return os.environ.get(_MARK) or None


def effective_flags() -> set[str]:
    """cpu_flags() as the emulated CPU would report them (AVX-512 removed under --isa avx2)."""
    flags = cpu_flags()
    if emulated_isa() == "avx2":
        flags = {f for f in flags if not f.startswith("avx512")}
    return flags


def describe(threads: int | str | None) -> dict:
    """The labels every benchmark line carries."""
    levels = cpu_levels()
    return {
        "date": datetime.date.today().isoformat(),
        "cpu": cpu_model(),
        "cpu_isa": levels[0] if levels else None,
        "emulated_isa": emulated_isa(),
        "kernel_isa_setting": os.environ.get("MSLLM_KERNEL_ISA") or "auto",
        "threads": threads,
    }


BUSY_LOOP = "nice -n 19 busy loop (1 process)"


class busy_loop:
    """`with busy_loop():` one `nice -n 19` Python busy loop beside the timed code (a user's machine is never quiet:
    a browser, the Prefect server, a second stage). The benches' `--load` times every side both ways in each round
    and reports each one's slowdown; a low-priority process should cost a few percent, as it does PyTorch.

    The loop is running steadily before the block starts (it has used `WARM_CPU_S` of CPU): a background process
    has been there all along. Its start (fork, exec of `nice`, Python's startup) cost the step it overlapped
    0.10-0.14 s on any side (tiny-llama-bench, AMD EPYC, 2026-12-05: one step of ten per loaded round), a fixed cost
    that made a faster side's slowdown look 2x a slower side's for the same absolute loss."""

    WARM_CPU_S = 0.3

    def __enter__(self):
        import subprocess
        import time

        self.proc = subprocess.Popen(["nice", "-n", "19", sys.executable, "-c", "while True: pass"])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10 * self.WARM_CPU_S and self.proc.poll() is None:
            try:
                if process_cpu_seconds(self.proc.pid) >= self.WARM_CPU_S:
                    break
            except (OSError, IndexError, ValueError):  # not Linux: wait the time instead
                pass
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait()
