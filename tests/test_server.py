"""Integration against a real Prefect server: serve the deployments, run them with `prefect deployment run`.

Starts `prefect server start` on a free loopback port with its own PREFECT_HOME, serves
the deployments (scripts/serve.py) for the tiny pipeline, runs the full pipeline and then
a stage-only deployment, and stops everything it started.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.test_flows import _tiny_config

REPO = Path(__file__).resolve().parent.parent
PREFECT = str(Path(sys.executable).with_name("prefect"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"prefect server at {url} not healthy after {timeout}s")


def server_env(tmp_path: Path) -> tuple[int, str, dict[str, str]]:
    """A free port, the API URL of a Prefect server started on it, and the environment for the server and its
    clients (a private PREFECT_HOME under tmp_path, offline, this virtualenv's scripts first on PATH)."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "home"),
        PREFECT_API_URL=api,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        HF_DATASETS_OFFLINE="1",
        HF_HUB_OFFLINE="1",
        GLOG_v="3",
        PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    )
    return port, api, env


from tasks.serving.health import stop_group  # noqa: E402

_stop = stop_group


def _task_names(api: str, flow_run_id: str) -> list[str]:
    body = json.dumps({"flow_runs": {"id": {"any_": [flow_run_id]}}}).encode()
    req = urllib.request.Request(api + "/task_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted(t["name"].rsplit("-", 1)[0] for t in json.loads(r.read()))


def _run_deployment(env: dict, name: str, timeout: int = 900) -> str:
    out = subprocess.run(
        [PREFECT, "deployment", "run", name, "--watch", "--watch-timeout", str(timeout)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout + 60,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "Completed" in text, text[-4000:]
    run_id = next(ln.split()[-1] for ln in text.splitlines() if "UUID:" in ln)
    return run_id


@pytest.mark.slow
def test_deployments_on_a_real_server(tmp_path):
    cfg = _tiny_config(tmp_path)
    port, api, env = server_env(tmp_path)
    procs = []
    try:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=open(tmp_path / "server.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(server)
        _wait_health(api, 120)
        serve = subprocess.Popen(
            [
                sys.executable,
                "scripts/serve.py",
                "--pipeline",
                "tiny",
                "--config",
                str(cfg),
                "--artifacts",
                str(tmp_path / "artifacts"),
                "--cron",
                "",
            ],
            cwd=REPO,
            env=env,
            stdout=open(tmp_path / "serve.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(serve)
        t0 = time.time()
        while time.time() - t0 < 120:
            ls = subprocess.run([PREFECT, "deployment", "ls"], capture_output=True, text=True, env=env)
            if "full-pipeline/full-pipeline" in ls.stdout.replace(" ", "") or "full-pipeline" in ls.stdout:
                break
            time.sleep(2)
        full = _run_deployment(env, "full-pipeline/full-pipeline")
        names = _task_names(api, full)
        assert {"data", "pretrain"} <= set(names), names
        stage_only = _run_deployment(env, f"{STAGE_ONLY[0]}/{STAGE_ONLY[1]}")
        assert set(_task_names(api, stage_only)) == {STAGE_ONLY[2]}
    finally:
        for p in reversed(procs):
            _stop(p)
    assert all(p.poll() is not None for p in procs)


STAGE_ONLY = ("eval-stage", "eval-only", "eval")


def _api(api: str, path: str, body: dict | None = None):
    req = urllib.request.Request(
        api + path,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_cancelling_a_flow_run_ends_it_and_its_task_cancelled(tmp_path):
    """`prefect flow-run cancel` while the data task runs (its process pool busy): the task ends Cancelled (Prefect
    says Crashed), the flow run Cancelled, no log line says Running or Crashed, and no process of it is left."""
    import psutil

    cfg = _tiny_config(tmp_path)
    port, api, env = server_env(tmp_path)
    procs = []
    try:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=open(tmp_path / "server.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(server)
        _wait_health(api, 120)
        log = tmp_path / "serve.log"
        serve = subprocess.Popen(
            [
                sys.executable,
                "scripts/serve.py",
                "--pipeline",
                "tiny",
                "--config",
                str(cfg),
                "--artifacts",
                str(tmp_path / "artifacts"),
            ],
            cwd=REPO,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(serve)
        t0 = time.time()
        while "trigger" not in log.read_text() and serve.poll() is None and time.time() - t0 < 120:
            time.sleep(0.5)
        out = subprocess.run(
            [PREFECT, "deployment", "run", "data-stage/data-only"], capture_output=True, text=True, env=env, timeout=120
        )
        run_id = next(ln.split()[-1] for ln in out.stdout.splitlines() if "UUID:" in ln)
        t0 = time.time()
        while time.time() - t0 < 300:  # until the data task runs, its pool started
            tasks = _api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
            if (
                any((t["state"] or {}).get("type") == "RUNNING" for t in tasks)
                and len(psutil.Process(serve.pid).children(recursive=True)) >= 2
            ):
                break
            time.sleep(0.5)
        else:
            pytest.fail(log.read_text()[-3000:])
        # at once: the tiny data task can finish within a second on a quiet machine (a 1 s wait here lost that race
        # in a CI run: `flow-run cancel` of a finished run exits 1)
        c = subprocess.run([PREFECT, "flow-run", "cancel", run_id], env=env, capture_output=True, text=True, timeout=60)
        assert c.returncode == 0, (c.stdout, c.stderr, _api(api, f"/flow_runs/{run_id}")["state"])
        t0 = time.time()
        while time.time() - t0 < 120 and _api(api, f"/flow_runs/{run_id}")["state"]["type"] != "CANCELLED":
            time.sleep(0.5)
        t0 = time.time()  # the runner records Cancelled once the flow-run process is gone
        while psutil.Process(serve.pid).children(recursive=True) and time.time() - t0 < 30:
            time.sleep(0.5)
        left = psutil.Process(serve.pid).children(recursive=True)
        history = [s["type"] for s in _api(api, f"/flow_run_states/?flow_run_id={run_id}")]
        (task,) = _api(api, "/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
        logs = _api(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"})
    finally:
        for p in reversed(procs):
            _stop(p)
    text = "\n".join(f"{'task' if lg['task_run_id'] else 'flow'}: {lg['message']}" for lg in logs)
    assert history[-1] == "CANCELLED" and not {"CRASHED", "FAILED", "COMPLETED"} & set(history), (history, text)
    assert task["name"].startswith("data-") and task["state"]["type"] == "CANCELLED", (task["state"], text)
    assert "task: data: stopped, the flow run was cancelled" in text, text
    assert "flow: Finished in state Cancelled(" in text and "task: Finished in state Cancelled(" in text, text
    finished = [lg["level"] for lg in logs if lg["message"].startswith("Finished in state Cancelled(")]
    assert finished == [20, 20], (finished, text)  # the task's and the flow's, at INFO: a cancellation is no error
    assert "Running()" not in text and "Crash" not in text and "Traceback" not in text, text
    assert not left, [p.cmdline() for p in left]


def _documented_commands(heading: str) -> list[str]:
    """The shell lines of the code blocks in docs/PIPELINE.md's paragraph starting with `heading` (up to the next
    heading), continuation lines joined, comments dropped."""
    import re

    text = (REPO / "docs" / "PIPELINE.md").read_text(encoding="utf-8")
    section = text[text.index(heading) :].split("\n#", 1)[0]
    lines = []
    for block in re.findall(r"```\n(.*?)```", section, re.S):
        lines += [re.sub(r"\s+#\s.*$", "", ln).strip() for ln in block.replace("\\\n", " ").splitlines()]
    return [ln for ln in lines if ln]


@pytest.mark.slow
def test_the_documented_prefect_cli_parameter_commands_run_as_documented(tmp_path):
    """docs/PIPELINE.md's list overrides through `prefect deployment run` (--param, --params, --params - < file)
    and its read-backs (deployment inspect, flow-run inspect, the API): each runs against a real server, stores
    the overrides as written, and the echo and the read-backs show them unmangled."""
    commands = _documented_commands("Parameters through the Prefect CLI")
    assert len(commands) == 6 and sum("deployment run" in c for c in commands) == 3, commands
    cfg = _tiny_config(tmp_path)
    port, api, env = server_env(tmp_path)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / ".venv").symlink_to(Path(sys.executable).parents[1])
    (cwd / "params.json").write_text(json.dumps({"overrides": ['eval.tasks=["local_arc_easy"]', "eval.limit=5"]}))
    procs, outputs, runs = [], [], []
    try:
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=open(tmp_path / "server.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(server)
        _wait_health(api, 120)
        log = tmp_path / "serve.log"
        serve = subprocess.Popen(
            [
                sys.executable,
                "scripts/serve.py",
                "--pipeline",
                "tiny",
                "--config",
                str(cfg),
                "--artifacts",
                str(tmp_path / "artifacts"),
            ],
            cwd=REPO,
            env=env,
            stdout=open(log, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(serve)
        t0 = time.time()
        while "trigger" not in log.read_text() and serve.poll() is None and time.time() - t0 < 120:
            time.sleep(0.5)
        for cmd in commands:
            if runs:
                cmd = cmd.replace("<flow-run UUID>", runs[-1])
            out = subprocess.run(cmd, shell=True, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-2000:])
            outputs.append(out.stdout)
            runs += [ln.split()[-1] for ln in out.stdout.splitlines() if "UUID:" in ln]
        stored = [_api(api, f"/flow_runs/{r}")["parameters"] for r in runs]
    finally:
        for p in reversed(procs):
            _stop(p)
    want = ['eval.tasks=["local_arc_easy"]', "eval.limit=5"]
    assert [p["overrides"] for p in stored] == [want] * 3 and stored[1]["pipeline"] == "smollm2", stored
    for echo in outputs[:3]:  # the echo of each deployment run shows the list items
        assert """'overrides': ['eval.tasks=["local_arc_easy"]', 'eval.limit=5']""" in echo, echo
    assert "'parameters': {" in outputs[3] and "'pipeline': 'tiny'" in outputs[3]  # the deployment's defaults
    assert """'overrides': ['eval.tasks=["local_arc_easy"]', 'eval.limit=5']""" in outputs[4]  # flow-run inspect
    assert json.loads(outputs[5])["parameters"]["overrides"] == want  # the raw API
