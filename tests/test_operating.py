"""Operating the pipeline: `msllm init` (a starter project from package data), a closed stdout pipe,
the lineage as markdown for the Prefect UI, and prints inside tasks that redirect stdout (dill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.cli import main

REPO = Path(__file__).resolve().parent.parent


def test_init_writes_a_starter_whose_tiny_is_the_repos_tiny(tmp_path, capsys):
    from tasks.config.loader import resolve_pipeline

    assert main(["init", str(tmp_path / "proj")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "proj")
    proj = tmp_path / "proj"
    assert (proj / "pipelines.yaml").is_file() and (proj / "corpora/shakespeare.txt").is_file()
    starter = resolve_pipeline(proj / "pipelines.yaml", None)
    assert starter.name == "tiny"
    ours = resolve_pipeline(REPO / "pipelines.yaml", "tiny")
    a, b = starter.model_dump(mode="json"), ours.model_dump(mode="json")
    for d in (a, b):  # the same pipeline but for where its files are (and its one-line description)
        d.pop("base_dir", None), d.pop("description", None)
        d["data"].pop("sources"), d["finetune"].pop("sources")
    assert a == b, "tasks/cli/starter/pipelines.yaml drifted from pipelines.yaml's tiny: copy the change over"
    # never overwrites without --force
    assert main(["init", str(proj)]) == 1
    assert "pass --force" in capsys.readouterr().err
    assert main(["init", str(proj), "--force"]) == 0


@pytest.mark.integration  # ~7 s: two CLI processes (the unit tier stays under 2 minutes)
def test_closed_pipe_is_silent(tmp_path):
    """`msllm lineage … | head -1`: no 'Broken pipe' error; exit 141 (SIGPIPE's status, as a shell shows it)."""
    from tasks.store.artifacts import ArtifactStore
    from tests.test_model_choice import _art

    store = ArtifactStore(tmp_path / "artifacts")
    data = _art(store, "data", "d", [])
    arts = [data]
    for i in range(300):  # a long lineage: more than a pipe buffer of text
        arts.append(_art(store, "pretrain", f"P{i}", [arts[-1]]))
    env = dict(os.environ, PYTHONPATH=str(REPO), GLOG_v="3")
    cmd = (
        f"{sys.executable} -m tasks.cli lineage {arts[-1]} --artifacts {tmp_path / 'artifacts'} --format json "
        f'| head -c 10 >/dev/null; echo "rc=${{PIPESTATUS[0]}}"'
    )
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert "Broken pipe" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.strip() in ("rc=0", "rc=141"), (r.stdout, r.stderr)


def test_lineage_markdown_is_a_list_and_tables_not_mermaid(tmp_path):
    from tasks.store.artifacts import ArtifactStore, raw_file_input
    from tasks.store.lineage import lineage_tree, render
    from tests.test_model_choice import _art

    store = ArtifactStore(tmp_path)
    corpus = tmp_path / "c.txt"
    corpus.write_text("text")
    refs = [raw_file_input(corpus)]
    key = store.key("data", {}, refs, "t")
    with store.build("data", key, pipeline="p", config={}, inputs=refs, code="t") as b:
        (b.dir / "x").write_text("x")
    pre = _art(store, "pretrain", "P", [b.path])
    ev = _art(store, "eval", "E", [pre, b.path])
    md = render(lineage_tree(store, ev), "markdown")
    assert "mermaid" not in md and "```" not in md
    assert md.splitlines()[0] == f"# Lineage of eval/{ev.name}"
    assert f"- **eval/{ev.name[:12]}**" in md and f"  - **pretrain/{pre.name[:12]}**" in md
    assert "(shown above)" in md  # the data artifact under both: once in full
    assert f"| c.txt | 4 | `{refs[0]['sha256']}` |" in md
    assert max(len(ln) for ln in md.splitlines() if ln.startswith("  ")) < 200


DILL_FLOW = r"""
import json, dill.detect
from prefect import flow, task
from flows.stages import _stage_body

G = 3
def f():
    return G + len([])

@task
@_stage_body
def wrapped():
    return sorted(dill.detect.nestedglobals(f))

@task
def bare():
    return sorted(dill.detect.nestedglobals(f))

@flow(log_prints=True)
def fl():
    return {"wrapped": wrapped(), "bare": bare()}

print("REPORT " + json.dumps(fl()))
"""


@pytest.mark.slow  # starts Prefect's embedded server (a fresh database: 13-30 s)
def test_dill_globals_detection_stays_out_of_the_log(tmp_path):
    """Prefect's log_prints logs dill's `dis.dis` capture (and dill then sees no globals); inside our tasks the
    redirect wins. `bare` shows the Prefect behaviour the wrapper exists for."""
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "ph"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PYTHONPATH=str(REPO),
        PREFECT_LOGGING_LEVEL="INFO",
    )
    env.pop("PREFECT_API_URL", None)
    r = subprocess.run(
        [sys.executable, "-c", DILL_FLOW], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, r.stderr[-3000:]
    rep = json.loads(line[len("REPORT ") :])
    assert rep["wrapped"] == ["G", "len"]
    assert rep["bare"] != rep["wrapped"]  # Prefect's print patch swallowed dill's capture
    logged = [ln for ln in (r.stdout + r.stderr).splitlines() if "LOAD_GLOBAL" in ln]
    assert logged and all("bare" in ln or "Task run" in ln or "LOAD_GLOBAL" in ln for ln in logged)
