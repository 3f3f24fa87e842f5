"""Prefect flows on the embedded server: content-addressed caching across flow runs.

Each scenario runs in its own Python process with its own PREFECT_HOME (the embedded
server is process-global); the driver prints the state of every task run as JSON.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

DRIVER = r"""
import json, sys, time
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, FlowRunFilter, FlowRunFilterId
from flows.full_pipeline import full_pipeline

args = json.loads(sys.argv[1])
report = []
for overrides in args["runs"]:
    t0 = time.perf_counter()
    state = full_pipeline(pipeline="tiny", config=args["config"], overrides=overrides, artifacts=args["artifacts"],
                          init_from=args.get("init_from"), return_state=True)
    wall = time.perf_counter() - t0
    run_id = state.state_details.flow_run_id
    with get_client(sync_client=True) as c:
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run_id])))
    tasks = {}
    for tr in sorted(trs, key=lambda t: t.expected_start_time or t.start_time):
        tasks.setdefault(tr.name.rsplit("-", 1)[0], []).append(tr.state.name)
    by_task = {tr.id: tr.name.rsplit("-", 1)[0] for tr in trs}
    artifacts = sorted([by_task.get(a.task_run_id, "flow"), a.key or "", a.type or ""] for a in arts)
    report.append({"flow": state.name, "wall": wall, "tasks": tasks, "artifacts": artifacts,
                   "result": state.result() if state.is_completed() else None,
                   "error": None if state.is_completed() else str(state.result(raise_on_failure=False))})
print("REPORT " + json.dumps(report))
"""


def _drive(tmp_path: Path, config: Path, runs: list[list[str]], init_from: Path | None = None) -> list[dict]:
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "prefect_home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_API_URL="",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        GLOG_v="3",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    env.pop("PREFECT_API_URL")
    arg = json.dumps(
        {
            "config": str(config),
            "artifacts": str(tmp_path / "artifacts"),
            "runs": runs,
            "init_from": str(init_from) if init_from else None,
        }
    )
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=1200
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert out.returncode == 0 and line, (out.stdout[-3000:], out.stderr[-5000:])
    return json.loads(line[len("REPORT ") :])


def _tiny_config(tmp_path: Path) -> Path:
    """The repo's pipelines.yaml with the tiny pipeline's corpus copied into tmp (so tests can edit its bytes)."""
    doc = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO / "data/corpora/tinyshakespeare.txt").read_text()[:150_000])
    tiny = doc["pipelines"]["tiny"]
    tiny["data"]["sources"] = [str(corpus)]
    tiny["pretrain"]["train"]["loop"].update(max_steps=4, eval_steps=4, log_steps=2)
    tiny["pretrain"]["train"]["schedule"]["warmup_steps"] = 1
    tiny["checkpoint"]["save_steps"] = 4
    f = tmp_path / "pipelines.yaml"
    f.write_text(yaml.safe_dump(doc))
    shutil.copytree(REPO / "data", tmp_path / "data", dirs_exist_ok=True, ignore=shutil.ignore_patterns("corpora"))
    return f


@pytest.mark.slow
def test_rerun_is_cached_and_edits_rerun_only_what_changed(tmp_path):
    cfg = _tiny_config(tmp_path)
    first, again, edited = _drive(tmp_path, cfg, [[], [], ["eval.limit=4"]])
    assert first["flow"] == "Completed" and all(s == ["Completed"] for s in first["tasks"].values()), first
    # unchanged rerun: every stage cached, same artifacts, seconds
    assert all(set(s) == {"Cached"} for s in again["tasks"].values()), again
    assert again["result"] == first["result"]
    assert again["wall"] < 60, again["wall"]
    # editing only the eval section reruns only eval
    assert {k: v for k, v in edited["tasks"].items() if k != "eval"} == {
        k: ["Cached"] for k in edited["tasks"] if k != "eval"
    }
    assert edited["tasks"]["eval"] == ["Completed"], edited
    assert edited["result"]["pretrain"] == first["result"]["pretrain"]
    assert edited["result"]["eval"] != first["result"]["eval"]
    # changing the corpus bytes under the same path reruns data and everything after it
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus.read_text().replace("Citizen", "Burgher"))
    (changed,) = _drive(tmp_path, cfg, [[]])
    assert all(v == ["Completed"] for v in changed["tasks"].values()), changed
    assert set(changed["tasks"]) == {"data", "pretrain", "finetune", "eval", "export"}
    assert changed["result"]["data"] != first["result"]["data"]


@pytest.mark.slow
def test_convert_is_a_cached_task_with_its_metrics_artifact(tmp_path):
    """init_from naming a Hugging Face directory: the flow converts it in a `convert` task run (its log lines and
    `convert-metrics` artifact, like every stage), and a rerun finds it Cached with the same artifact."""
    from tasks.stages.convert import to_hf
    from tests.helpers import tiny_model_artifact

    (tmp_path / "src").mkdir()
    hf_dir = to_hf(tiny_model_artifact(tmp_path / "src"), tmp_path / "hf-llama")  # config.json, safetensors, tokenizer
    cfg = _tiny_config(tmp_path)
    quick = [
        "finetune.train.loop.max_steps=2",
        "finetune.train.loop.eval_steps=2",
        "finetune.train.loop.save_steps=2",
        "eval.tasks=[local_piqa]",
        "eval.limit=2",
        "export.formats=[onnx]",
        "export.int8=false",
    ]
    first, again = _drive(tmp_path, cfg, [quick, quick], init_from=hf_dir)
    assert first["flow"] == "Completed" and all(s == ["Completed"] for s in first["tasks"].values()), first
    assert list(first["tasks"])[:3] == ["convert", "data", "pretrain"], first["tasks"]
    assert ["convert", "convert-metrics", "table"] in first["artifacts"], first["artifacts"]
    from tasks.store.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "artifacts")
    (conv,) = store.list("convert")
    pre = ArtifactStore.read_manifest(first["result"]["pretrain"])
    assert any(i.get("stage") == "convert" and i["key"] == conv[0].name for i in pre["inputs"]), pre["inputs"]
    assert again["tasks"]["convert"] == ["Cached"] and again["result"] == first["result"], again
    assert ["flow", "convert-cached", "markdown"] in again["artifacts"], again["artifacts"]  # run_stage publishes it


COUNT_DRIVER = r"""
import json, sys
from collections import Counter
from pathlib import Path
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
import flows.stages
from flows.full_pipeline import full_pipeline
from tasks.stages import STAGES, runner, stage_module

