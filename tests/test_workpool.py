"""prefect.yaml: the deployments of scripts/serve.py on a `process` work pool, run by real workers.

The fast test checks that prefect.yaml declares exactly what serve.py serves. The slow one
starts `prefect server start` on a free loopback port (own PREFECT_HOME), creates the pool,
runs `prefect deploy --all` from the repo root, starts two `prefect worker start --pool`
processes, and runs eval-only twice through the pool at once: each worker takes one run,
and each run writes its eval artifact (and its TensorBoard scores) into the shared root.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.test_server import PREFECT, _free_port, _task_names, _wait_health

REPO = Path(__file__).resolve().parent.parent
POOL = "msllm"


def _prefect_yaml() -> dict:
    return yaml.safe_load((REPO / "prefect.yaml").read_text())


def _serve_script():
    spec = importlib.util.spec_from_file_location("serve_script", REPO / "scripts" / "serve.py")
    serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(serve)
    return serve


def test_prefect_yaml_declares_the_served_deployments():
    serve = _serve_script()
    served = serve.deployments("demo", "pipelines.yaml", "artifacts", all_pipelines=True)
    doc = _prefect_yaml()
    declared = {}
    for d in doc["deployments"]:
        module, func = d["entrypoint"].split(":")
        mod = importlib.import_module(module.removesuffix(".py").replace("/", "."))
        declared[(getattr(mod, func).name, d["name"])] = d
    assert set(declared) == {(d.flow_name, d.name) for d in served}
    for d in served:
        y = declared[(d.flow_name, d.name)]
        assert y["work_pool"]["name"] == POOL
        assert {k: v for k, v in y["parameters"].items() if k not in ("config", "artifacts")} == {
            k: v for k, v in d.parameters.items() if k not in ("config", "artifacts")
        }
        assert set(y["parameters"]) == set(d.parameters)
        crons = [(s.schedule.cron, s.schedule.timezone) for s in d.schedules or []]
        assert [(s["cron"], s.get("timezone")) for s in y.get("schedules", [])] == crons, d.name
    # one scheduled deployment per pipeline that asks for it in pipelines.yaml, and only those
    assert sorted(n for _, n in declared if n.startswith("scheduled-")) == sorted(
        f"scheduled-{p}" for p in serve.schedules(str(REPO / "pipelines.yaml"))
    )
    assert doc["definitions"]["work_pool"]["job_variables"]["env"]["HF_HUB_OFFLINE"] == "1"


def test_serve_registers_the_deployments_of_its_pipeline_only(tmp_path):
    """`serve.py --pipeline X`: X's deployments (and X's schedule only); --all-pipelines adds every pipeline's."""
    serve = _serve_script()
    doc = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    doc["pipelines"]["tiny"]["continued"] = {"schedule": {"cron": "0 5 * * 2", "timezone": "UTC"}}
    config = tmp_path / "pipelines.yaml"
    config.write_text(yaml.safe_dump(doc))
    assert sorted(serve.schedules(str(config))) == ["demo", "tiny"]

    def names(deps):
        return sorted(f"{d.flow_name}/{d.name}" for d in deps)

    on_demand = [
        "continued-pretraining/continued",
        "data-stage/data-only",
        "eval-stage/eval-only",
        "export-stage/export-only",
        "finetune-stage/finetune-only",
        "full-pipeline/full-pipeline",
        "pretrain-stage/pretrain-only",
    ]
    smol = serve.deployments("smollm2", str(config), "artifacts")
    assert names(smol) == on_demand and all(d.parameters["pipeline"] == "smollm2" and not d.schedules for d in smol)
    tiny = serve.deployments("tiny", str(config), "artifacts")
    assert names(tiny) == sorted([*on_demand, "continued-pretraining/scheduled-tiny"])
    (sched,) = [d for d in tiny if d.schedules]
    assert sched.parameters["pipeline"] == "tiny" and sched.schedules[0].schedule.cron == "0 5 * * 2"
    cron = serve.deployments("smollm2", str(config), "artifacts", cron="0 4 * * *")
    assert [(d.name, d.schedules[0].schedule.cron) for d in cron if d.schedules] == [("scheduled-smollm2", "0 4 * * *")]
    every = serve.deployments("smollm2", str(config), "artifacts", all_pipelines=True)
    assert names(every) == sorted(
        [*on_demand, "continued-pretraining/scheduled-demo", "continued-pretraining/scheduled-tiny"]
    )
    assert {d.name: d.parameters["pipeline"] for d in every if d.schedules} == {
        "scheduled-demo": "demo",
        "scheduled-tiny": "tiny",
    }
    out = subprocess.run(
        [sys.executable, "scripts/serve.py", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "--all-pipelines" in out.stdout and "--param pipeline=NAME" in out.stdout


def _api(url: str, body: dict | None = None):
    req = urllib.request.Request(
        url, data=json.dumps(body).encode() if body is not None else None, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen, sig=signal.SIGINT, wait: float = 20) -> None:
    """Stop a process group we started: SIGINT (a worker exits cleanly on it), then SIGKILL."""
    if proc.poll() is None:
        os.killpg(proc.pid, sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _wait_terminal(api: str, run_id: str, timeout: float) -> dict:
    t0 = time.time()
    while time.time() - t0 < timeout:
        run = _api(f"{api}/flow_runs/{run_id}")
        if run["state"] and run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(2)
    raise TimeoutError(f"flow run {run_id} not finished after {timeout}s")


@pytest.mark.slow
def test_two_workers_run_eval_only_from_prefect_yaml(tmp_path):
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.lineage import lineage_tree
    from tasks.store.tensorboard import read_scalars
    from tests.helpers import tiny_model_artifact

    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    model = tiny_model_artifact(artifacts)  # a real (random) tiny model artifact in the shared root
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_WORKER_QUERY_SECONDS="2",
        GLOG_v="3",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    logs = {}
    procs: list[subprocess.Popen] = []

    def start(name: str, *args: str) -> subprocess.Popen:
        logs[name] = tmp_path / f"{name}.log"
        p = subprocess.Popen(
            [PREFECT, *args],
            cwd=REPO,
            env=env,
            stdout=open(logs[name], "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(p)
        return p

    def cli(*args: str, timeout: int = 120) -> str:
        out = subprocess.run(
            [PREFECT, *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        assert out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-3000:])
        return out.stdout

    t0 = time.time()
    try:
        start("server", "server", "start", "--host", "127.0.0.1", "--port", str(port))
        _wait_health(api, 120)
        cli("work-pool", "create", POOL, "--type", "process")
        cli("deploy", "--all", timeout=300)
        deployed = {d["name"]: d for d in _api(f"{api}/deployments/filter", {})}
        assert sorted(deployed) == sorted(d["name"] for d in _prefect_yaml()["deployments"])
        assert {d["work_pool_name"] for d in deployed.values()} == {POOL}
        assert deployed["scheduled-demo"]["schedules"][0]["schedule"]["cron"] == "0 3 * * 1"
        step = deployed["eval-only"]["pull_steps"][0]["prefect.deployments.steps.set_working_directory"]
        assert Path(step["directory"]) == REPO  # no pull section: the directory `prefect deploy` ran in
        for w in ("worker-a", "worker-b"):
            start(w, "worker", "start", "--pool", POOL, "--name", w, "--limit", "1")
        params = {
            "pipeline": "tiny",
            "config": str(REPO / "pipelines.yaml"),
            "artifacts": str(artifacts),
            "model_artifact": str(model),
        }
        run_ids = []
        for limit in (3, 4):  # two different eval keys, submitted together: one per worker
            p = dict(params, overrides=["eval.tasks=[local_arc_easy]", f"eval.limit={limit}"])
            out = cli("deployment", "run", "eval-stage/eval-only", "--params", json.dumps(p))
            run_ids.append(re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1))
        runs = [_wait_terminal(api, r, 600) for r in run_ids]
        states = {r["id"]: [s["name"] for s in _api(f"{api}/flow_run_states/?flow_run_id={r['id']}")] for r in runs}
        assert all(r["state"]["type"] == "COMPLETED" for r in runs), (
            states,
            *(logs[w].read_text()[-3000:] for w in logs),
        )
        # Both workers may start to submit the same run ("submitting flow run ..."); the one whose
        # Pending proposal the server refuses logs "Aborted submission" and drops it. What a worker
        # really ran is what it handed to its infrastructure, logged by the run's name.
        names = {r["name"]: r["id"] for r in runs}
        taken = {
            w: [
                names.get(n, n)
                for n in re.findall(r"Flow run '([^']+)' submitted to infrastructure", logs[w].read_text())
            ]
            for w in ("worker-a", "worker-b")
        }
        assert sorted(sum(taken.values(), [])) == sorted(run_ids) and all(len(v) == 1 for v in taken.values()), (
            taken,
            *(logs[w].read_text()[-3000:] for w in ("worker-a", "worker-b")),
        )
        assert all(_task_names(api, r) == ["eval"] for r in run_ids)
        # the first eval again with the forced rerun: computed again under the same key, the previous record kept
        p = dict(params, overrides=["eval.tasks=[local_arc_easy]", "eval.limit=3"], refresh=True)
        out = cli("deployment", "run", "eval-stage/eval-only", "--params", json.dumps(p))
        rerun = _wait_terminal(api, re.search(r"UUID:\s*([0-9a-f-]{36})", out).group(1), 600)
        assert rerun["state"]["type"] == "COMPLETED", [logs[w].read_text()[-3000:] for w in logs]
        assert _task_names(api, rerun["id"]) == ["eval"]
    finally:
        for p in reversed(procs):  # workers first, while the server still answers
            _stop(p)
    store = ArtifactStore(artifacts)
    evals = [p for p, _ in store.list("eval", "tiny")]
    assert len(evals) == 2  # the rerun replaced one under its key; the replaced record is out of the listing
    rerun_path = next(p for p in evals if store.read_manifest(p)["config"]["limit"] == 3)
    replaced = store.read_manifest(rerun_path)["replaces"]
    old = store.read_manifest(Path(replaced["path"]))
    assert (
        old["key"] == rerun_path.name
        and old["created"] == replaced["created"] < store.read_manifest(rerun_path)["created"]
    )
    assert lineage_tree(store, rerun_path)["replaces"]["path"] == replaced["path"]
    for path in evals:
        m = store.verify(path)
        assert 0.0 <= m["metrics"]["local_arc_easy.acc"] <= 1.0 and (path / "results.json").is_file()
        scores = read_scalars(store.root / "runs" / "eval" / path.name)
        # float32 in the event file: one rounding (2^-24 relative), inside pytest.approx's 1e-6
        assert scores["eval/local_arc_easy.acc"] == [(0, pytest.approx(m["metrics"]["local_arc_easy.acc"]))]
    assert all(p.poll() is not None for p in procs)
    print("WORKPOOL", json.dumps({"states": states, "taken": taken, "wall_s": round(time.time() - t0, 1)}))


@pytest.mark.slow
def test_prefect_yaml_deploys_on_another_port_and_the_ui_finds_its_api(tmp_path):
    """The README's recipe for a port other than 4200 (PREFECT_SERVER_API_PORT + PREFECT_API_URL, no --port):
    `prefect deploy --all` puts prefect.yaml's deployments, the per-pipeline schedules among them, on the pool,
    and the UI's settings endpoint hands the browser that port's API URL (with `--port` alone it says 4200,
    and the UI shows "Can't connect to Server API")."""
    port = _free_port()
    assert port != 4200
    api = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_SERVER_API_PORT=str(port),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    env.pop("PREFECT_UI_API_URL", None)
    log = tmp_path / "server.log"
    server = subprocess.Popen(
        [PREFECT, "server", "start", "--host", "127.0.0.1"],
        cwd=REPO,
        env=env,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_health(api, 120)

        def cli(*args: str, timeout: int = 300) -> str:
            out = subprocess.run(
                [PREFECT, *args],
                cwd=REPO,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
            assert out.returncode == 0, (args, out.stdout[-3000:], out.stderr[-3000:])
            return out.stdout

        cli("work-pool", "create", POOL, "--type", "process")
        cli("deploy", "--all")
        deployed = {d["name"]: d for d in _api(f"{api}/deployments/filter", {})}
        assert sorted(deployed) == sorted(d["name"] for d in _prefect_yaml()["deployments"])
        assert {d["work_pool_name"] for d in deployed.values()} == {POOL}
        assert deployed["scheduled-demo"]["schedules"][0]["schedule"]["cron"] == "0 3 * * 1"
        assert not deployed["continued"]["schedules"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ui-settings", timeout=10) as r:
            ui = json.loads(r.read())
        assert ui["api_url"] == api, (ui, log.read_text()[-2000:])
    finally:
        _stop(server)
