"""Waiting for a started `msllm serve` process to answer /health (benchmarks and tests start servers this way)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request


class ServerDied(RuntimeError):
    """The server process exited before it answered /health."""


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float | None = None) -> float:
    """Poll `url`/health every 0.5 s until it answers 200; seconds waited. ServerDied when `proc` exits first,
    TimeoutError after `timeout` seconds (None: no limit)."""
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            raise ServerDied(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except OSError:
            pass
        if timeout is not None and time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"server not healthy after {timeout}s")
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM to the process group of `proc` (started with start_new_session=True), SIGKILL after `grace` s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