args = json.loads(sys.argv[1])
counts = Counter()

def counting(name, fn):
    def wrapper(*a, **kw):
        counts[name] += 1
        return fn(*a, **kw)
    return wrapper

def stub(store, stage, key, inputs):
    with store.build(stage, key, pipeline="tiny", config={}, inputs=inputs, code="test") as b:
        (b.dir / "model.json").write_text("{}")  # read by export's model check
    return b.path

def fake_run(name):  # the stage's work: only what the key names (a missing key fails the task)
    def run(store, keyed=None, **kw):
        assert keyed is not None, f"{name}: run got no precomputed key"
        counts[f"{name}.run"] += 1
        return stub(store, name, keyed[0], keyed[1])
    return run

for name in STAGES:
    mod = stage_module(name)
    if hasattr(mod, "stage_key"):
        mod.stage_key = counting(name, mod.stage_key)
        mod.run = fake_run(name)
runner.machine_fit_errors = counting("machine", runner.machine_fit_errors)
flows.stages.merge = lambda store, path: stub(store, "merged", Path(path).name, [store.input_ref(path)])

report = []
for _ in range(2):
    counts.clear()
    state = full_pipeline(pipeline="tiny", config=args["config"], artifacts=args["artifacts"], return_state=True)
    with get_client(sync_client=True) as c:
        run_id = state.state_details.flow_run_id
        trs = c.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))
    report.append({"flow": state.name, "counts": dict(counts), "error": None if state.is_completed() else
                   str(state.result(raise_on_failure=False)),
                   "tasks": {tr.name.rsplit("-", 1)[0]: tr.state.name for tr in trs}})
