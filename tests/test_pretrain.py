"""Pretrain stage on the tiny pipeline: exact resume, checkpoints, non-finite handling, the child process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tasks.config.loader import resolve_pipeline
from tasks.runtime.supervise import StageFailed
from tasks.stages import pretrain
from tasks.store.artifacts import ArtifactStore
from tasks.training.checkpoint import complete_checkpoints, load_checkpoint
from tasks.training.outcome import NonFiniteError
from tests.helpers import pretrain_child, run_stage

REPO = Path(__file__).resolve().parent.parent


def _cfg(*overrides: str):
    base = [
        "pretrain.train.loop.max_steps=6",
        "pretrain.train.loop.log_steps=1",
        "pretrain.train.loop.eval_steps=3",
        "pretrain.train.loop.eval_batches=2",
        "pretrain.train.schedule.warmup_steps=2",
        "pretrain.train.loop.micro_batch_size=4",
        "checkpoint.save_steps=3",
        "checkpoint.keep_checkpoint_max=2",
    ]
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*base, *overrides])


@pytest.fixture(scope="module")
def data_artifact(tmp_path_factory) -> Path:

    root = tmp_path_factory.mktemp("data_root")
    return run_stage("data", _cfg(), ArtifactStore(root), progress=False)


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows if "grad_norm" in r] + [
        (r["step"], r["val_loss"]) for r in rows if "val_loss" in r
    ]


def _train(cfg, root: Path, data_art: Path, **kw):
    train, run_dir = pretrain_child(cfg, root, data_art, **kw)
    return train(), run_dir


def test_resume_gives_identical_losses(tmp_path, data_artifact, capfd):
    cfg = _cfg()  # the default step: one decoder layer at a time (train.layerwise: true)
    straight, run_a = _train(cfg, tmp_path / "a", data_artifact)
    assert "[train] step: layer at a time\n" in capfd.readouterr().err
    stopped, run_b = _train(cfg, tmp_path / "b", data_artifact, stop_after=3)
    assert stopped is None and [c.name for c in complete_checkpoints(run_b / "checkpoints")] == ["step_00000003"]
    resumed, _ = _train(cfg, tmp_path / "b", data_artifact)
    la, lb = _losses(run_a), _losses(run_b)
    assert [s for s, _ in la] == [1, 2, 3, 4, 5, 6, 0, 3, 6]
    assert la == lb  # bit-identical per-step losses, k steps + resume + N - k steps
    wa = load_checkpoint(run_a / "checkpoints" / "step_00000006")
    wb = load_checkpoint(run_b / "checkpoints" / "step_00000006")
    for name in wa[0]:
        np.testing.assert_array_equal(wa[0][name], wb[0][name])
    for name in wa[1]:
        np.testing.assert_array_equal(wa[1][name], wb[1][name])
    assert wa[2]["consumed_samples"] == wb[2]["consumed_samples"] == 6 * 4
    # rotation kept the newest two
    assert [c.name for c in complete_checkpoints(run_a / "checkpoints")] == ["step_00000003", "step_00000006"]
    m = json.loads((straight / "manifest.json").read_text())
    assert m["metrics"]["steps"] == 6 and m["metrics"]["skipped_steps"] == 0
    from model.kernel_build import kernel_path

    assert m["metrics"]["native_kernels"] == kernel_path()  # "avx512", ... or "off: <why>": what the step ran
    for f in ("model.safetensors", "model.json", "tokenizer.model", "metrics.jsonl", "loss_curve.png"):
        assert (straight / f).is_file(), f
    row = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()][-1]
    for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_rss_bytes", "eta_s", "val_loss", "val_ppl"):
        assert k in row, k


def test_whole_model_step_trains_and_resumes_exactly(tmp_path, data_artifact, capfd):
    """`train.layerwise: false` through the trainer: the whole-model graph runs (the log says so), validates, and a
    run stopped at step 3 and resumed gives the straight run's losses bit for bit."""
    cfg = _cfg("pretrain.train.layerwise=false")
    straight, run_a = _train(cfg, tmp_path / "a", data_artifact)
    assert "[train] step: whole model\n" in capfd.readouterr().err
    _train(cfg, tmp_path / "b", data_artifact, stop_after=3)
    _, run_b = _train(cfg, tmp_path / "b", data_artifact)
    la, lb = _losses(run_a), _losses(run_b)
    assert [s for s, _ in la] == [1, 2, 3, 4, 5, 6, 0, 3, 6] and la == lb
    assert all(np.isfinite(v) for _, v in la)
    m = json.loads((straight / "manifest.json").read_text())
    assert m["metrics"]["steps"] == 6 and m["metrics"]["skipped_steps"] == 0


def test_nonfinite_steps_are_skipped_then_stop_the_run(tmp_path, data_artifact):
    cfg = _cfg("pretrain.train.loop.max_nonfinite_steps=2", "checkpoint.save_steps=2")
    out, run_dir = _train(cfg, tmp_path / "skip", data_artifact, fault_steps=[2])
    m = json.loads((out / "manifest.json").read_text())
    assert m["metrics"]["skipped_steps"] == 1 and m["metrics"]["steps"] == 6
    with pytest.raises(NonFiniteError, match=r"2 consecutive non-finite steps.*step_00000002"):
        _train(cfg, tmp_path / "stop", data_artifact, fault_steps=[3, 4])
    ckpts = complete_checkpoints(tmp_path / "stop" / "runs" / "pretrain")
    good = [c for c in (tmp_path / "stop").rglob("step_*") if c.is_dir()]
    assert [c.name for c in good] == ["step_00000002"] and ckpts == []
    weights, _, state = load_checkpoint(good[0])
    assert state["step"] == 2 and all(np.isfinite(w).all() for w in weights.values())


def test_stage_runs_in_child_retries_by_resuming_and_caches(tmp_path, data_artifact, capfd):
    import shutil

    root = tmp_path / "art"
    store = ArtifactStore(root)
    data_copy = root / "data" / data_artifact.name
    shutil.copytree(data_artifact, data_copy)
    cfg = _cfg()
    key, _, _ = pretrain.stage_key(cfg, store, data_copy, None)
    spec_dir = root / "runs" / "pretrain" / key
    # first attempt stops after 3 steps (as if killed); the retry resumes from step 3
    path = run_stage("pretrain", cfg, store, data_copy, retries=1, progress=False, inject={"stop_after": 3})
    err = capfd.readouterr().err
    assert "resumed from step_00000003" in err
    assert path.is_dir() and store.verify(path)["metrics"]["steps"] == 6
    assert (spec_dir / "checkpoints").is_dir()
    # an unchanged rerun is a cache hit: no child, same path
    assert run_stage("pretrain", cfg, store, data_copy, progress=False) == path


def test_child_error_is_reported_on_top(tmp_path, data_artifact):
    import shutil

    root = tmp_path / "art"
    store = ArtifactStore(root)
    data_copy = root / "data" / data_artifact.name
    shutil.copytree(data_artifact, data_copy)
    cfg = _cfg()
    cfg.model.vocab_size = 1024  # bypasses validation: the tokenizer has 512 pieces
    with pytest.raises(StageFailed) as ei:
        run_stage("pretrain", cfg, store, data_copy, progress=False)
    first = str(ei.value).splitlines()[0]
    assert first.startswith("tokenizer of") and "vocab_size is 1024" in first
    assert store.list("pretrain") == []
