"""TensorBoard event files: written beside metrics.jsonl, read back with TensorBoard's own EventAccumulator.

The fast tests drive tasks/store/tensorboard.py directly; the slow one trains the tiny pipeline in the
stage's supervised child process, stops it between checkpoints (as if killed), resumes it, and
checks every scalar of the event file against metrics.jsonl: same steps, no duplicates.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tasks.store import tensorboard as tb
from tests.helpers import run_stage

REPO = Path(__file__).resolve().parent.parent


def _hparams(run_dir: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import metadata

    acc = EventAccumulator(str(run_dir), size_guidance={"tensors": 0})
    acc.Reload()
    info = metadata.parse_session_start_info_plugin_data(
        acc.SummaryMetadata(metadata.SESSION_START_INFO_TAG).plugin_data.content
    )
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}


def _check_against_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every numeric field of every metrics.jsonl record is the scalar at its step; nothing else is there."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    got = tb.read_scalars(run_dir)
    want: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for tag, v in tb.scalars(r).items():
            want.setdefault(tag, []).append((r["step"], v))
    assert sorted(got) == sorted(want)
    for tag, pts in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in pts], tag  # same steps, in order, each once
        for (_, a), (_, b) in zip(got[tag], pts):
            # float32 in the event file: one rounding, 2^-24 relative; 1e-6 is 16 of those, no sum involved
            assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), (tag, a, b)
    return got


def test_records_resume_and_hparams_round_trip(tmp_path):
    run = tmp_path / "runs" / "pretrain" / "k123"
    run.mkdir(parents=True)
    (run / "spec.json").write_text(
        json.dumps(
            {
                "config": {
                    "name": "tiny",
                    "model": {"preset": "tiny"},
                    "pretrain": {"train": {"loop": {"max_steps": 6}}, "sources": ["a.txt"], "seed": None},
                    "eval": {"limit": 8},
                },
                "data": "/d",
            }
        )
    )
    rows = [{"step": 0, "val_loss": 6.2, "val_ppl": math.exp(6.2)}]
    rows += [
        {
            "step": s,
            "loss": 6.0 - s / 10,
            "lr": 1e-3 * s,
            "grad_norm": 0.5,
            "peak_rss_bytes": 3 * 2**30,
            "skipped_steps": 0,
            "fused": True,
        }
        for s in (1, 2, 3)
    ]
    log = tb.open_run(run, rows[:1], {"model": {"hidden_size": 64}, "seed": 0})
    for r in rows[1:]:
        log.write(r)
    log.close()
    first = tb.event_files(run)
    got = tb.read_scalars(run)
    # float32 in the event file: one rounding of 2^-24 relative, inside pytest.approx's 1e-6
    assert got["train/loss"] == [(1, pytest.approx(5.9)), (2, pytest.approx(5.8)), (3, pytest.approx(5.7))]
    assert got["perf/peak_rss_gib"][0][1] == 3.0 and "train/fused" not in got  # bools are not scalars
    hp = _hparams(run)
    assert hp["run"] == "pretrain/k123" and hp["pipeline"] == "tiny" and hp["pretrain.train.loop.max_steps"] == 6
    assert hp["pretrain.sources"] == '["a.txt"]' and hp["arch.hidden_size"] == 64 and hp["input.data"] == "/d"
    assert "pretrain.seed" not in hp and not any(
        k.startswith("eval.") for k in hp
    )  # None dropped; other stages' sections too
    # resume from step 2: the trainer kept records <= 2; the event file is replaced by one holding exactly those
    time.sleep(0.01)
    log = tb.open_run(run, rows[:3], {"seed": 0})
    log.write({"step": 3, "loss": 1.25})
    log.write({"step": 4, "loss": 1.0})
    log.close()
    files = tb.event_files(run)
    assert len(files) == 1 and files != first
    got = tb.read_scalars(run)
    assert got["train/loss"] == [(1, pytest.approx(5.9)), (2, pytest.approx(5.8)), (3, 1.25), (4, 1.0)]
    assert [s for s, _ in got["train/grad_norm"]] == [1, 2] and got["val/loss"] == [(0, pytest.approx(6.2))]
    assert not list(run.glob(".tmp-*"))
    assert isinstance(tb.open_run(run, [], enabled=False), tb._Off) and tb.event_files(run) == files  # other ranks


def test_eval_scores(tmp_path):
    run = tmp_path / "runs" / "eval" / "e1"
    tb.write_eval(
        run,
        {"perplexity": 140.5, "local_arc_easy.acc": 0.25, "x": float("nan"), "n": None},
        step=20,
        hparams={"pipeline": "tiny", "eval": {"limit": 8, "tasks": ["local"]}},
    )
    assert tb.read_scalars(run) == {"eval/perplexity": [(20, 140.5)], "eval/local_arc_easy.acc": [(20, 0.25)]}
    hp = _hparams(run)
    assert hp["run"] == "eval/e1" and hp["eval.limit"] == 8 and hp["eval.tasks"] == '["local"]'


@pytest.mark.slow
def test_pretrain_run_events_match_metrics_across_a_resume(tmp_path):
    """Stop after 3 steps with the last checkpoint at step 2, resume: the event file holds each step once."""
    from tasks.config.loader import resolve_pipeline
    from tasks.runtime.supervise import StageFailed
    from tasks.stages import pretrain
    from tasks.store.artifacts import ArtifactStore

    cfg = resolve_pipeline(
        REPO / "pipelines.yaml",
        "tiny",
        [
            "pretrain.train.loop.max_steps=6",
            "pretrain.train.loop.log_steps=1",
            "pretrain.train.loop.eval_steps=3",
            "pretrain.train.loop.eval_batches=2",
            "pretrain.train.schedule.warmup_steps=2",
            "pretrain.train.loop.micro_batch_size=4",
            "checkpoint.save_steps=2",
        ],
    )
    store = ArtifactStore(tmp_path / "artifacts")
    data_art = run_stage("data", cfg, store, progress=False)
    with pytest.raises(StageFailed, match="stopped before the end"):
        run_stage("pretrain", cfg, store, data_art, progress=False, inject={"stop_after": 3})
    key, _, _ = pretrain.stage_key(cfg, store, data_art, None)
    run_dir = store.root / "runs" / "pretrain" / key
    before = tb.read_scalars(run_dir)
    assert [s for s, _ in before["train/loss"]] == [1, 2, 3] and [s for s, _ in before["val/loss"]] == [0, 3]
    stale = tb.event_files(run_dir)
    path = run_stage("pretrain", cfg, store, data_art, progress=False)  # resumes from step_2: step 3 is trained again

    got = _check_against_metrics(run_dir)
    assert tb.event_files(run_dir) != stale and len(tb.event_files(run_dir)) == 1
    assert [s for s, _ in got["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert [s for s, _ in got["val/loss"]] == [0, 3, 6]
    assert {"train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/mfu", "perf/peak_rss_gib", "val/ppl"} <= set(got)
    # the artifact's metrics.jsonl is the run's; its final val loss is the last val/loss point
    assert (path / "metrics.jsonl").read_bytes() == (run_dir / "metrics.jsonl").read_bytes()
    # float32 in the event file: one rounding (2^-24 relative)
    assert math.isclose(got["val/loss"][-1][1], store.read_manifest(path)["metrics"]["val_loss"], rel_tol=1e-6)
    hp = _hparams(run_dir)
    assert hp["run"] == f"pretrain/{key}" and hp["pipeline"] == "tiny"
    assert (
        hp["pretrain.train.loop.max_steps"] == 6 and hp["checkpoint.save_steps"] == 2 and hp["model.preset"] == "tiny"
    )
    print("TB", json.dumps({t: len(v) for t, v in sorted(got.items())}))