print("REPORT " + json.dumps(report))
"""


def test_a_flow_run_computes_each_stage_key_once(tmp_path):
    """full-pipeline prepares each stage once with the stage runner (machine check, key) and hands the call to
    its task: the Prefect cache key reads it, the stage's run gets it. Stage work is stubbed (the keys are real);
    the rerun is Cached throughout, again with one key per stage."""
    config = _tiny_config(tmp_path)
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "ph"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="WARNING",
        GLOG_v="3",
    )
    env.pop("PREFECT_API_URL", None)
    arg = json.dumps({"config": str(config), "artifacts": str(tmp_path / "artifacts")})
    out = subprocess.run(
        [sys.executable, "-c", COUNT_DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert out.returncode == 0 and line, (out.stdout[-3000:], out.stderr[-5000:])
    first, again = json.loads(line[len("REPORT ") :])
    stages = {"data", "pretrain", "finetune", "eval", "export"}
    assert first["flow"] == "Completed", first
    assert first["counts"] == {**{s: 1 for s in stages}, **{f"{s}.run": 1 for s in stages}, "machine": 2}, first
    assert first["tasks"] == {s: "Completed" for s in stages}, first
    assert again["flow"] == "Completed" and again["tasks"] == {s: "Cached" for s in stages}, again
    assert again["counts"] == {**{s: 1 for s in stages}, "machine": 2}, again  # the cache key computed nothing


FAIL_DRIVER = r"""
import json, sys
from flows.full_pipeline import full_pipeline
args = json.loads(sys.argv[1])
state = full_pipeline(pipeline="tiny", config=args["config"], overrides=[], artifacts=args["artifacts"],
return_state=True)
exc = state.result(raise_on_failure=False)
print("REPORT " + json.dumps({"state": state.name, "error": str(exc)}))
"""


@pytest.mark.slow
def test_failing_stage_fails_the_flow_with_its_own_error_and_leaves_no_artifact(tmp_path):
    import gzip

    cfg = _tiny_config(tmp_path)
    bad = tmp_path / "corpus.jsonl.gz"
    bad.write_bytes(gzip.compress(b'{"text": "a document"}\n' * 2000)[:-40])  # truncated gzip stream
    doc = yaml.safe_load(cfg.read_text())
    doc["pipelines"]["tiny"]["data"]["sources"] = [str(bad)]
    cfg.write_text(yaml.safe_dump(doc))
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "ph"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        GLOG_v="3",
        PREFECT_LOGGING_LEVEL="WARNING",
    )
    env.pop("PREFECT_API_URL", None)
    arg = json.dumps({"config": str(cfg), "artifacts": str(tmp_path / "artifacts")})
    out = subprocess.run(
        [sys.executable, "-c", FAIL_DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=600
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("REPORT ")), None)
    assert line, out.stderr[-4000:]
    rep = json.loads(line[len("REPORT ") :])
    assert rep["state"] == "Failed"
    assert "corpus.jsonl.gz" in rep["error"] and "gzip" in rep["error"].lower(), rep["error"]
    from tasks.store.artifacts import ArtifactStore

    store = ArtifactStore(tmp_path / "artifacts")
    assert all(store.list(stage) == [] for stage in ("data", "pretrain", "finetune", "eval", "export"))


@pytest.mark.slow
def test_full_pipeline_runs_data_parallel_through_msrun(tmp_path):
    """The whole flow with parallel {data_parallel: 2, device_num: 2}: pretrain and finetune under msrun."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = _tiny_config(tmp_path)
    dp2 = [
        "parallel.data_parallel=2",
        "parallel.device_num=2",
        f"parallel.master_port={port}",
        "pretrain.train.loop.micro_batch_size=4",
        "finetune.train.loop.micro_batch_size=4",
    ]
    (run,) = _drive(tmp_path, config, [dp2])
    assert run["flow"] == "Completed", run
    assert all(states == ["Completed"] for states in run["tasks"].values()), run["tasks"]
    art = tmp_path / "artifacts"
    for stage in ("pretrain", "finetune"):
        (key_dir,) = (art / "runs" / stage).iterdir()
        logs = sorted(p.name for p in (key_dir / "msrun_logs").glob("worker_*.log"))
        assert logs == ["worker_0.log", "worker_1.log"], (stage, logs)
    (pre,) = (art / "pretrain").iterdir()
    manifest = json.loads((pre / "manifest.json").read_text())
    assert manifest["metrics"]["layout"] == {"data_parallel": 2, "tensor_parallel": 1}
    assert manifest["metrics"]["consumed_samples"] == 4 * 8  # 4 steps × global batch 2 × 4
    assert list((art / "export").iterdir())  # eval and export ran on the merged model
