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
  recompute only each layer's input is kept, plus one layer's working set; a pipeline
  stage holds up to `pp` micro-batches in flight (1F1B);
- logits: the [B, T, V] logits, their softmax and gradient (fp32); with the fused cross-entropy
  (train.fused_kernels) only the logits and their gradient;
- runtime: the framework's own resident memory (CPU: the MindSpore process after
  import and graph compilation, measured on this machine; GPU/Ascend: workspace).
The graph executor on CPU keeps intermediates alive for the whole step; the
activation term carries a backend factor measured against peak RSS of real runs
(tests/test_memory.py holds the estimate within 30% of the tiny and small presets).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from model.config import ModelConfig
from model.kernels import decide

GiB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Resident memory of a MindSpore training process beyond the tensors (measured here, CPU).
RUNTIME_BYTES = {"CPU": int(0.615 * GiB), "GPU": int(1.0 * GiB), "Ascend": int(2.0 * GiB)}
# Graph-mode executors keep more intermediates than the textbook minimum: on CPU every
# intermediate of the compiled step keeps its own buffer for the whole step (measured
# here: peak RSS (VmHWM) of tiny / small / tiny-llama-bench steps, scripts/measure_rss.py).
# GPU/Ascend reuse memory across the graph; their factor is the textbook 1 (untested here).
ACTIVATION_FACTOR = {"CPU": 4.8, "GPU": 1.0, "Ascend": 1.0}
# With the fused CPU kernels (train.fused_kernels, model/train_kernels.cc) softmax, SwiGLU, RMSNorm and the
# loss keep one buffer each instead of one per element-wise op: measured 1.44 GB (small, 8 × 128) and 1.22 GB
# (tiny-llama-bench, 8 × 256) against 2.13 and 1.96 GB with MindSpore's own ops.
ACTIVATION_FACTOR_FUSED = {"CPU": 1.1}


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


