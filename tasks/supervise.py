"""Running a heavy stage in a supervised child process (`python -m tasks.<stage> --child spec.json`).

MindSpore's context is process-global and a crash or OOM must not take the caller (a
Prefect flow) down. The parent writes a JSON spec, streams the child's output as it
comes, and on failure raises `StageFailed` with the child's own error line on top; a
retry reruns the child, which resumes from its newest checkpoint.

    path = supervise("pretrain", store, key, spec, train_fn, retries=1, isolate=True)
    sys.exit(child_main(train_fn))      # in the stage module's `if __name__ == "__main__"`
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from tasks.artifacts import ArtifactStore, atomic_write_json

STOPPED_EARLY = 75  # child exit code: stopped on request before max_steps, checkpoints kept
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}  # the child's output streams through the parent as it comes


class StageFailed(RuntimeError):
    """The stage's child process failed; the message starts with its own error."""


def run_child(module: str, spec_path: Path) -> str | None:
    """Run `python -m module --child spec`, relaying its output as it comes (progress bars included).

    Returns None on success, else the child's own error line on top of its last log lines.
    """
    env = {**CHILD_ENV, **os.environ, "GLOG_v": os.environ.get("GLOG_v", "3")}
    proc = subprocess.Popen([sys.executable, "-m", module, "--child", str(spec_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
    assert proc.stdout is not None
    tail = b""
    while chunk := proc.stdout.read1(65536):
        sys.stderr.buffer.write(chunk)
        sys.stderr.buffer.flush()
        tail = (tail + chunk)[-20000:]
    rc = proc.wait()
    if rc == 0:
        return None
    lines = [ln.rsplit("\r", 1)[-1] for ln in tail.decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln.strip()][-40:]
    errors = [ln for ln in lines if ln.startswith("error:") or "Error" in ln.split(":")[0]]
    head = errors[-1].removeprefix("error: ") if errors else f"{module} child exited with code {rc}"
    if rc == STOPPED_EARLY:
        head = f"{module} child stopped before the end (stop_after)"
    elif rc < 0 or rc == 137:
        head = f"{module} child was killed (signal {-rc if rc < 0 else 9}; out of memory?)"
    return head + "\n--- last lines of the child's log ---\n" + "\n".join(lines)


def supervise(stage: str, store: ArtifactStore, key: str, spec: dict[str, Any],
              child_fn: Callable[[dict[str, Any]], Path | None], *, retries: int = 0, isolate: bool = True,
              inject: dict | None = None, parallel=None) -> Path:
    """Run `child_fn(spec)` in `python -m tasks.<stage> --child` (or in-process), retrying failures.

    With `parallel` (a config ParallelSection) of device_num > 1 the child is `device_num`
    ranks started by msrun (tasks/distributed.py); its logs go to runs/<stage>/<key>/msrun_logs.
    `inject` (tests only) is merged into the first attempt's spec: {"stop_after": k} stops it
    after k steps as if killed, {"fault_steps": [...]} makes those steps non-finite.
    """
    distributed = parallel is not None and parallel.device_num > 1
    if distributed and not isolate:
        raise ValueError(f"{stage}: parallel.device_num={parallel.device_num} runs ranks under msrun; "
                         "it cannot run in-process (isolate=False)")
    if not isolate:
        out = child_fn({**spec, **(inject or {})})
        if out is None:
            raise StageFailed(f"{stage} stopped before max_steps (stop_after)")
        return out
    run_dir = store.root / "runs" / stage / key
    run_dir.mkdir(parents=True, exist_ok=True)
    err = None
    for attempt in range(retries + 1):
        atomic_write_json(run_dir / "spec.json", {**spec, **((inject or {}) if attempt == 0 else {})})
        if distributed:
            from tasks.distributed import launch

            err = launch(stage, run_dir / "spec.json", parallel, run_dir / "msrun_logs")
        else:
            err = run_child(f"tasks.{stage}", run_dir / "spec.json")
        hit = store.lookup(stage, key)
        if err is None and hit is not None:
            return hit
        if attempt < retries:
            print(f"[{stage}] attempt {attempt + 1} failed; retrying from the last checkpoint", file=sys.stderr)
    raise StageFailed(err or f"the {stage} child exited without writing its artifact")


def child_main(child_fn: Callable[[dict[str, Any]], Path | None], argv: list[str] | None = None) -> int:
    """Entry point of a stage's child process: run the spec, print the artifact path."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", required=True)
    args = ap.parse_args(argv)
    spec = json.loads(Path(args.child).read_text())
    try:
        path = child_fn(spec)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    if path is None:
        from tasks.distributed import STOPPED_MARK

        print(STOPPED_MARK, file=sys.stderr, flush=True)
        return STOPPED_EARLY
    print(path)
    return 0
