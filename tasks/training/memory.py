"""Per-device training memory: an estimate, and a layout recommendation (`msllm plan`).

    est = estimate(model_cfg, micro_batch=8, seq=256, precision="fp32", recompute=False,
                   layout=Layout(dp=1, tp=1, pp=1))
    est.total, est.parts            # bytes per device
    plan(model_cfg, devices=8, device_memory=32 * 2**30, ...)  # ranked layouts that fit

Parts, per device:
- parameters: fp32 master weights (+ a half-precision copy under bf16/fp16), split by
  tensor parallel (attention/MLP matrices) and pipeline stages (layers);
- gradients: one per trainable parameter, in the compute dtype;
- optimizer: AdamW moments, 2 × fp32, divided by data parallel with optimizer_shard;
- master_share: with optimizer_shard (ZeRO-1, tasks/training/zero.py ShardedAdamW) where its
  in-place kernel (model/train_kernels.cc ZeroAdamW: CPU with a compiler, `fused_kernels`) does not run, the
  fp32 copy of this rank's 1/dp share of the parameters that MindSpore's AdamW kernel updates
  before the shares are gathered back (4 bytes per parameter / dp); the in-place kernel updates
  the parameters themselves and needs none;
- activations: what backward needs per layer per micro-batch, following Korthikanti
  et al. (2022, "Reducing Activation Recomputation") adapted to SwiGLU and GQA; with
  recompute only each layer's input is kept, plus one layer's working set (GPU/Ascend: on CPU the
  graph keeps the recomputed forward's buffers too, measured 5.10 vs 4.93 GB at SmolLM2-135M, so
  recompute lowers nothing there); a pipeline stage holds up to `pp` micro-batches in flight (1F1B);
- layerwise (`train.layerwise`, tasks/training/layerwise.py, where it applies: `layerwise_applies`):
  each layer's input plus ONE layer's working set, with the fused fp32 kernels also what each layer's
  written-out backward reads (`layer_saved_bytes`, tasks/training/layer_grad.py SAVED), and
  `graph_outputs`: the head graph's weight gradient and one layer's gradients, fresh buffers before
  they are copied into the step's gradient arrays (measured peaks: docs/MEMORY.md "Train");
- logits: the [B, T, V] logits, their softmax and gradient (fp32); with the fused cross-entropy
  (train.fused_kernels) only the logits and their gradient;
- runtime: the framework's own resident memory (CPU: the MindSpore process after
  import and graph compilation, measured on this machine; GPU/Ascend: workspace);
- graph (CPU, the whole-model step; 2/3 of it with LoRA): what the compiled step graph holds beyond its tensors,
  per decoder layer (`graph_bytes`): each kernel's own state (a oneDNN MatMul primitive ~0.3-0.8 MB) and what
  compiling the graph leaves in the C heap, which grows faster than the layer count. It depends on the depth, not
  on the width or the batch: measured at widths 384 and 576, MLP widths 768 and 1536, 64-512 tokens and 1-30 layers
  with the fused fp32 kernels, and 2-30 layers × 64-512 tokens with MindSpore's own ops (docs/MEMORY.md).
The graph executor on CPU keeps intermediates alive for the whole step; the
activation term carries a backend factor measured against peak RSS of real runs
(tests/test_memory.py holds the estimate within 30% of the tiny and small presets, and within 15% of the
SmolLM2-135M whole-model step, whose `graph` part is most of the difference; within 10% without the fused kernels).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from model.config import ModelConfig
from model.cpu import matmul_isa
from model.kernels import decide

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Resident memory of a MindSpore training process beyond the tensors (measured here, CPU).
RUNTIME_BYTES = {"CPU": int(0.615 * GiB), "GPU": int(1.0 * GiB), "Ascend": int(2.0 * GiB)}
# The same process running the layer-at-a-time step with the written-out layer backward (tasks/training/layer_grad.py):
# no whole-model graph is compiled, only small layer graphs (measured: tiny 8 x 64, 0.47 GiB peak in all).
RUNTIME_BYTES_LAYERWISE = {"CPU": int(0.45 * GiB)}
# Graph-mode executors keep more intermediates than the textbook minimum: on CPU every
# intermediate of the compiled step keeps its own buffer for the whole step (MindSpore's own ops: fitted
# with GRAPH_PER_LAYER_OPS below, peak RSS (VmHWM), scripts/measure_rss.py; it was 4.8 when fitted alone at 2-6 layers,
# which put tiny-llama-bench at 8 x 256 41% over and SmolLM2-135M at 2 x 256 12% over).
# GPU/Ascend reuse memory across the graph; their factor is the textbook 1 (untested here).
ACTIVATION_FACTOR = {"CPU": 2.24, "GPU": 1.0, "Ascend": 1.0}
# One layer at a time without the fused kernels (the autodiff layer graphs): its one layer's working set keeps the
# factor fitted at 2-6 layers, where that step was measured (tests/test_memory.py, within 30% at tiny and small).
ACTIVATION_FACTOR_LAYER = {"CPU": 4.8, "GPU": 1.0, "Ascend": 1.0}
# With the fused CPU kernels (train.fused_kernels, model/train_kernels.cc) softmax, SwiGLU, RMSNorm and the
# loss keep one buffer each instead of one per element-wise op: measured 1.44 GB (small, 8 × 128) and 1.22 GB
# (tiny-llama-bench, 8 × 256) against 2.13 and 1.96 GB with MindSpore's own ops.
ACTIVATION_FACTOR_FUSED = {"CPU": 1.1}
# The whole-model step graph on CPU beyond its tensors, per decoder layer L: GRAPH_PER_LAYER·L + GRAPH_PER_LAYER_SQ·L²
# (least squares over ten shapes of SmolLM2-135M's family, peak RSS, AMD EPYC AVX-512, 2026-12-04: within 0.09 GB of
# each; then the 360M shape, not in the fit: 8.94 GB estimated vs 9.02 measured; under oneDNN's AVX2 path 135M:
# 4.91 estimated vs 4.80 measured; with recompute 4.86 vs 5.05). Of 135M's 1.57 GB, 0.64 GB is the compilation's
# freed heap (the trainer trims it after the first step; the peak keeps it). Without weight gradients (LoRA: frozen
# projections) the backward has one MatMul per projection instead of two: ~2/3 of the kernels (135M whole-model LoRA:
# 2.73 GB estimated vs 2.66 measured).
GRAPH_PER_LAYER = int(0.0317e9)
GRAPH_PER_LAYER_SQ = int(0.00068e9)
# Without the fused kernels (MindSpore's own ops: more kernels per layer), fitted with ACTIVATION_FACTOR["CPU"]:
# GRAPH_PER_LAYER_OPS·L + GRAPH_PER_LAYER_SQ_OPS·L² (least squares over eleven shapes of SmolLM2-135M's family, 2-30
# layers × 2 × 64-512 tokens, peak RSS, AMD EPYC AVX-512, 2026-12-04: within 9.4% of each, 135M at 2 × 128 5.92 GB
# estimated vs 5.96 measured, where the factor alone had said 5.14; out of the fit, width 384 / MLP 768 at 24 layers
# 3.54 vs 3.44, small at 8 × 128 2.01 vs 2.13, tiny-llama-bench at 8 × 256 1.97 vs 1.96).
GRAPH_PER_LAYER_OPS = int(0.0360e9)
GRAPH_PER_LAYER_SQ_OPS = int(0.00096e9)


def graph_bytes(layers: int, trainable_fraction: float = 1.0, fused: bool = True) -> int:
    """The whole-model CPU step graph's own memory for `layers` decoder layers (module doc, `graph`); `fused`: with
    the fused fp32 kernels, else MindSpore's own ops."""
    a, b = (GRAPH_PER_LAYER, GRAPH_PER_LAYER_SQ) if fused else (GRAPH_PER_LAYER_OPS, GRAPH_PER_LAYER_SQ_OPS)
    full = a * layers + b * layers * layers
    return full if trainable_fraction >= 1.0 else full * 2 // 3


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    micro_batch_num: int = 1
    optimizer_shard: bool = False

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp


