"""Which model eval, export, predict and serve read (tasks/stages/upstream.py choose_model), and that the
choice is printed, recorded and compared with the previous eval report.

The unit tests build manifests only (no weights): the rule reads nothing else. The slow test runs the
real flows on the tiny pipeline: full-pipeline, then the scheduled continued-pretraining flow on an
inbox corpus, then eval-only (which must evaluate what the scheduled run exported), then eval-only
on another model (whose report must say the model changed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.stages.upstream import NoUpstream, choose_model, model_change_note, upstream
from tasks.store.artifacts import ArtifactStore

REPO = Path(__file__).resolve().parent.parent


def _art(store: ArtifactStore, stage: str, name: str, inputs: list[Path], pipeline: str = "p") -> Path:
    refs = [store.input_ref(p) for p in inputs]
    key = store.key(stage, {"name": name}, refs, "test")
    with store.build(stage, key, pipeline=pipeline, config={"name": name}, inputs=refs, code="test") as b:
        (b.dir / "payload.txt").write_text(name)
    time.sleep(0.002)  # distinct `created`
    return b.path


def test_rule_follows_the_pipelines_chain_not_the_newest_artifact(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(NoUpstream, match="msllm train --pipeline p"):
        choose_model(store, "p")
    data = _art(store, "data", "d", [])
    pre = _art(store, "pretrain", "P", [data])
    c = choose_model(store, "p")
    assert (c.path, c.rule) == (pre, "newest-base") and "no finetune of it" in c.reason
    ft = _art(store, "finetune", "F", [pre])
    merged = _art(store, "merged", "M", [ft])
    c = choose_model(store, "p")
    assert (c.path, c.rule, c.ref) == (merged, "finetune-of-newest-base", f"merged/{merged.name}")
    assert f"pretrain/{pre.name}" in c.reason
    # another pipeline's newer artifacts change nothing
    other = _art(store, "pretrain", "Q", [data], pipeline="q")
    assert choose_model(store, "p").path == merged and choose_model(store, "q").path == other
    # continued pretraining (a newer pretrain of the chain): its base, saying it has no finetune
    cont = _art(store, "pretrain", "C", [data, merged])
    c = choose_model(store, "p")
    assert (c.path, c.rule) == (cont, "newest-base") and "no finetune" in c.reason
    assert upstream(store, "eval", "p") == upstream(store, "export", "p") == cont
    assert upstream(store, "finetune", "p") == cont
    ft2 = _art(store, "finetune", "F2", [cont])
    merged2 = _art(store, "merged", "M2", [ft2])
    assert choose_model(store, "p").path == merged2
    # a merged model of an older base is not the tip, even when it is the newest artifact
    _art(store, "merged", "M-old", [_art(store, "finetune", "F-old", [pre])])
    assert choose_model(store, "p").path == merged2
    # given: that artifact, whatever the rule says
    c = choose_model(store, "p", str(pre))
    assert (c.path, c.rule) == (pre, "given")


def test_change_note_names_the_previous_reports_model(tmp_path):
    store = ArtifactStore(tmp_path)
    data = _art(store, "data", "d", [])
    pre = _art(store, "pretrain", "P", [data])
    merged = _art(store, "merged", "M", [_art(store, "finetune", "F", [pre])])
    assert model_change_note(store, "p", choose_model(store, "p")) is None  # no report yet
    _art(store, "eval", "E", [merged, data])
    assert model_change_note(store, "p", choose_model(store, "p")) is None  # same model
    note = model_change_note(store, "p", choose_model(store, "p", str(pre)))
    assert note and f"evaluated merged/{merged.name}" in note and f"evaluates pretrain/{pre.name}" in note


DRIVER = r"""
import json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, LogFilter, LogFilterFlowRunId
from flows.full_pipeline import full_pipeline
from flows.continued import continued_pretraining
from flows.stage_flows import eval_flow
from prefect.logging.handlers import APILogWorker

a = json.loads(sys.argv[1])
common = dict(pipeline="tiny", config=a["config"], artifacts=a["artifacts"], overrides=a["overrides"])

def run(fl, **kw):
    state = fl(**common, **kw, return_state=True)
    if not state.is_completed():  # every later run reads this one's artifacts: stop here, saying why
        sys.exit(f"{fl.name} ended {state.name}: {state.result(raise_on_failure=False)!r}")
    fid = state.state_details.flow_run_id
    APILogWorker.drain_all(timeout=20)  # the run's logs are sent in the background
    with get_client(sync_client=True) as c:
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fid])))
        logs = c.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[fid])))
    return {"state": state.name, "result": state.result(),
            "artifacts": {x.key: x.data for x in arts if x.key}, "logs": [l.message for l in logs]}

