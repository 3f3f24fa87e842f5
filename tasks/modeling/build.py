"""One way to build a network, for every stage that needs one (torchtitan's order: build → convert → parallelize).

    built = build_network("llama", config, seed=0, precision="fp32", fused_kernels=True, mesh=mesh)
    built.net                    # the MindSpore network: this rank's slice, the fused cells where they run
    built.kernels.model          # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>" (logged; in the manifest)
    built.kernels.optimizer      # whether the optimizer runs the in-place AdamW kernel (parallelize_optimizer)
    net, info = load_network(artifact_dir)   # a model artifact's network, plain, eval mode (eval, serving, export)
    gen = generator(net, fused=True)         # its generator: the decode path chosen once, logged with its reason

The steps, each once, in this order:

1. build: the registry's plain model (model/registry.py: no kernel or parallel code inside) in the compute dtype,
   seeded; a model artifact's full weights (continued pretraining, finetuning, eval, serving) assigned by name;
2. convert: THE kernel decision (model.kernels.decide from the device, the compute precision and the
   fused_kernels setting); where it says yes and the kernel library builds, the fused cells (model/fused_cells.py)
   replace the plain ones of the same signature (the LM head's MatMul too, where MindSpore's MatMul runs oneDNN's
   AVX2 path: model.cpu.matmul_isa), and the optimizer is told (`Kernels.optimizer`);
3. parallelize: the tensor-parallel plan (tasks/modeling/parallelize.py TP_PLAN) for this rank of the mesh.

Pretraining (new and continued), finetuning, the memory measurement, eval, serving and export all get their
network here, so the parameter names and the init are the same everywhere (tests/test_model.py checks it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import nn

from model.config import ModelConfig
from model.cpu import matmul_isa
from model.fused_cells import (
    FusedCausalAttention,
    FusedCausalLMLoss,
    FusedCausalSoftmax,
    FusedHeadMatMul,
    FusedRMSNorm,
    FusedSwiGLU,
)
from model.fused_decode import (
    DecodeWeights,
    build_decode_kernel,
    decode_disabled_reason,
    matrix_names,
    stored_format_misfit,
    stored_matrix,
    stored_shape,
)
from model.generate import Generator
from model.kernel_build import kernel_path
from model.kernel_ops import train_ops
from model.kernels import decide
from model.layers import RMSNorm
from model.llama import MLP, Attention
from model.registry import build_model
from model.runtime import trim_heap
from tasks.modeling.parallelize import parallelize
from tasks.runtime.mesh import Mesh
from tasks.store.model_artifact import model_config, read_info
from tasks.store.tensors import CheckpointError, assign, load_weights


@dataclass(frozen=True)
class Kernels:
    """The one kernel decision of a build, for the model and for its optimizer."""

    model: str
    """Which native body the model's fused cells run ("avx512", "avx2", "neon", "scalar"), or "off: <why>"."""
    optimizer: bool
    """Whether the optimizer may run the in-place AdamW kernel (its master weights are fp32 whatever the compute)."""

    @property
    def fused(self) -> bool:
        return not self.model.startswith("off")


@dataclass(frozen=True)
class Built:
    net: nn.Cell
    config: ModelConfig
    kernels: Kernels


def compute_dtype(precision: str):
    """The network's compute dtype for a precision setting: fp16 runs fp16 matmuls on fp32 master weights;
    fp32 (and bf16, which MindSpore's CPU backend runs as fp32 here) build an fp32 network."""
    return ms.float16 if precision == "fp16" else ms.float32


def convert(net: nn.Cell, fused_kernels: bool, device: str | None = None) -> Kernels:
    """Decide once whether the native kernels run (device, compute precision, the setting); where they do, swap the
    fused cells into `net` in place. Returns the decision for the model and for its optimizer."""
    device = device or ms.get_context("device_target")
    compute = "fp16" if getattr(net, "half", False) else "fp32"
    why, optimizer = decide(fused_kernels, device, compute)
    if why:
        return Kernels(f"off: {why}", optimizer)
    kernels = train_ops()
    if kernels is None:  # no compiler or a failed build: MindSpore's own ops (kernel_path says why)
        return Kernels(kernel_path(), optimizer)
    for _, cell in net.cells_and_names():
        if isinstance(cell, RMSNorm):
            cell.normalize = FusedRMSNorm(kernels, cell.eps)
        elif isinstance(cell, Attention):
            cell.softmax = FusedCausalSoftmax(kernels)  # the layer-at-a-time backward's (tasks/training/layer_grad.py)
            cell.fused = FusedCausalAttention(kernels)
        elif isinstance(cell, MLP):
            cell.swiglu = FusedSwiGLU(kernels)
    net.loss_fn = FusedCausalLMLoss(kernels)
    if matmul_isa() == "avx2":  # the head's weight gradient without oneDNN's AVX2 transposed-A MatMul (the cell says)
        if net.tie_embeddings:
            net.tied_matmul = FusedHeadMatMul(kernels)
        else:
            net.lm_head.matmul = FusedHeadMatMul(kernels)
    return Kernels(kernel_path(), optimizer)