def param_split(cfg: ModelConfig, layout: Layout) -> int:
    """Parameters held by one device (the first pipeline stage, which also holds the embedding)."""
    h, f, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    attn = h * h * 2 + h * kv * 2  # q, o + k, v
    mlp = 3 * h * f
    per_layer = (attn + mlp) // layout.tp + 2 * h
    layers = -(-cfg.num_layers // layout.pp)
    embed = cfg.vocab_size * h
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * h
    first_stage_extra = embed + (head if layout.pp == 1 else 0) + h
    return per_layer * layers + first_stage_extra


def activation_bytes(cfg: ModelConfig, micro_batch: int, seq: int, precision: str, recompute: bool,
                     layout: Layout) -> int:
    s, b, h, a = seq, micro_batch, cfg.hidden_size, cfg.num_heads
    kv = cfg.num_kv_heads * cfg.head_dim
    f = cfg.intermediate_size
    e = DTYPE_BYTES[precision]
    t = layout.tp
    # elements per token kept for backward in one layer:
    #   norms' inputs/outputs 4h, q,k,v (h + 2kv)/t, rope'd q,k (h + kv)/t, attention context h/t,
    #   scores + softmax 2·a·s/t (+ the fp32 mask-add), o_proj out h, MLP gate/up/act/product 4f/t
    per_token = 4 * h + (2 * h + 3 * kv + h) / t + 3 * a * s / t + h + 4 * f / t
    full_layer = s * b * per_token * e
    layers = -(-cfg.num_layers // layout.pp)
    in_flight = min(layout.pp, layout.micro_batch_num)
    if recompute:
        return int((layers * s * b * h * e + full_layer) * in_flight)
    return int(layers * full_layer * in_flight)


def estimate(cfg: ModelConfig, *, micro_batch: int, seq: int, precision: str = "fp32", recompute: bool = False,
             layout: Layout = Layout(), backend: str = "CPU", trainable_fraction: float = 1.0,
             fused_kernels: bool = True) -> Estimate:
    """Bytes per device. `fused_kernels`: train.fused_kernels (they run on CPU, fp32, with a compiler)."""
    p = param_split(cfg, layout)
    half = precision != "fp32"
    why, in_place = decide(fused_kernels, backend, precision)  # what the build's convert step will decide
    fused = not why
    trainable = int(p * trainable_fraction)
    zero = layout.optimizer_shard and layout.dp > 1
    opt = trainable * 8 // (layout.dp if layout.optimizer_shard else 1)
    logits = (2 if fused else 3) * micro_batch * seq * cfg.vocab_size * 4
    factor = ACTIVATION_FACTOR_FUSED[backend] if fused else ACTIVATION_FACTOR.get(backend, 1.0)
    act = int(activation_bytes(cfg, micro_batch, seq, precision, recompute, layout) * factor)
    return Estimate({
        "parameters": p * 4 + (p * 2 if half else 0),
        "gradients": trainable * DTYPE_BYTES[precision],
        "optimizer": opt,
        **({"master_share": trainable * 4 // layout.dp} if zero and not in_place else {}),
        "activations": act,
        "logits": logits,
        "runtime": RUNTIME_BYTES.get(backend, GiB),
    })


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
                out.append(Layout(dp=dp, tp=tp, pp=pp, micro_batch_num=max(1, 4 * pp if pp > 1 else 1), optimizer_shard=shard))
    return out


def unsupported(layout: Layout, backend: str) -> str | None:
    """Why this pipeline cannot run `layout` on `backend` (None when it can): see the README's support matrix (docs/DISTRIBUTED.md in detail)."""
    if layout.pp > 1:
        return "pipeline stages: Ascend/GPU only, not built" if backend == "CPU" else "pipeline stages: not built"
    if layout.optimizer_shard and layout.dp > 1 and layout.tp > 1:
        return "optimizer sharding with tensor parallel: not built (ZeRO-1 is built for data parallel)"
    return None


def plan(cfg: ModelConfig, *, devices: int, device_memory: int, micro_batch: int, seq: int, precision: str,
         backend: str = "Ascend") -> list[tuple[Layout, bool, Estimate, bool]]:
    """Every candidate (layout, recompute) with its estimate and whether it fits, best first.

    Layouts this pipeline can run (`unsupported(...) is None`) come before those it cannot.
    Preference among layouts that fit: no recompute (it costs ~1/3 more compute), then
    the least model splitting (tensor parallel before pipeline parallel: TP needs fast
    intra-node links, PP adds bubbles), then optimizer sharding off.
    """
    rows = []
    for lay in candidate_layouts(cfg, devices):
        for rc in (False, True):
            est = estimate(cfg, micro_batch=micro_batch, seq=seq, precision=precision, recompute=rc, layout=lay, backend=backend)
            rows.append((lay, rc, est, est.total <= device_memory))

    def rank(r):
        lay, rc, est, fits = r
        return (not fits, unsupported(lay, backend) is not None, rc, lay.tp * lay.pp, lay.pp, lay.optimizer_shard,
                est.total)

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
        ("pretrain.train.loop.micro_batch_size", ptr.loop.micro_batch_size, seq,
         {"precision": ptr.precision.dtype, "recompute": pt.recompute, "layout": lay,
          "fused_kernels": ptr.fused_kernels}),
        ("finetune.train.loop.micro_batch_size", ftr.loop.micro_batch_size, ft.seq_length or seq,
         {"trainable_fraction": 0.05 if ft.method == "lora" else 1.0, "fused_kernels": ftr.fused_kernels}),
    ):
        est = estimate(mc, micro_batch=micro, seq=s, backend="CPU", **kw)
        need = est.total * (local if key.startswith("pretrain") else 1)
        if need > have:
            ranks = f" × {local} ranks on this node" if local > 1 and key.startswith("pretrain") else ""
            big = max(est.parts, key=est.parts.get)
            if est.total <= have:  # one process fits: the device count is what does not
                errs.append(f"{prefix}.parallel.device_num: {par.device_num} ranks, {local} on this node, need about "
                            f"{need / GiB:,.1f} GiB by the memory plan ({est.total / GiB:,.1f} GiB each) but this "
                            f"machine has {have / GiB:.1f} GiB; use fewer ranks per node (device_num, node_num)")
                continue
            errs.append(f"{prefix}.{key}: {micro} × seq_length {s} with model {cfg.model.preset} needs about "
                        f"{need / GiB:,.1f} GiB by the memory plan ({est.total / GiB:,.1f} GiB per process{ranks}, "
                        f"mostly {big}) but this machine has {have / GiB:.1f} GiB; lower {key}, the sequence "
                        "length or parallel.device_num (see `msllm plan`)")
    return errs