@dataclass
class Estimate:
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def table(self) -> str:
        rows = [f"  {k:<12} {v / GiB:8.3f} GiB" for k, v in self.parts.items()]
        return "\n".join([*rows, f"  {'total':<12} {self.total / GiB:8.3f} GiB"])


def layer_params(cfg: ModelConfig, tp: int = 1) -> int:
    """Parameters of one decoder layer (its matrices split by tensor parallel; its two norms whole)."""
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    attn = h * h * 2 + h * kv * 2  # q, o + k, v
    mlp = 3 * h * f
    return (attn + mlp) // tp + 2 * h


def param_split(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters held by one device (the first pipeline stage, which also holds the embedding)."""
    h = cfg.hidden_size
    per_layer = layer_params(cfg, layout.tp)
    layers = -(-cfg.num_layers // layout.pp)
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    first_stage_extra = embed + (head if layout.pp == 1 else 0) + h
    return per_layer * layers + first_stage_extra


def layerwise_applies(
    layout: Layout, trainable_fraction: float = 1.0, *, written_out: bool, backend: str = "CPU"
) -> bool:
    """Whether `train.layerwise` runs the layer-at-a-time step for this layout (else the trainer runs the whole-model
    step: tasks/training/layerwise.py `layerwise_unsupported`): CPU, no tensor or pipeline parallel, and every
    parameter trained or, LoRA (a fraction trained), the written-out layer functions (`written_out`: fused fp32
    kernels)."""
    return backend == "CPU" and layout.tp == 1 and layout.pp == 1 and (trainable_fraction >= 1.0 or written_out)


def layer_activation_bytes(
    cfg: ModelConfig, micro_batch: int, seq: int, precision: str, tp: int = 1, *, fused_attention: bool = False
) -> float:
    """What one layer keeps for its backward, for one micro-batch. `fused_attention`: the attention kernel
    (model/fused_cells.py FusedCausalAttention, fused fp32 builds) keeps one log-sum-exp per query and head instead of
    the [B·nh, T, S] scores and probabilities."""
    s, b, h, a = seq, micro_batch, cfg.hidden_size, cfg.num_heads
    kv = cfg.num_kv_heads * cfg.head_dim
    f, t = cfg.intermediate_size, tp
    # elements per token kept for backward in one layer:
    #   norms' inputs/outputs 4h, q,k,v (h + 2kv)/t, rope'd q,k (h + kv)/t, attention context h/t,
    #   scores + softmax 2·a·s/t (+ the fp32 mask-add) or the kernel's log-sum-exp a/t, o_proj out h,
    #   MLP gate/up/act/product 4f/t
    scores = a / t if fused_attention else 3 * a * s / t
    per_token = 4 * h + (2 * h + 3 * kv + h) / t + scores + h + 4 * f / t
    return s * b * per_token * DTYPE_BYTES[precision]


def layer_saved_bytes(cfg: ModelConfig, micro_batch: int, seq: int) -> int:
    """What the layer-at-a-time step keeps per layer between its forward and its written-out backward (fused fp32
    kernels: tasks/training/layer_grad.py SAVED): roped queries and keys, values, attention output, the residual
    after attention, gate and up, the attention rows' log-sum-exp (one per head), per token; fp32."""
    h, kv, f = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    return micro_batch * seq * (3 * h + 2 * kv + 2 * f + cfg.num_heads) * 4


def activation_bytes(
    cfg: ModelConfig,
    micro_batch: int,
    seq: int,
    precision: str,
    recompute: bool,
    layout: Layout,
    fused_attention: bool = False,
) -> int:
    s, b, h, e = seq, micro_batch, cfg.hidden_size, DTYPE_BYTES[precision]
    full_layer = layer_activation_bytes(cfg, micro_batch, seq, precision, layout.tp, fused_attention=fused_attention)
    layers = -(-cfg.num_layers // layout.pp)
    in_flight = min(layout.pp, layout.micro_batch_num)
    if recompute:
        return int((layers * s * b * h * e + full_layer) * in_flight)
    return int(layers * full_layer * in_flight)


def estimate(
    cfg: ModelConfig,
    *,
    micro_batch: int,
    seq: int,
    precision: str = "fp32",
    recompute: bool = False,
    layout: Layout = Layout(),
    backend: str = "CPU",
    trainable_fraction: float = 1.0,
    fused_kernels: bool = True,
    layerwise: bool = False,
) -> Estimate:
    """Bytes per device. `fused_kernels`: train.fused_kernels (they run on CPU, fp32, with a compiler);
    `layerwise`: train.layerwise (ignored where it does not apply, as the trainer ignores it)."""
    p = param_split(cfg, layout)
    half = precision != "fp32"
    why, in_place = decide(fused_kernels, backend, precision)  # what the build's convert step will decide
    fused = not why
    trainable = int(p * trainable_fraction)
    zero = layout.optimizer_shard and layout.dp > 1
    opt = trainable * 8 // (layout.dp if layout.optimizer_shard else 1)
    # the fused loss keeps the logits and their gradient; where MatMul runs oneDNN's AVX2 path the head's backward
    # also transposes the gradient (model/fused_cells.py FusedHeadMatMul)
    logits = ((3 if matmul_isa() == "avx2" else 2) if fused else 3) * micro_batch * seq * cfg.vocab_size * 4
    layer_at_a_time = layerwise and layerwise_applies(
        layout, trainable_fraction, written_out=fused and not half, backend=backend
    )
    own_ops = ACTIVATION_FACTOR_LAYER if layer_at_a_time else ACTIVATION_FACTOR  # MindSpore's own ops
    factor = ACTIVATION_FACTOR_FUSED[backend] if fused else own_ops.get(backend, 1.0)
    outputs, runtime = {}, RUNTIME_BYTES.get(backend, GiB)
    if layer_at_a_time:
        one = layer_activation_bytes(cfg, micro_batch, seq, precision, fused_attention=fused and not half) * factor
        act = int(cfg.num_layers * micro_batch * seq * cfg.hidden_size * DTYPE_BYTES[precision] + one)
        if fused and not half:  # the written-out backward reads what the forward kept (no recomputed forward)
            act += cfg.num_layers * layer_saved_bytes(cfg, micro_batch, seq)
            runtime = RUNTIME_BYTES_LAYERWISE.get(backend, runtime)
        # the head graph's gradient of the [V, H] head (the embedding when tied) and of the final norm, then one
        # layer's gradients: fresh output buffers until copied into the step's arrays (the `gradients` part)
        outputs = {
            "graph_outputs": (cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + layer_params(cfg)) * 4
            if trainable_fraction >= 1.0
            else trainable // cfg.num_layers * 4
        }  # LoRA: one layer's adapters
    else:
        # on CPU the graph keeps the recomputed forward's buffers as well: recompute lowers nothing (module doc)
        act = int(
            activation_bytes(
                cfg, micro_batch, seq, precision, recompute and backend != "CPU", layout, fused and not half
            )
            * factor
        )
        if backend == "CPU":
            outputs = {"graph": graph_bytes(-(-cfg.num_layers // layout.pp), trainable_fraction, fused)}
    return Estimate(
        {
            "parameters": p * 4 + (p * 2 if half else 0),
            "gradients": trainable * DTYPE_BYTES[precision],
            "optimizer": opt,
            **({"master_share": trainable * 4 // layout.dp} if zero and not in_place else {}),
            "activations": act,
            **outputs,
            "logits": logits,
            "runtime": runtime,
        }
    )


MAX_TP = 8  # tensor parallel stays inside one node's fast links


def candidate_layouts(cfg: ModelConfig, devices: int, global_batch: int | None = None) -> list[Layout]:
    """Every (dp, tp, pp, optimizer_shard) of `devices`: O(MAX_TP × num_layers), whatever the device count
    (tp and pp are bounded; dp is what is left), so `plan --devices 1000000000000` answers at once."""
    out = []
    for tp in range(1, min(devices, MAX_TP) + 1):
        if devices % tp or cfg.num_heads % tp or cfg.num_kv_heads % tp:
            continue
        for pp in range(1, min(devices // tp, cfg.num_layers) + 1):
            if (devices // tp) % pp:
                continue
            dp = devices // (tp * pp)
            for shard in (False, True) if dp > 1 else (False,):
                out.append(
                    Layout(dp=dp, tp=tp, pp=pp, micro_batch_num=max(1, 4 * pp if pp > 1 else 1), optimizer_shard=shard)
                )
    return out


def unsupported(layout: Layout, backend: str) -> str | None:
    """Why this pipeline cannot run `layout` on `backend` (None when it can): see the README's support matrix
    (docs/DISTRIBUTED.md in detail)."""
    if layout.pp > 1:
        return "pipeline stages: Ascend/GPU only, not built" if backend == "CPU" else "pipeline stages: not built"
    if layout.optimizer_shard and layout.dp > 1 and layout.tp > 1:
        return "optimizer sharding with tensor parallel: not built (ZeRO-1 is built for data parallel)"
    return None


MODES = ("off", "recompute", "layerwise")
"""How a layout may save activation memory, cheapest in compute first: none, `pretrain.recompute` (a second forward
inside the graph; lowers nothing on CPU, module doc), `train.layerwise` (CPU, where `layerwise_applies`, and there
the default: the step one layer at a time, 0.8-1.0× the whole-model step's speed, docs/MEMORY.md "Train")."""


def mode_order(backend: str) -> tuple[str, ...]:
    """The plan's preference among modes that fit: MODES' order, except on CPU, where the layer-at-a-time step is the
    default (faster than torch.compile at HF sdpa's memory or less) and comes first; the whole-model step there is a
    choice for speed where memory is plentiful."""
    return ("layerwise", "off", "recompute") if backend == "CPU" else MODES


def mode_setting(mode: str, backend: str) -> str:
    """What a plan row's mode is in pipelines.yaml. On CPU `train.layerwise` is on by default, so the whole-model
    modes say to turn it off."""
    whole = ", pretrain.train.layerwise: false" if backend == "CPU" else ""
    return {
        "off": f"pretrain.recompute: false{whole}",
        "recompute": f"pretrain.recompute: true{whole}",
        "layerwise": "pretrain.train.layerwise: true (the default on CPU)",
    }[mode]


def plan(
    cfg: ModelConfig,
    *,
    devices: int,
    device_memory: int,
    micro_batch: int,
    seq: int,
    precision: str,
    backend: str = "Ascend",
) -> list[tuple[Layout, str, Estimate, bool]]:
    """Every candidate (layout, mode of MODES) with its estimate and whether it fits, best first.

    Layouts this pipeline can run (`unsupported(...) is None`) come before those it cannot.
    Preference among layouts that fit: the mode (`mode_order`: on GPU/Ascend the cheapest in compute, recompute
    costing ~1/3 more; on CPU the default layer-at-a-time step first), then the least model splitting (tensor
    parallel before pipeline parallel: TP needs fast intra-node links, PP adds bubbles), then optimizer sharding off.
    """
    rows = []
    for lay in candidate_layouts(cfg, devices):
        for mode in MODES:
            if mode == "layerwise" and not layerwise_applies(lay, written_out=False, backend=backend):
                continue
            est = estimate(
                cfg,
                micro_batch=micro_batch,
                seq=seq,
                precision=precision,
                recompute=mode == "recompute",
                layerwise=mode == "layerwise",
                layout=lay,
                backend=backend,
            )
            rows.append((lay, mode, est, est.total <= device_memory))

    def rank(r):
        lay, mode, est, fits = r
        return (
            not fits,
            unsupported(lay, backend) is not None,
            mode_order(backend).index(mode),
            lay.tp * lay.pp,
            lay.pp,
            lay.optimizer_shard,
            est.total,
        )

    rows.sort(key=rank)
    return rows


def machine_memory() -> int:
    """Physical memory of this machine in bytes (what CPU training ranks on it share)."""
    try:
        import psutil  # lazy: the CLI's plan and the runner import this module and need no psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_fit_errors(cfg, prefix: str, machine_bytes: int | None = None) -> list[str]:
    """Settings no machine here can serve, by the memory plan, before any compute (a config error each).

    On CPU the ranks of this node (parallel.device_num / node_num processes) share this machine's memory:
    pretrain's micro batch × sequence length, the model and the device count must fit, and so must
    finetune's micro batch. GPU/Ascend device memory is not known here (`msllm plan --device-memory`).
    `cfg` is a tasks.config.schema.PipelineConfig.
    """
    par = cfg.parallel
    if par.device_target != "CPU":
        return []
    have = machine_bytes or machine_memory()
    mc = cfg.model.resolve()
    local = max(1, par.device_num // max(par.node_num, 1))
    lay = Layout(dp=par.data_parallel, tp=par.tensor_parallel, optimizer_shard=par.optimizer_shard)
    pt, ft = cfg.pretrain, cfg.finetune
    ptr, ftr = pt.train, ft.train
    seq = pt.seq_length
    errs = []
    for key, micro, s, kw in (
        (
            "pretrain.train.loop.micro_batch_size",
            ptr.loop.micro_batch_size,
            seq,
            {
                "precision": ptr.precision.dtype,
                "recompute": pt.recompute,
                "layout": lay,
                "fused_kernels": ptr.fused_kernels,
                "layerwise": ptr.layerwise,
            },
        ),
        (
            "finetune.train.loop.micro_batch_size",
            ftr.loop.micro_batch_size,
            ft.seq_length or seq,
            {
                "trainable_fraction": 0.05 if ft.method == "lora" else 1.0,
                "fused_kernels": ftr.fused_kernels,
                "layerwise": ftr.layerwise,
            },
        ),
    ):
        stage = key.split(".")[0]
        procs = local if stage == "pretrain" else 1  # the pretrain ranks of this node share its memory
        est = estimate(mc, micro_batch=micro, seq=s, backend="CPU", **kw)
        need = est.total * procs
        if need > have:
            lw = (
                None
                if kw["layerwise"]
                else estimate(mc, micro_batch=micro, seq=s, backend="CPU", **{**kw, "layerwise": True})
            )
            lw_need = lw.total * procs if lw is not None else 0
            if lw is not None and lw.total < est.total and lw_need <= have:  # the step one layer at a time fits
                errs.append(
                    f"{prefix}.{stage}.train.layerwise: false, and {micro} × seq_length {s} with model "
                    f"{cfg.model.preset} needs about {need / GiB:,.1f} GiB by the memory plan but this machine "
                    f"has {have / GiB:.1f} GiB; set {stage}.train.layerwise: true (the step one decoder layer "
                    f"at a time, the default: about {lw_need / GiB:,.1f} GiB, at 0.8-1.0× the speed) or lower {key}"
                )
                continue
            ranks = f" × {local} ranks on this node" if procs > 1 else ""
            big = max(est.parts, key=est.parts.get)
            big = "the step graph's own memory, which grows with the layer count" if big == "graph" else big
            if est.total <= have:  # one process fits: the device count is what does not
                errs.append(
                    f"{prefix}.parallel.device_num: {par.device_num} ranks, {local} on this node, need about "
                    f"{need / GiB:,.1f} GiB by the memory plan ({est.total / GiB:,.1f} GiB each) but this "
                    f"machine has {have / GiB:.1f} GiB; use fewer ranks per node (device_num, node_num)"
                )
                continue
            errs.append(
                f"{prefix}.{key}: {micro} × seq_length {s} with model {cfg.model.preset} needs about "
                f"{need / GiB:,.1f} GiB by the memory plan ({est.total / GiB:,.1f} GiB per process{ranks}, "
                f"mostly {big}) but this machine has {have / GiB:.1f} GiB; lower {key}, the sequence "
                "length or parallel.device_num (see `msllm plan`)"
            )
    return errs
