"""The doc's stage-time block for the shipped smollm2 pipeline (docs/REAL_MODELS.md), as scripts/bench/report.py
writes it and reads the stated total back; the bench's own parsing of Prefect's task runs. Unit tier: no MindSpore,
no Prefect, milliseconds.

Whether the pipeline fits that time is a measurement, not a test: `scripts/bench/pipeline.py` runs it (`python -m
flows.full_pipeline --pipeline smollm2` on Prefect's embedded server, a fresh artifact root, 15-40 minutes on 2
cores) and writes one JSON line with the CPU and its ISA; `scripts/bench/report.py` puts it in the doc. That convert
runs as a Prefect task with its metrics artifact is tests/test_flows.py's
test_convert_is_a_cached_task_with_its_metrics_artifact.
"""

from __future__ import annotations

import pytest
from helpers import REPO, load_bench

DOC = REPO / "docs" / "REAL_MODELS.md"

report = load_bench("report")
bench = load_bench("pipeline")

ROW = {
    "bench": "pipeline",
    "date": "2026-12-03",
    "cpu": "Intel(R) Xeon(R) Processor",
    "cpu_isa": "avx512",
    "threads": 2,
    "pipeline": "smollm2",
    "overrides": [],
    "init_from": None,
    "eval": {"limit": 5, "tasks": ["local"], "heldout_blocks": 32},
    "total_s": 901.0,
    "process_s": 930.0,
    "stages": {"convert": 12.0, "data": 30.0, "pretrain": 240.0, "finetune": 200.0, "eval": 300.0, "export": 110.0},
    "outside_tasks_s": 9.0,
    "peak_rss_gb": 6.1,
    "loadavg_before": 0.2,
}
DOC_TEXT = "# x\n\nbefore\n\n<!-- pipeline-times:begin -->\nold\n<!-- pipeline-times:end -->\n\nafter\n"


def test_the_stage_time_table_round_trips_through_the_doc(tmp_path):
    doc = tmp_path / "REAL_MODELS.md"
    doc.write_text(DOC_TEXT)
    assert report.write_pipeline_times(doc, [ROW]) == ROW
    text = doc.read_text()
    assert (
        text.startswith("# x\n\nbefore\n\n<!-- pipeline-times:begin -->\n")
        and text.endswith("<!-- pipeline-times:end -->\n\nafter\n")
        and "old" not in text
    )
    assert "| pretrain | 4.0 |" in text and "| finetune (LoRA, then the merge) | 3.3 |" in text
    assert "`eval.limit: 5` documents per task of `eval.tasks: [local]`" in text and "avx512" in text
    assert report.stated_total_s(text) == pytest.approx(15.0 * 60)  # 901 s shown as 15.0 minutes
    report.write_pipeline_times(doc, [ROW])
    assert doc.read_text() == text  # rewriting the same line changes nothing


def test_a_hand_written_table_and_not_measured_yet():
    table = (
        "<!-- pipeline-times:begin -->\n| stage | minutes |\n|---|---|\n| eval | 9.5 |\n"
        "| **total (the flow run)** | **14.25** |\n<!-- pipeline-times:end -->"
    )
    assert report.stated_total_s(table) == pytest.approx(14.25 * 60)
    assert report.stated_total_s(f"{report.TIMES_BEGIN}\n{report.pipeline_times_md(None)}\n{report.TIMES_END}") is None
    with pytest.raises(ValueError, match="pipeline-times:begin"):
        report.stated_total_s("no markers here")
    with pytest.raises(ValueError, match="total"):
        report.stated_total_s(f"{report.TIMES_BEGIN}\n| eval | 3 |\n{report.TIMES_END}")


def test_the_doc_table_comes_from_the_newest_shipped_smollm2_run():
    older, newer = {**ROW, "total_s": 800.0}, {**ROW, "total_s": 850.0}
    rows = [
        older,
        newer,
        {**ROW, "tag": "smoke"},
        {**ROW, "overrides": ["eval.limit=null"]},
        {**ROW, "pipeline": "tiny"},
        {**ROW, "init_from": "x.gguf"},
        {**ROW, "prefect": "server beside (prefect server start)"},  # not the README's command: its own row
        {"bench": "train", "pipeline": "smollm2"},
    ]
    assert report.pipeline_times_row(rows) is newer
    assert report.pipeline_times_row(rows[2:]) is None


