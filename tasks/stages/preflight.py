"""What `msllm plan` and `msllm validate --forward` ask before any stage runs: the memory plan and one forward pass.

    report = memory_plan(cfg, device_memory=32 * GiB, devices=8)
    print("\n".join(report.lines)); report.runnable   # False: no layout both fits and runs here
    print(forward_check(cfg))                         # builds the model, one forward pass: one line

The CLI reaches the training room (tasks.training.memory) and the model only through the stages (`tasks/stages`),
so these live here; the machine-fit check every training stage runs is the stage runner's (runner.check_machine).
MindSpore is imported by `forward_check` only (the memory plan is arithmetic).
"""

from __future__ import annotations

import time
from typing import NamedTuple

from model.runtime import setup_mindspore
from tasks.config.schema import PipelineConfig
from tasks.training.memory import GiB, Layout, estimate, mode_setting, plan, unsupported


class PlanReport(NamedTuple):
    lines: list[str]
    """The estimate of the configured layout, the ranked layouts, the recommendation."""
    runnable: bool
    """Whether some layout both fits and runs here (the recommendation names it)."""


def memory_plan(cfg: PipelineConfig, device_memory: int, devices: int | None = None) -> PlanReport:
    """The configured layout's estimate per rank, then the layouts for `devices` (default parallel.device_num)
    devices of `device_memory` bytes, best first, and a recommendation."""
    mc = cfg.model.resolve()
    par, pt, tr = cfg.parallel, cfg.pretrain, cfg.pretrain.train
    seq = pt.seq_length
    lay = Layout(
        dp=par.data_parallel,
        tp=par.tensor_parallel,
        pp=cfg.plan.pipeline_parallel,
        micro_batch_num=cfg.plan.micro_batch_num,
        optimizer_shard=par.optimizer_shard,
    )
    est = estimate(
        mc,
        micro_batch=tr.loop.micro_batch_size,
        seq=seq,
        precision=tr.precision.dtype,
        recompute=pt.recompute,
        layout=lay,
        backend=par.device_target,
        fused_kernels=tr.fused_kernels,
        layerwise=tr.layerwise,
    )
    out = [
        f"model {cfg.model.preset}: {mc.num_parameters / 1e9:.3f}B parameters; "
        f"micro batch {tr.loop.micro_batch_size}, seq {seq}, {tr.precision.dtype}, recompute "
        f"{'on' if pt.recompute else 'off'}, "
        f"layerwise {'on' if tr.layerwise else 'off'}, backend {par.device_target}",
        f"configured layout dp={lay.dp} tp={lay.tp} pp={lay.pp} (micro_batch_num={lay.micro_batch_num}, "
        f"optimizer_shard={lay.optimizer_shard}): estimate per rank (each of {lay.devices} process(es))",
        est.table(),
        f"  -> {'fits' if est.total <= device_memory else 'DOES NOT FIT'} in {device_memory / GiB:.1f} GiB per device",
    ]
    if why := unsupported(lay, par.device_target):
        out.append(f"  -> this layout does not run here ({why})")
    devices = devices or par.device_num
    rows = plan(
        mc,
        devices=devices,
        device_memory=device_memory,
        micro_batch=tr.loop.micro_batch_size,
        seq=seq,
        precision=tr.precision.dtype,
        backend=par.device_target,
    )
    out.append(f"\nlayouts for {devices} device(s) × {device_memory / GiB:.1f} GiB (best first):")
    for lay2, mode, e2, ok in rows[:8]:
        why = unsupported(lay2, par.device_target)
        out.append(
            f"  {'fits ' if ok else 'no   '} dp={lay2.dp} tp={lay2.tp} pp={lay2.pp} "
            f"micro_batch_num={lay2.micro_batch_num} optimizer_shard={str(lay2.optimizer_shard).lower():5} "
            f"saving={mode:9} {e2.total / GiB:8.2f} GiB" + (f"   (not runnable here: {why})" if why else "")
        )
    best = next((r for r in rows if r[3] and unsupported(r[0], par.device_target) is None), None)
    if best is None:
        other = next((r for r in rows if r[3]), None)
        hint = (
            f" (dp={other[0].dp} tp={other[0].tp} pp={other[0].pp} would fit but: "
            f"{unsupported(other[0], par.device_target)})"
            if other
            else ""
        )
        out.append(
            f"recommendation: no runnable layout fits{hint}; add devices, lower "
            "pretrain.train.loop.micro_batch_size or seq_length"
        )
        return PlanReport(out, False)
    lay2, mode, e2, _ = best
    out.append(
        f"recommendation: parallel: {{data_parallel: {lay2.dp}, tensor_parallel: {lay2.tp}, "
        f"optimizer_shard: {str(lay2.optimizer_shard).lower()}, device_num: {lay2.devices}}}"
        + (f", plan: {{pipeline_parallel: {lay2.pp}, micro_batch_num: {lay2.micro_batch_num}}}" if lay2.pp > 1 else "")
        + f", {mode_setting(mode, par.device_target)}  ({e2.total / GiB:.2f} GiB per device)"
    )
    return PlanReport(out, True)


def forward_check(cfg: PipelineConfig) -> str:
    """Build the pipeline's model (seeded as pretraining does) and run one forward pass on random ids; one line
    saying the shapes, whether the logits are finite, and how long it took."""
    import numpy as np  # lazy: NumPy and MindSpore (below); the CLI imports this module

    setup_mindspore()  # before MindSpore's first import: it quiets MindSpore's C++ logs (GLOG_v)
    import mindspore as ms  # the lazy boundary: `msllm validate` without --forward never loads MindSpore

    from tasks.modeling.build import build_network

    mc = cfg.model.resolve()
    t0 = time.perf_counter()
    net = build_network(cfg.model.name, mc, seed=cfg.pretrain.seed).net
    ids = np.random.default_rng(0).integers(0, mc.vocab_size, size=(2, min(32, cfg.data.seq_length)), dtype=np.int32)
    logits = net(ms.Tensor(ids)).asnumpy()
    return (
        f"# forward pass: input_ids {list(ids.shape)} -> logits {list(logits.shape)}, "
        f"finite={bool(np.isfinite(logits).all())}, mean={logits.mean():.4f}, std={logits.std():.4f}, "
        f"{time.perf_counter() - t0:.1f}s"
    )
