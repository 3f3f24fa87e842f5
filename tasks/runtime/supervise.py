"""Running a heavy stage in a supervised child process (`python -m tasks.runtime.child --stage S --entry M:F --child
spec.json`).

MindSpore's context is process-global and a crash or OOM must not take the caller (a
Prefect flow) down. The parent writes a JSON spec, streams the child's output as it
comes, and on failure raises `StageFailed` with the child's own error line on top; a
retry reruns the child, which resumes from its newest checkpoint.

    path = supervise("pretrain", store, key, spec, train_fn, retries=1, isolate=True)
    sys.exit(child_main(train_fn))      # in the stage module's `if __name__ == "__main__"`
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tasks.runtime.distributed import STOPPED_MARK, NodeLost, launch
from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import atomic_write_json
from tasks.store.errors import STORAGE_ERRNOS, ArtifactError, as_os_error, storage_error
from tasks.store.locks import held_locks_env

STOPPED_EARLY = 75  # child exit code: stopped on request before max_steps, checkpoints kept
PERMANENT = 3  # child exit code: a failure that a retry cannot fix (bad config, corrupt artifact, non-finite run)
FAILURE_FILE = "failure.json"  # beside the spec: the child's error, and whether a retry could help
CHILD_ENV = {"PYTHONUNBUFFERED": "1"}  # the child's output streams through the parent as it comes


class StageFailed(RuntimeError):
    """The stage's child process failed; the message starts with its own error.

    `permanent` is True when a retry cannot succeed (the flows' Prefect retries skip it too).
    """

    def __init__(self, message: str, permanent: bool = False):
        super().__init__(message)
        self.permanent = permanent


class StageInterrupted(StageFailed):
    """The stage's child ended on SIGINT or SIGTERM (Ctrl-C, `kill`, a cancellation): never retried."""

    def __init__(self, message: str):
        super().__init__(message, permanent=True)


INTERRUPT_CODES = {130, 143, -2, -15}  # exit 128 + SIGINT / SIGTERM, or killed by either


def is_permanent(exc: BaseException) -> bool:
    """Whether rerunning cannot fix `exc`: the same input fails the same way.

    Errors of bad input, configuration, corrupt or foreign artifacts and checkpoints, and runs that
    went non-finite say so with a `permanent = True` class attribute; built-in ValueError, LookupError
    (an unknown key or name), TypeError and AttributeError are bugs or bad input too, and so is a storage
    fault (`storage_fault`: no space, quota, read-only, permission, not a directory), which the same write
    hits again. Any other OSError, MemoryError, a kill, or a framework RuntimeError may be transient and
    is retried."""
    flag = getattr(exc, "permanent", None)
    if flag is not None:
        return bool(flag)
    if storage_fault(exc) is not None:
        return True
    return isinstance(exc, (ValueError, LookupError, TypeError, AttributeError, NotImplementedError))


def storage_fault(exc: BaseException, where: str | os.PathLike | None = None) -> ArtifactError | None:
    """The one-line storage error (tasks/store/errors.py `storage_error`) of an OSError whose errno is a
    storage fault (STORAGE_ERRNOS), or of a library's error that wraps one as Rust does ("… (os error 28)");
    named by the error's own file name, else `where`. None for anything else."""
    os_exc = as_os_error(exc)
    if os_exc is None or os_exc.errno not in STORAGE_ERRNOS:
        return None
    return storage_error(os_exc, os_exc.filename or where or Path.cwd())


def entry_point(entry: str):
    """`package.module:function` → the function (ValueError for any other shape)."""
    module, sep, name = entry.partition(":")
    if not sep or not module.startswith("tasks.") or not name.isidentifier():
        raise ValueError(f"--entry {entry!r}: expected tasks.<module>:<function>")
    return getattr(importlib.import_module(module), name)


def entry_name(fn) -> str:
    """The dotted name `entry_point` resolves back to `fn` (a module-level function)."""
    return f"{fn.__module__}:{fn.__qualname__}"


def run_child(stage: str, entry: str, spec_path: Path) -> str | None:
    """Run `python -m tasks.runtime.child --stage STAGE --entry ENTRY --child spec`, relaying its output as it comes
    (progress bars included).

    Returns None on success, else the child's own error line on top of its last log lines.
    """
    env = {**CHILD_ENV, **os.environ, "GLOG_v": os.environ.get("GLOG_v", "3"), **held_locks_env()}
    module = f"the {stage} child"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.runtime.child", "--stage", stage, "--entry", entry, "--child", str(spec_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    assert proc.stdout is not None
    tail, pending = b"", b""
    out = sys.stderr.buffer
    try:
        while chunk := proc.stdout.read1(65536):
            tail = (tail + chunk)[-20000:]
            # relay whole lines, minus the child's own `error:` line: the caller reports it, once
            *lines, pending = (pending + chunk).split(b"\n")
            out.write(b"".join(ln + b"\n" for ln in lines if not ln.startswith(b"error: ")))
            if b"\r" in pending:  # a progress bar redraws without a newline: show it as it comes
                done, _, pending = pending.rpartition(b"\r")
                out.write(done + b"\r")
            out.flush()
    except BaseException:  # Ctrl-C or SIGTERM here (sigterm_interrupts), a cancellation: the child goes too
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        raise
    if pending and not pending.startswith(b"error: "):
        out.write(pending)
        out.flush()
    rc = proc.wait()
    if rc == 0:
        return None
    if rc in INTERRUPT_CODES:  # Ctrl-C or SIGTERM reached the child: no retry, and no "out of memory?"
        how = {130: "SIGINT", -2: "SIGINT"}.get(rc, "SIGTERM")
        raise StageInterrupted(f"{module} was interrupted ({how}); its checkpoints are kept: rerun to resume")
    lines = [ln.rsplit("\r", 1)[-1] for ln in tail.decode("utf-8", "replace").splitlines()]
    lines = [ln for ln in lines if ln.strip()][-40:]
    errors = [ln for ln in lines if ln.startswith("error:")]
    if errors and rc in (1, PERMANENT):  # the child reported its own error (its log was already shown live)
        return errors[-1].removeprefix("error: ")
    head = f"{module} exited with code {rc}"
    if rc == STOPPED_EARLY:
        head = f"{module} stopped before the end (stop_after)"
    elif rc < 0 or rc == 137:
        head = f"{module} was killed (signal {-rc if rc < 0 else 9}; out of memory?)"
    return head + "\n--- last lines of the child's log ---\n" + "\n".join(lines)


def _read_failure(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / FAILURE_FILE).read_text())
    except (OSError, ValueError):
        return {}