def test_the_shipped_doc_has_the_block():
    report.stated_total_s(DOC.read_text())  # raises when the markers or the total row are malformed


def test_stage_times_and_the_convert_checks_from_task_runs():
    runs = {
        "flow": {"state": "Completed", "s": 100.0},
        "tasks": [
            {"id": "c", "name": "convert", "state": "Completed", "s": 3.04},
            {"id": "d", "name": "data", "state": "Completed", "s": 10.0},
            {"id": "d2", "name": "data", "state": "Cached", "s": 0.5},
        ],
        "artifacts": [
            {"key": "convert-metrics", "type": "table", "task_run_id": "c"},
            {"key": "lineage-export", "type": "markdown", "task_run_id": None},
        ],
    }
    times, states = bench.stage_times(runs)
    assert times == {"convert": 3.0, "data": 10.0, "data_2": 0.5} and states["data_2"] == "Cached"
    assert bench.convert_checks(runs) == {"convert_task_run": True, "convert_artifact": True}
    runs["artifacts"][0]["task_run_id"] = "d"  # a convert-metrics artifact of another task run does not count
    assert bench.convert_checks(runs) == {"convert_task_run": True, "convert_artifact": False}


def test_each_stages_slowdown_beside_the_server_is_against_the_same_stage_alone():
    alone = {**ROW, "stages": {"data": 10.0, "pretrain": 200.0, "eval": 0.0}, "total_s": 250.0}
    beside = {**ROW, "stages": {"data": 11.0, "pretrain": 190.0, "eval": 5.0}, "total_s": 260.0}
    assert bench.slowdowns(alone, beside) == {"data": 10.0, "pretrain": -5.0, "total": 4.0}  # eval: no time alone


@pytest.mark.integration
def test_a_prefect_server_beside_the_flow_starts_answers_and_stops(tmp_path):
    """`--prefect server`'s PrefectServer: `prefect server start` on a free port of the run's own PREFECT_HOME
    answers /health, counts its CPU, and stop() ends its whole process group."""
    import psutil

    pytest.importorskip("prefect")
    server = bench.PrefectServer(tmp_path / "home", tmp_path / "server.log")
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.cpu_s() > 0
        pids = [server.proc.pid, *(c.pid for c in psutil.Process(server.proc.pid).children(recursive=True))]
    finally:
        server.stop()
    assert server.proc.poll() is not None
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)


def test_a_missing_gguf_is_one_line_naming_the_fetch_script():
    why = bench.missing_input("smollm2", overrides=["pretrain.init_from=models/not-there.gguf"])
    assert "models/not-there.gguf" in why and "scripts/fetch_smollm2.sh" in why and "\n" not in why
    assert "no/such/dir" in bench.missing_input("tiny", init_from="no/such/dir")
    assert bench.missing_input("tiny") is None


def test_the_doc_shows_the_newest_run_of_each_cpu_in_a_column_of_its_own(tmp_path):
    """Stated times hold only where they were taken: each CPU and ISA (an emulated one apart) gets a column of its
    newest shipped run, newest first; the stated total read back is the newest run's."""
    epyc = {**ROW, "cpu": "AMD EPYC", "date": "2026-12-05", "total_s": 1200.0}
    capped = {**epyc, "emulated_isa": "avx2", "total_s": 1500.0}
    old_xeon = {**ROW, "total_s": 700.0}
    rows = [old_xeon, ROW, epyc, capped, {**epyc, "tag": "smoke", "total_s": 5.0}]
    cols = report.pipeline_times_per_cpu(rows)
    assert [c["total_s"] for c in cols] == [1200.0, 1500.0, 901.0]  # newest first; each CPU's newest run
    doc = tmp_path / "REAL_MODELS.md"
    doc.write_text(DOC_TEXT)
    report.write_pipeline_times(doc, rows)
    text = doc.read_text()
    assert "AMD EPYC (avx512), 2026-12-05 | AMD EPYC (avx2 capped), 2026-12-05 | Intel(R) Xeon(R) Processor" in text
    assert "| **total (the flow run)** | **20.0** | **25.0** | **15.0** |" in text
    assert report.stated_total_s(text) == pytest.approx(20.0 * 60)