def build_network(
    name: str,
    config: ModelConfig,
    *,
    seed: int | None = 0,
    precision: str = "fp32",
    fused_kernels: bool = False,
    mesh: Mesh | None = None,
    weights: dict[str, Any] | None = None,
    source: str = "",
) -> Built:
    """build → (full weights) → convert → parallelize: the network every stage trains or runs. `weights` (full,
    unsplit, by parameter name) come from `source` (named in a mismatch error) and move into the network (popped
    from the dict); `mesh` defaults to one process."""
    # With weights, the model is built without drawing or allocating its projections (they are placeholders until
    # assigned) and the weights move into it: the process holds them once (docs/MEMORY.md, "Loading").
    net = build_model(name, config, seed=seed, compute_dtype=compute_dtype(precision), init_weights=weights is None)
    if weights is not None:
        assign(net.trainable_params(), weights, source, take=True)
        if lazy := [p.name for p in net.get_parameters() if p.has_init]:
            raise RuntimeError(f"{source}: parameters {lazy[:3]} were not assigned (not trainable when loaded)")
    kernels = convert(net, fused_kernels)
    parallelize(net, mesh or Mesh())
    return Built(net, config, kernels)


def load_network(path: str | Path, *, seed: int = 0, weights: str = "fp32") -> tuple[nn.Cell, dict[str, Any]]:
    """(the plain network of model artifact `path` with its weights, in eval mode; its model.json) for inference:
    eval, serving, export (their decoding kernels are the decode step's, model/generate.py).

    `weights` "fp16" or "q8_0": the weight matrices are read straight into that format, one tensor at a time (each
    float32 matrix dropped as soon as it is converted), and only the fused decode steps can run the network: its
    own matrices stay unallocated placeholders, so the process never holds the float32 weights (SmolLM2-135M: 0.54
    GB of them; the stored ones 0.27 / 0.14 GB). Its `Generator` (in that format) decodes, prefills and scores one
    sequence at a time; the MindSpore paths (a second interleaved sequence, LoRA, fused_kernels off) refuse with
    a DecodeError. Where the fused kernel does not run here or the model does not fit the format, the network loads
    whole (float32) and says why on stderr; a Generator asked for the format then copies the matrices into it."""
    info = read_info(path)
    config = model_config(path)
    if weights != "fp32":
        why = stored_format_misfit(config, weights)
        if not why and build_decode_kernel(True) is None:
            why = f"the fused decode kernel does not run here ({decode_disabled_reason(True) or 'no build'})"
        if not why:
            return _load_stored(path, info, config, weights, seed), info
        print(f"[load] {path}: {weights} weights only: {why}; loading the float32 weights", file=sys.stderr)
    built = build_network(
        info.get("name", "llama"),
        config,
        seed=seed,
        weights=load_weights(path),
        source=str(path),
    )
    built.net.set_train(False)
    return built.net, info


def _load_stored(path: str | Path, info: dict[str, Any], config: ModelConfig, dtype: str, seed: int) -> nn.Cell:
    """`load_network` with only the weight matrices in `dtype` (`DecodeWeights(stored=...)`), the rest float32."""
    net = build_model(info.get("name", "llama"), config, seed=seed, init_weights=False)
    shapes = {p.name: tuple(p.shape) for p in net.get_parameters()}
    mats = set(matrix_names(net))

    def convert(name: str, arr: np.ndarray) -> np.ndarray:  # a matrix's rows (read_tensors: a block at a time)
        if name not in mats:
            return arr
        if arr.ndim != 2 or arr.shape[1] != shapes[name][1]:
            raise CheckpointError(f"{path}: {name} has rows of shape {arr.shape[1:]}, model wants {shapes[name]}")
        return stored_matrix(arr, dtype)

    arrays = load_weights(path, convert)
    if missing := sorted(mats - set(arrays)):
        raise CheckpointError(f"{path} lacks {missing[:3]}; it belongs to another model (compare its model.json)")
    for name in mats:
        if arrays[name].shape != stored_shape(shapes[name], dtype):
            rows = arrays[name].shape[0]
            raise CheckpointError(f"{path}: {name} has {rows} rows, model wants {shapes[name]}")
    stored = {k: arrays.pop(k) for k in mats}
    assign([p for p in net.trainable_params() if p.name not in mats], arrays, str(path), take=True)
    object.__setattr__(net, "stored_weights", DecodeWeights(net, dtype, stored))  # not a sub-cell: not a parameter
    net.set_train(False)
    trim_heap()  # the read and conversion buffers handed back to the OS
    return net


def generator(net: nn.Cell, *, fused: bool = True, max_len: int | None = None, weights: str = "fp32"):
    """THE generator of a network, for every place that generates (eval's lm-eval adapter and `msllm predict`, the
    MindSpore serving backend, the export check, the benchmarks): model/generate.py `Generator`, whose decode and
    prefill path (fused kernel, MindSpore graph) is chosen once, here, logged with its reason (`msllm.generate`) and
    kept as `decode_path` / `decode_reason` for /health and the decode bench. `fused=False`: MindSpore's own ops
    (eval.fused_kernels: false); `max_len`: cache slots (default: the model's max_seq_length); `weights`: the fused
    steps' weight matrices, "fp32" (the net's own), "fp16" or "q8_0" (copies, or the only ones of a network loaded
    with `load_network(..., weights=)`; model/fused_decode.py)."""
    return Generator(net, max_len=max_len, fused=fused, weights=weights)


def log_kernels(kernels: Kernels, stage: str) -> str:
    """One log line when the native kernels are off (why), and the manifest's `native_kernels` value."""
    if not kernels.fused:
        print(f"[{stage}] native kernels: {kernels.model}; MindSpore's own ops run", file=sys.stderr, flush=True)
    return kernels.model