def supervise(
    stage: str,
    store: ArtifactStore,
    key: str,
    spec: dict[str, Any],
    child_fn: Callable[[dict[str, Any]], Path | None],
    *,
    retries: int = 0,
    isolate: bool = True,
    inject: dict | None = None,
    parallel=None,
) -> Path:
    """Run `child_fn(spec)` in `python -m tasks.runtime.child --stage STAGE` (or in-process), retrying failures.

    The child finds `child_fn` again by its dotted name (`entry_name`), so `child_fn` must be a
    module-level function (the stage table's `Stage.entry`).

    With `parallel` (a config ParallelSection) of device_num > 1 the child is `device_num`
    ranks started by msrun (tasks/runtime/distributed.py); its logs go to runs/<stage>/<key>/msrun_logs.
    `inject` (tests only) is merged into the first attempt's spec: {"stop_after": k} stops it
    after k steps as if killed, {"fault_steps": [...]} makes those steps non-finite.
    """
    distributed = parallel is not None and parallel.device_num > 1
    if distributed and not isolate:
        raise ValueError(
            f"{stage}: parallel.device_num={parallel.device_num} runs ranks under msrun; "
            "it cannot run in-process (isolate=False)"
        )
    # One build per key: a second identical run waits here for the first, then returns what it published
    # (never two children training in one run directory). The child inherits the lock (held_locks_env).
    # Nodes other than 0 of a multi-node run take no lock: their ranks are part of node 0's build.
    follower = distributed and parallel.node_rank > 0
    with contextlib.nullcontext() if follower else store.lock(stage, key):
        hit = store.lookup(stage, key)
        if hit is not None:
            print(f"[{stage}] {hit} is published (built by another process meanwhile); using it", file=sys.stderr)
            return hit
        return _supervise(
            stage,
            store,
            key,
            spec,
            child_fn,
            retries=retries,
            isolate=isolate,
            inject=inject,
            parallel=parallel,
            distributed=distributed,
        )


def _supervise(
    stage: str,
    store: ArtifactStore,
    key: str,
    spec: dict[str, Any],
    child_fn: Callable[[dict[str, Any]], Path | None],
    *,
    retries: int,
    isolate: bool,
    inject: dict | None,
    parallel,
    distributed: bool,
) -> Path:
    if not isolate:
        out = child_fn({**spec, **(inject or {})})
        if out is None:
            raise StageFailed(f"{stage} stopped before max_steps (stop_after)")
        return out
    run_dir = store.root / "runs" / stage / key
    run_dir.mkdir(parents=True, exist_ok=True)
    err = None
    for attempt in range(retries + 1):
        (run_dir / FAILURE_FILE).unlink(missing_ok=True)
        atomic_write_json(run_dir / "spec.json", {**spec, **((inject or {}) if attempt == 0 else {})})
        if distributed:
            err = launch(stage, entry_name(child_fn), run_dir / "spec.json", parallel, run_dir / "msrun_logs")
            if isinstance(err, NodeLost):  # the lost node's command is gone: a retry here would only wait for it
                raise StageFailed(err)
        else:
            err = run_child(stage, entry_name(child_fn), run_dir / "spec.json")
        hit = store.lookup(stage, key)
        if err is None and hit is not None:
            return hit
        failure = _read_failure(run_dir)
        if failure.get("permanent"):
            raise StageFailed(err or failure.get("error", f"{stage} failed"), permanent=True)
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
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    except Exception as exc:  # one line for the user, whatever it is; a traceback only for unexpected kinds
        exc = storage_fault(exc, spec.get("root") if isinstance(spec, dict) else None) or exc
        permanent = is_permanent(exc)
        known = permanent or isinstance(exc, (RuntimeError, OSError))
        if not known:
            traceback.print_exc(file=sys.stderr)
        text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)  # KeyError's str is a repr
        msg = text if known else f"{type(exc).__name__}: {text}"
        print(f"error: {msg}", file=sys.stderr, flush=True)
        try:
            atomic_write_json(
                Path(args.child).parent / FAILURE_FILE,
                {"error": msg, "type": type(exc).__name__, "permanent": permanent},
            )
        except OSError:
            pass
        return PERMANENT if permanent else 1
    if path is None:
        print(STOPPED_MARK, file=sys.stderr, flush=True)
        return STOPPED_EARLY
    print(path)
    return 0
