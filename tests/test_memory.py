"""Memory estimator against measured peak RSS of real jit training steps, and the `plan` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from model.config import ModelConfig
from tasks.training.memory import GiB, Layout, estimate, plan

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("fused", [True, False], ids=["fused-kernels", "builtin-ops"])
@pytest.mark.parametrize("preset,batch,seq", [("tiny", 8, 64), ("small", 8, 128)])
def test_estimate_within_30_percent_of_measured_peak_rss(preset, batch, seq, fused):
    from model.kernel_ops import train_ops

    if fused and train_ops() is None:
        pytest.skip("no C++ compiler: the fused kernels cannot be built here")
    out = subprocess.run([sys.executable, "scripts/measure_rss.py", "--preset", preset, "--batch", str(batch),
                          "--seq", str(seq), "--steps", "2", *([] if fused else ["--no-fused"])],
                         capture_output=True, text=True, cwd=REPO, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    measured = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_bytes"]
    est = estimate(ModelConfig.from_name(preset), micro_batch=batch, seq=seq, fused_kernels=fused).total
    assert abs(est - measured) / measured < 0.30, (est / GiB, measured / GiB)


def test_estimate_responds_to_layout_and_recompute():
    cfg = ModelConfig.from_name("llama2-7b")
    base = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend")
    tp = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", layout=Layout(tp=8))
    rc = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", recompute=True)
    shard = estimate(cfg, micro_batch=1, seq=4096, precision="bf16", backend="Ascend", layout=Layout(dp=8, optimizer_shard=True))
    assert tp.parts["parameters"] < base.parts["parameters"] / 4
    assert rc.parts["activations"] < base.parts["activations"] / 5
    assert shard.parts["optimizer"] == base.parts["optimizer"] // 8
    # 7B in bf16 with AdamW: ~6.7e9 × (6 + 2 + 8) bytes of state alone
    assert 95 * GiB < base.parts["parameters"] + base.parts["gradients"] + base.parts["optimizer"] < 110 * GiB


def test_plan_recommends_a_fitting_layout_for_7b_on_8x32gib():
    rows = plan(ModelConfig.from_name("llama2-7b"), devices=8, device_memory=32 * GiB, micro_batch=1, seq=4096,
                precision="bf16", backend="Ascend")
    layout, recompute, est, fits = rows[0]
    assert fits and est.total <= 32 * GiB and layout.devices == 8
    assert not any(r[3] for r in rows if r[0] == Layout(dp=8) and not r[1])  # plain DP cannot hold 7B + AdamW
    cli = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "plan", "--pipeline", "demo", "--set", "model.preset=llama2-7b",
         "--set", "model.vocab_size=32000", "--set", "data.tokenizer.vocab_size=32000", "--set", "data.seq_length=4096",
         "--set", "pretrain.train.loop.micro_batch_size=1", "--set", "parallel.device_target=Ascend", "--set", "pretrain.train.precision.dtype=bf16",
         "--devices", "8", "--device-memory", "32GiB"], capture_output=True, text=True, cwd=REPO)
    assert cli.returncode == 0, cli.stderr
    assert "DOES NOT FIT" in cli.stdout and "recommendation: parallel:" in cli.stdout
