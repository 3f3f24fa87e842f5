"""The one hardware probe (/proc/cpuinfo, checked against CPUID) and the ISA levels the native kernels are built for.

    cpu_flags()                       # {"avx2", "fma", ...}: the `flags` / `Features` line
    cpu_model()                       # "Intel(R) Xeon(R) ...", for labelling measurements
    cpu_levels()                      # ("avx512", "avx2", "scalar"): the levels this CPU runs, best first
    select_isa()                      # ("avx2", "") to build, or (None, why not); MSLLM_KERNEL_ISA forces one
    matmul_isa()                      # "avx512" / "avx2" / ...: the level MindSpore's MatMul (oneDNN) runs at

A level is a fixed set of compiler flags (-march=x86-64-v4 for the AVX-512 body, x86-64-v3 for AVX2+FMA,
armv8.2-a for NEON, -DMSLLM_SCALAR for the scalar reference) and the CPU flags code built with them needs,
so one cached build (model/kernel_build.py) serves every machine of a level. The kernels' decision and
their ops are in model/kernels.py; the trainer's theoretical peak (tasks/training/hardware.py) and the
benchmarks' labels (scripts/bench/host.py) read the same probe.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass


@dataclass(frozen=True)
class Level:
    name: str
    machine: str  # platform.machine() family: "x86_64" or "aarch64"
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]  # what /proc/cpuinfo must list for code built with `flags` to run


_X86_V2 = {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"}
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}  # abm: LZCNT
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
LEVELS = {  # best first per machine
    "x86_64": (
        Level("avx512", "x86_64", ("-march=x86-64-v4",), frozenset(_X86_V4)),
        Level("avx2", "x86_64", ("-march=x86-64-v3",), frozenset(_X86_V3)),
        Level("scalar", "x86_64", ("-march=x86-64", "-DMSLLM_SCALAR"), frozenset()),
    ),
    "aarch64": (
        Level("neon", "aarch64", ("-march=armv8.2-a",), frozenset({"asimd", "fp", "atomics", "asimdrdm"})),
        Level("scalar", "aarch64", ("-march=armv8-a", "-DMSLLM_SCALAR"), frozenset()),
    ),
}
ISA_NAMES = ("avx512", "avx2", "neon", "scalar")


def _machine(machine: str | None = None) -> str:
    m = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


# /proc/cpuinfo's x86 vector flags by the name NumPy's runtime dispatch gives the same CPUID (+ XGETBV) bit
_CPUID_NAMES = {
    "avx": "AVX",
    "f16c": "F16C",
    "fma": "FMA3",
    "avx2": "AVX2",
    "avx512f": "AVX512F",
    "avx512cd": "AVX512CD",
    "avx512bw": "AVX512BW",
    "avx512dq": "AVX512DQ",
    "avx512vl": "AVX512VL",
    "avx512_vnni": "AVX512VNNI",
    "avx512ifma": "AVX512IFMA",
    "avx512vbmi": "AVX512VBMI",
    "avx512_vbmi2": "AVX512VBMI2",
    "avx512_bitalg": "AVX512BITALG",
    "avx512_vpopcntdq": "AVX512VPOPCNTDQ",
}


def _cpuid_lacks() -> set[str]:
    """The vector flags /proc/cpuinfo may list that this process's CPUID (read by NumPy's runtime dispatch,
    which also checks the OS saves the registers) says it cannot execute. Empty on real hardware, where the
    kernel builds /proc/cpuinfo from the same CPUID; not under qemu-user, whose /proc/cpuinfo is the host's
    while its CPUID is the emulated CPU's (scripts/test_emulated_cpu.sh). Empty when NumPy cannot say."""
    try:
        from numpy.core._multiarray_umath import __cpu_features__ as runtime  # lazy: NumPy; the CLI imports this
    except ImportError:
        return set()
    return {flag for flag, name in _CPUID_NAMES.items() if runtime.get(name) is False}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """The CPU's feature flags: the `flags` (x86) or `Features` (aarch64) line of /proc/cpuinfo (or of
    `cpuinfo`), less the x86 vector flags CPUID says this process cannot execute (_cpuid_lacks; only when
    reading this machine); empty where there is none. The one hardware probe: the kernel levels, the trainer's
    theoretical peak (tasks/training/hardware.py) and the benchmarks' labels (scripts/bench/host.py) read it."""
    probe = cpuinfo is None
    if probe:
        cpuinfo = _read_cpuinfo()
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip().lower() in ("flags", "features"):
            flags = set(value.split())
            return flags - _cpuid_lacks() if probe and _machine() == "x86_64" else flags
    return set()


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's name from the same /proc/cpuinfo: `model name` (x86), else `Hardware` / `CPU part`
    (aarch64), else platform.processor() or the machine; for labelling measurements."""
    if cpuinfo is None:
        cpuinfo = _read_cpuinfo()
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip().lower(), value.strip())
    for key in ("model name", "hardware", "cpu part"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or _machine()


def cpu_levels(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The ISA levels this CPU can run, best first (("avx512", "avx2", "scalar") on an AVX-512 x86), from
    cpu_flags(cpuinfo) and the machine (platform.machine(), or `machine`)."""
    levels = LEVELS.get(_machine(machine))
    if levels is None:
        return ()  # no kernel body for this architecture
    have = cpu_flags(cpuinfo)
    return tuple(lv.name for lv in levels if lv.cpu_flags <= have)


def select_isa(
    override: str | None = None, cpuinfo: str | None = None, machine: str | None = None
) -> tuple[str | None, str]:
    """(level, "") to build, or (None, why not). `override` (default $MSLLM_KERNEL_ISA) forces a level."""
    override = os.environ.get("MSLLM_KERNEL_ISA", "") if override is None else override
    m = _machine(machine)
    runs = cpu_levels(cpuinfo, m)
    if not runs:
        return None, f"no kernel body for this architecture ({m}; bodies: x86_64, aarch64)"
    if override:
        if override not in ISA_NAMES:
            return None, f"MSLLM_KERNEL_ISA={override} is not one of {', '.join(ISA_NAMES)}"
        if override not in runs:
            return None, f"MSLLM_KERNEL_ISA={override}: this CPU ({m}) cannot run it (it runs {', '.join(runs)})"
        return override, ""
    return runs[0], ""


def level(isa: str, machine: str | None = None) -> Level:
    """The Level named `isa` of this machine's family (or of `machine`)."""
    return next(lv for lv in LEVELS[_machine(machine)] if lv.name == isa)


def matmul_isa(cpuinfo: str | None = None, machine: str | None = None, cap: str | None = None) -> str:
    """The x86 level MindSpore's fp32 MatMul (oneDNN) runs at here: the CPU's best level, capped by
    ONEDNN_MAX_CPU_ISA (`cap`; "AVX2" emulates an AVX2-only CPU, as the benchmarks' --isa avx2 does). "avx512",
    "avx2", "scalar" (a cap below AVX2, or an x86 without it), or "" on other architectures (their oneDNN paths are
    not measured here). The train build asks it where the same product runs faster another way on oneDNN's
    AVX2 path (tasks/modeling/build.py `convert`)."""
    runs = cpu_levels(cpuinfo, machine)
    if _machine(machine) != "x86_64" or not runs:
        return ""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA", "") if cap is None else cap).strip().upper()
    best = runs[0]
    if cap in ("", "ALL", "DEFAULT") or cap.startswith(("AVX512", "AVX10")):
        return best
    if cap.startswith("AVX2"):
        return "avx2" if best in ("avx512", "avx2") else best
    return "scalar"  # SSE41 / AVX: below every body we build