out = {"full": run(full_pipeline)}
out["continued"] = run(continued_pretraining, inbox=a["inbox"])
out["eval_only"] = run(eval_flow)
out["eval_other"] = run(eval_flow, model_artifact=out["continued"]["result"]["pretrain"])
print("REPORT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def scheduled_then_eval_only(tmp_path_factory):
    from tests.test_flows import _tiny_config

    tmp = tmp_path_factory.mktemp("choice")
    cfg = _tiny_config(tmp)
    inbox = tmp / "inbox"
    inbox.mkdir()
    (inbox / "peps.txt").write_text((REPO / "data/corpora/tinyshakespeare.txt").read_text()[300_000:360_000])
    overrides = [
        "eval.tasks=[local_arc_easy]",
        "eval.limit=4",
        "continued.train.loop.max_steps=4",
        "continued.train.schedule.warmup_steps=1",
        "finetune.train.loop.max_steps=2",
        "finetune.train.loop.eval_steps=2",
        "finetune.train.loop.save_steps=2",
        "finetune.train.schedule.warmup_steps=1",
    ]
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp / "ph"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        GLOG_v="3",
        PREFECT_LOGGING_LEVEL="INFO",
    )
    env.pop("PREFECT_API_URL", None)
    arg = json.dumps(
        {"config": str(cfg), "artifacts": str(tmp / "artifacts"), "inbox": str(inbox), "overrides": overrides}
    )
    r = subprocess.run(
        [sys.executable, "-c", DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=1800
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert r.returncode == 0 and line, f"driver exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return json.loads(line[len("REPORT ") :]), ArtifactStore(tmp / "artifacts")


@pytest.mark.slow
def test_eval_only_after_scheduled_run_evaluates_what_it_exported(scheduled_then_eval_only):
    rep, store = scheduled_then_eval_only
    full, cont, ev = rep["full"], rep["continued"], rep["eval_only"]
    assert full["state"] == cont["state"] == ev["state"] == "Completed", rep
    # the scheduled run carried the pipeline on: continued → finetune → eval → export, in one flow run
    assert set(cont["result"]) == {"data", "pretrain", "finetune", "merged", "eval", "export"}
    merged = Path(cont["result"]["merged"])
    export_m = store.read_manifest(cont["result"]["export"])
    assert export_m["inputs"][0]["key"] == merged.name  # what was exported (and `msllm serve` runs)
    # eval-only evaluates that model, by the rule, and says so: printed, in the report artifact, in the manifest
    choice = choose_model(store, "tiny")
    assert choice.path == merged and choice.rule == "finetune-of-newest-base"
    assert ev["result"] == cont["result"]["eval"]  # the same eval (a cache hit of the scheduled run's)
    ev_m = store.read_manifest(ev["result"])
    assert ev_m["inputs"][0]["key"] == merged.name
    assert ev_m["model_choice"]["artifact"] == f"merged/{merged.name}"
    assert any(f"eval: model merged/{merged.name}: {choice.reason}" in m for m in ev["logs"]), ev["logs"]
    report = ev["artifacts"]["eval-report-tiny"]
    assert f"Model: `merged/{merged.name}`, chosen because: {choice.reason}" in report
    assert "model changed" not in report
    # the cached eval still publishes: its metrics and a short "cached" note linking the artifact
    assert "eval-cached" in ev["artifacts"] and ev_m["key"] in ev["artifacts"]["eval-cached"]
    assert "eval-metrics" in ev["artifacts"]
    # no bytecode disassembly in any log (dill's capture of dis.dis stays in dill)
    logs = full["logs"] + cont["logs"] + ev["logs"]
    assert not [m for m in logs if "LOAD_GLOBAL" in m or "RESUME" in m.split()], "bytecode in the flow logs"
    # the lineage artifact is markdown, not mermaid code
    lineage = cont["artifacts"]["lineage-export"]
    assert "```mermaid" not in lineage and "| raw input | bytes | sha256 |" in lineage and "- **export/" in lineage


@pytest.mark.slow
def test_eval_of_another_model_says_the_model_changed(scheduled_then_eval_only):
    rep, store = scheduled_then_eval_only
    other, _prev = rep["eval_other"], rep["eval_only"]
    assert other["state"] == "Completed", other
    base = Path(rep["continued"]["result"]["pretrain"])
    merged = Path(rep["continued"]["result"]["merged"])
    m = store.read_manifest(other["result"])
    assert m["inputs"][0]["key"] == base.name
    sel = m["model_choice"]
    assert sel["rule"] == "given" and sel["artifact"] == f"pretrain/{base.name}"
    assert f"evaluated merged/{merged.name}" in sel["note"] and f"evaluates pretrain/{base.name}" in sel["note"]
    report = other["artifacts"]["eval-report-tiny"]
    assert "**Note: the model changed" in report and f"merged/{merged.name}" in report
    assert any("the model changed" in msg for msg in other["logs"])
    assert "the model changed" in (Path(other["result"]) / "report.md").read_text()
