"""Ctrl-C and SIGTERM stop everything a command started (tasks/runtime/interrupts.py): the README's demo, `msllm
train` and `msllm serve`. Each is started in a process group of its own, as a shell starts a foreground job; the
signal goes where a user's would (the whole group for Ctrl-C, the command's own pid for `kill`). Every process of the
group is gone within 15 s, the output says "interrupted" (not "out of memory?"), nothing was retried, and the next
run resumes from the checkpoint the interrupted one kept and publishes once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tasks.store.artifacts import ArtifactStore

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TINY_LONG = ["--set", "pretrain.train.loop.max_steps=400", "--set", "pretrain.train.loop.save_steps=5"]


def _start(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=open(log, "w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,  # a process group of its own: what Ctrl-C in a shell reaches
        env={**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false", **(env or {})},
    )


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def _wait_for(pred, timeout: float, what: str, log: Path):
    end = time.time() + timeout
    while time.time() < end:
        if (got := pred()) is not None:
            return got
        time.sleep(0.5)
    raise AssertionError(f"{what} not seen in {timeout}s; log:\n{log.read_text()[-3000:]}")


def _training_child(pgid: int, run_root: Path):
    """The pretrain child of the group once it has saved a checkpoint (so a rerun has one to resume from)."""
    kids = [p for p in _group(pgid) if "tasks.runtime.child" in " ".join(p.cmdline()) and "pretrain" in p.cmdline()]
    ckpts = list(run_root.glob("runs/pretrain/*/checkpoints/step_*")) if run_root.is_dir() else []
    return kids[0] if kids and ckpts else None


def _stopped_within(pgid: int, seconds: float) -> list[str]:
    end = time.time() + seconds
    while time.time() < end:
        alive = [p for p in _group(pgid) if p.status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return [" ".join(p.cmdline())[:120] for p in _group(pgid)]


@pytest.mark.slow
def test_ctrl_c_stops_the_demo_and_a_rerun_resumes(tmp_path):
    art = tmp_path / "artifacts"
    log = tmp_path / "demo.log"
    cmd = [PY, "scripts/demo.py", "--pipeline", "tiny", "--artifacts", str(art), *TINY_LONG]
    proc = _start(cmd, log)
    pgid = proc.pid
    _wait_for(lambda: _training_child(pgid, art), 300, "the pretrain child with a checkpoint", log)
    os.killpg(pgid, signal.SIGINT)  # Ctrl-C: the whole foreground group
    left = _stopped_within(pgid, 15)
    assert left == [], f"still running 15 s after Ctrl-C: {left}\n{log.read_text()[-3000:]}"
    assert proc.wait(5) == 130
    text = log.read_text()
    assert "interrupted" in text and "out of memory" not in text
    assert "retrying" not in text and "Retrying" not in text and "AwaitingRetry" not in text
    assert ArtifactStore(art).list("pretrain") == []  # nothing published half-way

    log2 = tmp_path / "demo2.log"
    rerun = _start(cmd, log2)
    assert rerun.wait(900) == 0, log2.read_text()[-3000:]
    text2 = log2.read_text()
    assert "resumed from step_" in text2
    assert len(ArtifactStore(art).list("pretrain")) == 1


@pytest.mark.slow
def test_sigterm_stops_msllm_train_and_its_child(tmp_path):
    art = tmp_path / "artifacts"
    log = tmp_path / "train.log"
    base = [PY, "-m", "tasks.cli", "--config", "pipelines.yaml", "--pipeline", "tiny", "--artifacts", str(art)]
    assert subprocess.run([*base[:3], "data", *base[3:]], cwd=REPO, capture_output=True).returncode == 0
    proc = _start([*base[:3], "train", *base[3:], *TINY_LONG], log)
    child = _wait_for(lambda: _training_child(proc.pid, art), 300, "the pretrain child with a checkpoint", log)
    os.kill(proc.pid, signal.SIGTERM)  # `kill PID`: the command only; it must take its child down itself
    left = _stopped_within(proc.pid, 15)
    assert left == [] and not child.is_running(), f"still running 15 s after SIGTERM: {left}"
    assert proc.wait(5) == 130
    text = log.read_text()
    assert "interrupted" in text and "out of memory" not in text and "retrying" not in text


@pytest.mark.slow
def test_sigterm_stops_msllm_serve(tmp_path):
    from tests.helpers import tiny_model_artifact

    (tmp_path / "artifacts").mkdir()
    art = tiny_model_artifact(tmp_path / "artifacts")
    log = tmp_path / "serve.log"
    port = 18000 + os.getpid() % 1000
    cmd = [PY, "-m", "tasks.cli", "serve", str(art), "--port", str(port), "--artifacts", str(tmp_path / "artifacts")]
    proc = _start(cmd, log)

    def up():
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                return json.loads(r.read())
        except OSError:
            return None

    _wait_for(up, 180, "the server's /health", log)
    os.kill(proc.pid, signal.SIGTERM)
    left = _stopped_within(proc.pid, 15)
    assert left == [], f"still running 15 s after SIGTERM: {left}\n{log.read_text()[-2000:]}"
    assert proc.wait(5) in (0, 130, -signal.SIGTERM)
