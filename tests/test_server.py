"""Integration against a real Prefect server: serve the deployments, run them with `prefect deployment run`.

Starts `prefect server start` on a free loopback port with its own PREFECT_HOME, serves
the deployments (scripts/serve.py) for the tiny pipeline, runs the full pipeline and then
a stage-only deployment, and stops everything it started.
"""

from __future__ import annotations

import json
import os
import signal
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
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "home"), PREFECT_API_URL=api,
               PREFECT_SERVER_ANALYTICS_ENABLED="false", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", GLOG_v="3",
               PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    return port, api, env


from tasks.serving.health import stop_group  # noqa: E402
_stop = stop_group


def _task_names(api: str, flow_run_id: str) -> list[str]:
    body = json.dumps({"flow_runs": {"id": {"any_": [flow_run_id]}}}).encode()
    req = urllib.request.Request(api + "/task_runs/filter", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return sorted(t["name"].rsplit("-", 1)[0] for t in json.loads(r.read()))


def _run_deployment(env: dict, name: str, timeout: int = 900) -> str:
    out = subprocess.run([PREFECT, "deployment", "run", name, "--watch", "--watch-timeout", str(timeout)],
                         capture_output=True, text=True, env=env, timeout=timeout + 60)
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
        server = subprocess.Popen([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, stdout=open(tmp_path / "server.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        procs.append(server)
        _wait_health(api, 120)
        serve = subprocess.Popen([sys.executable, "scripts/serve.py", "--pipeline", "tiny", "--config", str(cfg),
                                  "--artifacts", str(tmp_path / "artifacts"), "--cron", ""],
                                 cwd=REPO, env=env, stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT,
                                 start_new_session=True)
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
