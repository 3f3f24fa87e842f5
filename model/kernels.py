"""Native kernels as MindSpore custom ops on CPU: built with g++ on first use, optional everywhere. The import
path every caller uses; each concern has its own module:

    enabled(setting, Capabilities("CPU", "fp32"))  # THE decision (below): the model, optimizer, memory plan, decoder
    k = train_ops()                               # model/kernel_ops.py: the fused ops, or None (MindSpore's own run)
    probs = k.causal_softmax(scores)              # [N, T, S] -> [N, T, S]
    build_kernel(TRAIN_SOURCE)                    # model/kernel_build.py: KernelBuild (lib, isa, reason when off)
    kernel_path()                                 # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>"
    cpu_levels()                                  # model/cpu.py: the one hardware probe and the ISA levels

| module | concern |
|---|---|
| `model/cpu.py` | /proc/cpuinfo, the ISA levels (flags per level), which level this CPU runs (MSLLM_KERNEL_ISA) |
| `model/kernel_build.py` | compile per level, verify in a subprocess, the private checksummed cache, NATIVE_SOURCES |
| `model/kernel_ops.py` | the `ops.Custom` wrappers and their graph-time operand checks |
| here | whether the kernels run (`off_reason` / `enabled`), and the names above re-exported |

Without g++ (or with MSLLM_FUSED_KERNELS=0) nothing is built and the model runs on MindSpore's built-in
kernels: the same math, slower (docs/MINDSPORE_CPU.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from model.cpu import ISA_NAMES, LEVELS, Level, cpu_flags, cpu_levels, cpu_model, level, select_isa
from model.kernel_build import (DECODE_SOURCE, FLAGS, HEADERS, HERE, TRAIN_SOURCE, KernelBuild, build, build_kernel,
                                cache_dir, disabled_reason, exported_functions, kernel_path)
from model.kernel_ops import KERNEL_ERRORS, KernelShapeError, dtype_of, train_ops, zero_ops

__all__ = ["ISA_NAMES", "LEVELS", "Level", "cpu_flags", "cpu_levels", "cpu_model", "level", "select_isa",
           "DECODE_SOURCE", "FLAGS", "HEADERS", "HERE", "TRAIN_SOURCE", "KernelBuild", "build", "build_kernel",
           "cache_dir", "disabled_reason", "exported_functions", "kernel_path",
           "KERNEL_ERRORS", "KernelShapeError", "dtype_of", "train_ops", "zero_ops",
           "Capabilities", "off_reason", "enabled"]


@dataclass(frozen=True)
class Capabilities:
    """What the place that would run a kernel offers: the device and the compute dtype."""

    device_target: str = "CPU"
    compute: str = "fp32"
    """"fp32", or "fp16"/"bf16" (half-precision compute: the fused kernels are fp32 only)."""


def off_reason(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> str:
    """Why the native kernels of `kind` ("train": the model's fused ops and the in-place AdamW; "decode": the
    fused decode step) do not run, or '' when they do (subject only to building: no compiler or a failed build
    then falls back to MindSpore's own ops, same math). `config` is the setting: train.fused_kernels for
    training, eval.fused_kernels for decoding. The one place this decision is made."""
    if not config:
        return f"{'train' if kind == 'train' else 'eval'}.fused_kernels is false"
    for var in (("MSLLM_FUSED_DECODE",) if kind == "decode" else ()) + ("MSLLM_FUSED_KERNELS",):
        if os.environ.get(var, "1") == "0":
            return f"{var}=0"
    if capabilities.device_target != "CPU":
        return f"device_target {capabilities.device_target} (the kernels are CPU custom ops)"
    if capabilities.compute != "fp32":
        return f"{capabilities.compute} compute (the fused kernels are fp32)"
    return ""


def enabled(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> bool:
    """Whether the native kernels of `kind` are asked for: the model, the optimizer, the memory plan, the
    decoder and the server all ask this (see `off_reason`)."""
    return not off_reason(config, capabilities, kind)
