"""Memory estimator against measured peak RSS of real jit training steps, and the `plan` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from model.config import ModelConfig
from tasks.training.memory import GiB, Layout, estimate, layer_saved_bytes, mode_setting, plan

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "fused,layerwise",
    [(True, False), (False, False), (True, True)],
    ids=["fused-kernels", "builtin-ops", "layer-at-a-time"],
)
@pytest.mark.parametrize("preset,batch,seq", [("tiny", 8, 64), ("small", 8, 128)])
def test_estimate_within_30_percent_of_measured_peak_rss(preset, batch, seq, fused, layerwise):
    from model.kernel_ops import train_ops

    if fused and train_ops() is None:
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    out = subprocess.run(
        [
            sys.executable,
            "scripts/measure_rss.py",
            "--preset",
            preset,
            "--batch",
            str(batch),
            "--seq",
            str(seq),
            "--steps",
            "2",
            *([] if fused else ["--no-fused"]),
            *(["--layerwise"] if layerwise else []),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    est = estimate(
        ModelConfig.from_name(preset), micro_batch=batch, seq=seq, fused_kernels=fused, layerwise=layerwise
    ).total
    assert abs(est - measured) / measured < 0.30, (est / GiB, measured / GiB)


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["native", "avx2", "no-fused"])
def test_the_whole_model_step_at_smollm2_135m_within_15_percent(isa, monkeypatch):
    """The whole-model step graph's memory grows faster than its layer count (module doc of the estimator, `graph`):
    at SmolLM2-135M's 30 layers the estimate without that part was 3.30 GB against 4.87 measured (32% under), a
    validation that passes a run the machine cannot hold; without the fused kernels 5.14 against 5.96 (14% under).
    The bound: the fits' residual here was under 1%, their worst 6% / 9%; 15% (10% without the kernels) leaves room
    for another CPU's kernels and allocator, and still fails the old estimates."""
    from model.cpu import cpu_levels
    from model.kernel_ops import train_ops

    fused = isa != "no-fused"
    if fused and train_ops() is None:
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    if isa == "avx2" and "avx2" not in cpu_levels():
        pytest.skip("this CPU has no AVX2")
    if isa == "avx2":  # as an AVX2-only CPU runs it (oneDNN's AVX2 path, the head's transposed gradient); the
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # estimate reads the same cap (model.cpu.matmul_isa)
        monkeypatch.setenv("MSLLM_KERNEL_ISA", "avx2")
    out = subprocess.run(
        [
            sys.executable,
            "scripts/measure_rss.py",
            "--preset",
            "smollm2-135m",
            "--batch",
            "2",
            "--seq",
            "128",
            "--steps",
            "2",
            "--validate",
            "later",
            *([] if fused else ["--no-fused"]),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    line = json.loads(out.stdout.strip().splitlines()[-1])
    measured, phases = line["peak_rss_bytes"], line["phases"]
    est = estimate(ModelConfig.from_name("smollm2-135m"), micro_batch=2, seq=128, fused_kernels=fused).total
    assert abs(est - measured) / measured < (0.15 if fused else 0.10), (est / GiB, measured / GiB, phases)
    # the validation graph compiled after the steps (a resumed run's first) does not raise the peak: the step's
    # compilation heap went back (without it the validation ran at 5.04 GB against the step's 4.87)
    assert phases["validation"]["peak_bytes"] <= phases["first_step"]["peak_bytes"], phases


def test_the_graph_part_grows_with_depth_and_only_for_the_whole_model_cpu_step(monkeypatch):
    from tasks.training.memory import graph_bytes

    monkeypatch.delenv("MSLLM_FUSED_KERNELS", raising=False)  # the kernels' decision as the default build takes it

    cfg = ModelConfig.from_name("smollm2-135m")
    whole = estimate(cfg, micro_batch=2, seq=128)
    assert whole.parts["graph"] == graph_bytes(30)
    assert graph_bytes(30) > 2 * graph_bytes(15) > 4 * graph_bytes(7)  # faster than the layer count
    assert graph_bytes(30, trainable_fraction=0.01) < graph_bytes(30)  # no weight-gradient kernels (LoRA)
    assert "graph" not in estimate(cfg, micro_batch=2, seq=128, layerwise=True).parts  # small layer graphs only
    assert "graph" not in estimate(cfg, micro_batch=2, seq=128, backend="Ascend").parts
    # MindSpore's own ops: more kernels per layer, their own fit
    ops = estimate(cfg, micro_batch=2, seq=128, fused_kernels=False).parts["graph"]
    assert ops == graph_bytes(30, fused=False) > 2 * graph_bytes(15, fused=False) > 4 * graph_bytes(7, fused=False) > 0
    # a pipeline stage compiles only its own layers
    staged = estimate(cfg, micro_batch=2, seq=128, layout=Layout(pp=2, micro_batch_num=8))
    assert staged.parts["graph"] == graph_bytes(15)


def test_estimate_responds_to_layout_and_recompute():
    cfg = ModelConfig.from_name("llama2-7b")
    base = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend")
    tp = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", layout=Layout(tp=8))
    rc = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", recompute=True)
    shard = estimate(
        cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", layout=Layout(dp=8, optimizer_shard=True)
    )
    assert tp.parts["parameters"] < base.parts["parameters"] / 4
    assert rc.parts["activations"] < base.parts["activations"] / 5
    assert shard.parts["optimizer"] == base.parts["optimizer"] // 8
    # 7B in bf16 with AdamW: ~6.7e9 × (6 + 2 + 8) bytes of state alone
    assert 95 * GiB < base.parts["parameters"] + base.parts["gradients"] + base.parts["optimizer"] < 110 * GiB


def test_plan_recommends_a_fitting_layout_for_7b_on_8x32gib():
    rows = plan(
        ModelConfig.from_name("llama2-7b"),
        devices=8,
        device_memory=32 * GiB,
        micro_batch=1,
        seq=4096,
        precision="bf16",
        backend="Ascend",
    )
    layout, mode, est, fits = rows[0]
    assert fits and est.total <= 32 * GiB and layout.devices == 8
    assert not any(r[3] for r in rows if r[0] == Layout(dp=8) and r[1] == "off")  # plain DP cannot hold 7B + AdamW
    assert not any(r[1] == "layerwise" for r in rows)  # the layer-at-a-time step is offered on CPU only
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks.cli",
            "plan",
            "--pipeline",
            "demo",
            "--set",
            "model.preset=llama2-7b",
            "--set",
            "model.vocab_size=32000",
            "--set",
            "data.tokenizer.vocab_size=32000",
            "--set",
            "data.seq_length=4096",
            "--set",
            "pretrain.train.loop.micro_batch_size=1",
            "--set",
            "parallel.device_target=Ascend",
            "--set",
            "pretrain.train.precision.dtype=bf16",
            "--devices",
            "8",
            "--device-memory",
            "32GiB",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert cli.returncode == 0, cli.stderr
    assert "DOES NOT FIT" in cli.stdout and "recommendation: parallel:" in cli.stdout


def test_layer_at_a_time_in_the_estimate_and_the_cpu_plan():
    """`train.layerwise` keeps each layer's input, what its written-out backward reads (fused fp32 kernels) and one
    layer's working set (where it applies: no tensor parallel, every parameter trained); recompute lowers nothing on
    CPU (the graph keeps the recomputed forward's buffers: docs/MEMORY.md "Train"); the CPU plan offers the
    layer-at-a-time step where the whole-model step does not fit."""
    cfg = ModelConfig.from_name("smollm2-135m")
    kw = dict(micro_batch=8, seq=512)
    whole, lw = estimate(cfg, **kw), estimate(cfg, **kw, layerwise=True)
    kept = cfg.num_layers * (8 * 512 * cfg.hidden_size * 4 + layer_saved_bytes(cfg, 8, 512))
    assert lw.parts["activations"] < whole.parts["activations"] / 1.8  # the whole step keeps ~2x per layer
    assert kept < lw.parts["activations"] < kept + 2 * whole.parts["activations"] / cfg.num_layers
    assert lw.total < whole.total
    # tensor parallel: the whole step; LoRA: layer at a time with the written-out functions (fused fp32), else whole
    for other in (dict(layout=Layout(tp=2)), dict(trainable_fraction=0.05, fused_kernels=False)):
        assert estimate(cfg, **kw, **other, layerwise=True).parts == estimate(cfg, **kw, **other).parts
    lora, lora_lw = (
        estimate(cfg, **kw, trainable_fraction=0.05),
        estimate(cfg, **kw, trainable_fraction=0.05, layerwise=True),
    )
    assert lora_lw.parts["activations"] == lw.parts["activations"] and lora_lw.total < lora.total
    assert estimate(cfg, **kw, recompute=True).parts == whole.parts  # CPU
    assert estimate(cfg, **kw, recompute=True, backend="GPU").total < estimate(cfg, **kw, backend="GPU").total
    between = (lw.total + whole.total) // 2
    rows = plan(cfg, devices=1, device_memory=between, precision="fp32", backend="CPU", **kw)
    assert rows[0][1] == "layerwise" and rows[0][3]
    roomy = plan(cfg, devices=1, device_memory=2 * whole.total, precision="fp32", backend="CPU", **kw)
    assert [r[1] for r in roomy[:3]] == ["layerwise", "off", "recompute"] and all(r[3] for r in roomy[:3])
    # on CPU the layer-at-a-time step is the default: the whole-model modes say to turn it off, elsewhere not
    assert mode_setting("off", "CPU") == "pretrain.recompute: false, pretrain.train.layerwise: false"
    assert mode_setting("recompute", "Ascend") == "pretrain.recompute: true"
    gpu = dict(kw, precision="fp32", backend="GPU")
    assert estimate(cfg, **gpu, layerwise=True).parts == estimate(cfg, **gpu).parts  # not on a device: ignored


def test_fused_attention_keeps_no_scores_in_the_estimate():
    """With the fused fp32 kernels the attention keeps one log-sum-exp per query and head (model/fused_cells.py
    FusedCausalAttention), so the whole step's activations grow linearly with the sequence at a fixed token count;
    MindSpore's own ops keep the [B·nh, T, S] scores and probabilities, which grow with T² per sequence."""
    cfg = ModelConfig.from_name("smollm2-135m")
    short, long = dict(micro_batch=16, seq=256), dict(micro_batch=2, seq=2048)  # the same 4096 tokens
    fused = [estimate(cfg, **kw).parts["activations"] for kw in (short, long)]
    plain = [estimate(cfg, **kw, fused_kernels=False).parts["activations"] for kw in (short, long)]
    assert fused[0] == fused[1]
    scores = 3 * cfg.num_heads * 4096 * (2048 - 256) * 4 * cfg.num_layers  # the T² term's growth, in bytes
    assert plain[1] - plain[0] >= scores
    assert fused[1] < plain[1] / 4


def test_validation_names_train_layerwise_where_it_would_fit():
    from tasks.config.loader import resolve_pipeline
    from tasks.training.memory import machine_fit_errors

    pipelines = REPO / "pipelines.yaml"
    cfg = resolve_pipeline(
        pipelines, "tiny", ["pretrain.train.loop.micro_batch_size=512", "pretrain.train.layerwise=false"]
    )
    mc, ptr = cfg.model.resolve(), cfg.pretrain.train
    kw = dict(
        micro_batch=512, seq=cfg.pretrain.seq_length, precision=ptr.precision.dtype, fused_kernels=ptr.fused_kernels
    )
    whole, lw = estimate(mc, **kw).total, estimate(mc, **kw, layerwise=True).total
    assert lw < whole
    errs = machine_fit_errors(cfg, "pipelines.tiny", machine_bytes=(lw + whole) // 2)
    assert len(errs) == 1 and errs[0].startswith("pipelines.tiny.pretrain.train.layerwise: false"), errs
    assert "set pretrain.train.layerwise: true" in errs[0]
    on = resolve_pipeline(
        pipelines, "tiny", ["pretrain.train.loop.micro_batch_size=512", "pretrain.train.layerwise=true"]
    )
    assert machine_fit_errors(on, "pipelines.tiny", machine_bytes=(lw + whole) // 2) == []


@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_step_graph_and_the_validation_hand_the_heap_back_once_after_their_first_call(accumulation, monkeypatch):
    """A graph's first call compiles it and frees the compilation's temporaries into malloc's arenas; the trainer
    hands them back (`trim_heap`) once per graph, so that the validation graph compiled later does not stack on them
    (at SmolLM2-135M: 0.64 GB; the slow 135M test above measures it). Counted, not timed: once per graph, never per
    step."""
    import mindspore as ms

    import model.runtime
    from tasks.modeling.build import build_network
    from tasks.training.layerwise import causal_lm_train_step
    from tasks.training.step import causal_lm_loss_fn, validation_fn

    trims = []
    monkeypatch.setattr(model.runtime, "trim_heap", lambda: trims.append(1))
    cfg = ModelConfig.from_name("tiny")
    net = build_network("llama", cfg, seed=0).net
    step = causal_lm_train_step(net, net.trainable_params(), accumulation=accumulation)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 17)).astype(np.int32)
    batch = [(ids[:, :-1], ids[:, 1:])] * accumulation
    for s in range(3):
        step(batch, 1e-3, s + 1)
    assert len(trims) == (1 if accumulation == 1 else 2)  # the whole step, or the micro-batch and the update graphs
    val = validation_fn(step, causal_lm_loss_fn(net))
    losses = [float(val(ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:])).asnumpy()) for _ in range(2)]
    assert len(trims) == (2 if accumulation == 1 else 3) and losses[0] == losses[1]
