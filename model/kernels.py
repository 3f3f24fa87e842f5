"""Whether the native kernels run: THE decision, asked by the build's convert step (tasks/modeling/build.py) for
the model and its optimizer, by the memory plan (tasks/training/memory.py) to predict the same, and by the
decoder (model/generate.py) for the fused decode step.

    off_reason(setting, Capabilities("CPU", "fp32"))   # '' when they run, else why not
    enabled(setting, Capabilities("CPU", "fp32"))      # not off_reason(...)

The kernels themselves, each concern in its own module:

| module | concern |
|---|---|
| `model/cpu.py` | /proc/cpuinfo, the ISA levels (flags per level), which level this CPU runs (MSLLM_KERNEL_ISA) |
| `model/kernel_build.py` | compile per level, verify in a subprocess, the private checksummed cache, `kernel_path()` |
| `model/kernel_ops.py` | the `ops.Custom` wrappers (`train_ops`, `zero_ops`) and their graph-time operand checks |
| `model/fused_cells.py` | the cells that run them, swapped into a plain model by the build's convert step |

Without g++ (or with MSLLM_FUSED_KERNELS=0) nothing is built and the model runs on MindSpore's built-in
kernels: the same math, slower (docs/MINDSPORE_CPU.md).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from model.kernel_build import disabled_reason


@dataclass(frozen=True)
class Capabilities:
    """What the place that would run a kernel offers: the device and the compute dtype."""

    device_target: str = "CPU"
    compute: str = "fp32"
    """"fp32", or "fp16"/"bf16" (half-precision compute: the fused kernels are fp32 only)."""


def off_reason(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> str:
    """Why the native kernels of `kind` ("train": the model's fused cells and the in-place AdamW; "decode": the
    fused decode step) do not run, or '' when they do (subject only to building: no compiler or a failed build
    then falls back to MindSpore's own ops, same math). `config` is the setting: train.fused_kernels for
    training, eval.fused_kernels for decoding. The one place this decision is made."""
    if not config:
        return f"{'train' if kind == 'train' else 'eval'}.fused_kernels is false"
    if kind == "decode" and os.environ.get("MSLLM_FUSED_DECODE", "1") == "0":
        return "MSLLM_FUSED_DECODE=0"
    if env := disabled_reason():  # MSLLM_FUSED_KERNELS=0, read in one place (model/kernel_build.py)
        return env
    if capabilities.device_target != "CPU":
        return f"device_target {capabilities.device_target} (the kernels are CPU custom ops)"
    if capabilities.compute != "fp32":
        return f"{capabilities.compute} compute (the fused kernels are fp32)"
    return ""


def enabled(config: bool, capabilities: Capabilities = Capabilities(), kind: str = "train") -> bool:
    """Whether the native kernels of `kind` are asked for (see `off_reason`)."""
    return not off_reason(config, capabilities, kind)


def decide(config: bool, device_target: str, compute: str) -> tuple[str, bool]:
    """The training build's decision: (why the model's fused cells do not run, or ''; whether its optimizer may run
    the in-place AdamW, which updates fp32 master weights whatever the compute dtype). Asked by the build's convert
    step (tasks/modeling/build.py) and, to predict it, by the memory plan (tasks/training/memory.py)."""
    return off_reason(config, Capabilities(device_target, compute)), enabled(config, Capabilities(device_target))
