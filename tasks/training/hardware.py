"""The hardware side of training metrics: peak resident memory, and MFU's denominator (the fp32 peak of the
cores this process uses, derived from the one hardware probe `model.kernels.cpu_flags()`, and a timed sgemm
as the achievable peak).

    peak = resolve_peak_flops(train.loop.peak_flops)   # PeakFlops(flops, how, achievable)
    mfu = tokens_per_s * flops_per_token / (peak.flops * world)
"""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from model.cpu import cpu_flags


def _status_bytes(field: str, pid: int | str = "self") -> int | None:
    """A `kB` line of /proc/<pid>/status (VmHWM, VmRSS; this process's by default) in bytes; None where there is no
    /proc (or no such process)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def process_cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, user + system (/proc/<pid>/stat fields 14 and 15; Linux). The fuzz runner's hang
    budget and the benches' busy loop read it."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_bytes(pid: int | None = None) -> int:
    """Peak resident memory of this process (or of process `pid`, e.g. a bench's server; 0 where it cannot be read):
    VmHWM, the high-water mark of its own address space.

    Not ru_maxrss: Linux folds the pre-exec image into it, so a child started by a large
    parent (pytest, a Prefect worker) would report the parent's peak.
    """
    if pid is not None:
        return _status_bytes("VmHWM", pid) or 0
    hwm = _status_bytes("VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes() -> int:
    """Resident memory of this process now (VmRSS); 0 where /proc is not there."""
    return _status_bytes("VmRSS") or 0


def reset_peak_rss() -> bool:
    """Start a new high-water mark (VmHWM := VmRSS; Linux >= 4.0, `/proc/PID/clear_refs` value 5), so that
    `peak_rss_bytes` gives the peak since this call. False where it cannot (the peak then stays the process's)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_peak_flops(n: int = 2048, repeats: int = 3) -> float:
    """Achievable fp32 matmul FLOP/s here: the best of a few n³ MatMuls through MindSpore's own kernel
    (oneDNN, the one the train step uses; numpy's BLAS here reaches a fraction of it).

    Shown beside MFU as the achievable peak; never MFU's denominator unless it exceeds the theoretical
    peak (a busy machine under-measures it, which once printed "MFU 211%"). See `theoretical_peak_flops`.
    """
    a_np = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
    try:
        import mindspore as ms  # lazy: the training stages' parents import this module (via the trainer)
        from mindspore import ops

        a = ms.Tensor(a_np)
        matmul = ops.MatMul()

        def product(x):
            return matmul(x, x)

        compiled = ms.jit(product)  # ~1.5x PyNative's single-op path; compiles in ~0.2 s

        def once():
            return compiled(a).asnumpy()  # asnumpy waits for the kernel
    except Exception:  # noqa: BLE001  (no usable MindSpore in this process: numpy's BLAS)

        def once():
            return a_np @ a_np

    return 2 * n**3 / best_time(once, repeats)


def best_time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` calls of fn, in seconds, after one warm-up call (the kernel and its threads)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cpu_ghz() -> tuple[float, str]:
    """The highest clock this machine reports (GHz) and where it was read."""
    cands: list[tuple[float, str]] = []
    try:
        cands.append(
            (
                int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6,
                "cpufreq cpuinfo_max_freq",
            )
        )
    except (OSError, ValueError):
        pass
    try:
        info = Path("/proc/cpuinfo").read_text()
        for line in info.splitlines():
            if line.startswith("cpu MHz"):
                cands.append((float(line.split(":")[1]) / 1e3, "/proc/cpuinfo cpu MHz"))
                break
        m = re.search(r"model name\s*:.*@\s*([0-9.]+)\s*GHz", info)
        if m:
            cands.append((float(m.group(1)), "model name"))
    except (OSError, ValueError):
        pass
    return max(cands) if cands else (0.0, "unknown")


def _cores_for_this_process() -> int:
    """Cores this process computes on: its CPU affinity, capped by OMP_NUM_THREADS (msrun sets it per rank)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    omp = os.environ.get("OMP_NUM_THREADS", "")
    return max(1, min(n, int(omp))) if omp.isdigit() and int(omp) > 0 else n


def theoretical_peak_flops(flags: set[str] | None = None) -> tuple[float, str]:
    """fp32 peak of the cores this process uses: cores × clock × FLOPs per cycle per core, and how it was derived.

    FLOPs per cycle = SIMD fp32 lanes (16 with AVX-512, 8 with AVX2, 4 with SSE/NEON) × 2 with FMA
    × 2 FMA units (every AVX2/AVX-512 server core since Haswell/Skylake-SP has two; with one, the true
    peak is half and MFU is understated, never overstated). The clock is the highest one the machine
    reports; a turbo clock above it could in principle exceed it, so `resolve_peak_flops` also never
    lets the denominator fall below a measured sgemm. `flags` (default: cpu_flags()) lets a benchmark that
    emulates a lesser CPU (scripts/bench/host.py, AVX-512 flags removed) count that CPU's lanes.
    """
    flags = cpu_flags() if flags is None else flags
    lanes = 16 if "avx512f" in flags else 8 if "avx2" in flags or "avx" in flags else 4
    fma = 2 if ("fma" in flags or "asimd" in flags) else 1
    units = 2 if lanes >= 8 else 1
    ghz, src = _cpu_ghz()
    cores = _cores_for_this_process()
    if ghz <= 0:
        return 0.0, "clock unknown"
    per_cycle = lanes * fma * units
    how = (
        f"{cores} cores × {ghz:.2f} GHz ({src}) × {per_cycle} fp32 FLOP/cycle "
        f"({lanes} lanes{' × FMA' if fma == 2 else ''} × {units} units)"
    )
    return cores * ghz * 1e9 * per_cycle, how


@dataclass
class PeakFlops:
    flops: float
    how: str
    achievable: float | None = None

    def describe(self) -> str:
        s = f"{self.flops / 1e9:.1f} GFLOP/s fp32 per rank ({self.how})"
        if self.achievable:
            share = 100 * self.achievable / self.flops
            s += f"; measured sgemm {self.achievable / 1e9:.1f} GFLOP/s ({share:.0f}% of it)"
        return s


def resolve_peak_flops(configured: float | None = None) -> PeakFlops:
    """MFU's denominator: `train.loop.peak_flops` when set, else the hardware's theoretical peak.

    The measured sgemm rides along as the achievable peak; should it ever exceed the theoretical
    figure (an unreported turbo clock), it becomes the denominator, so MFU > 100% cannot be printed.
    """
    if configured:
        return PeakFlops(float(configured), "train.loop.peak_flops")
    theo, how = theoretical_peak_flops()
    meas = measure_peak_flops(n=2048, repeats=3)
    if theo < meas:
        return PeakFlops(meas, f"measured sgemm (above the derived {how})", meas)
    return PeakFlops(theo, how, meas)
