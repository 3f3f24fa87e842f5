"""Ctrl-C and SIGTERM that stop everything a command started, and say so:

    sigterm_interrupts()            # msllm's main: SIGTERM raises KeyboardInterrupt as Ctrl-C does (cleanup runs)
    stop_descendants(grace=5.0)     # terminate every process this one started (and theirs), kill those left
    exit_on_interrupt("demo")       # scripts/demo.py: on Ctrl-C / SIGTERM stop the descendants, exit 130 at once

A stage's training child is killed or interrupted with its command: its checkpoints and published artifacts are
written to a temporary path and renamed (tasks/store/disk.py), so nothing half-written stays, and the next run of
the same key resumes from the newest checkpoint. A child that ends on SIGINT or SIGTERM is `StageInterrupted`
(tasks/runtime/supervise.py): permanent, so neither the supervisor nor Prefect retries it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

INTERRUPTED = 130  # 128 + SIGINT: a shell's status for a command stopped by Ctrl-C


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def sigterm_interrupts() -> None:
    """SIGTERM in this process raises KeyboardInterrupt in its main thread, as Ctrl-C does, so `finally` blocks and
    `run_child`'s cleanup run (Python's default is to die at once, leaving a training child running). Only from
    the main thread (signal handlers live there); a no-op elsewhere."""
    with contextlib.suppress(ValueError):
        signal.signal(signal.SIGTERM, _raise_interrupt)


def stop_descendants(grace: float = 5.0, before: set[int] | None = None) -> int:
    """SIGTERM to every process this one started and theirs (training children, msrun and its ranks, a data pool,
    Prefect's temporary server), then SIGKILL to those still alive after `grace` s. With `before` (this process's
    children's pids at some earlier point), only the children started since then, and theirs. Returns how many."""
    import psutil  # lazy: `msllm --help` loads no heavy package (tests/test_imports.py)

    kids = []
    try:
        for c in psutil.Process().children():
            if before is None or c.pid not in before:
                with contextlib.suppress(psutil.Error):
                    kids += [c, *c.children(recursive=True)]
    except psutil.Error:
        return 0
    for k in kids:
        with contextlib.suppress(psutil.Error):
            k.terminate()
    _, alive = psutil.wait_procs(kids, timeout=grace)
    for k in alive:
        with contextlib.suppress(psutil.Error):
            k.kill()
    psutil.wait_procs(alive, timeout=grace)
    return len(kids)


def exit_on_interrupt(what: str) -> None:
    """On Ctrl-C or SIGTERM: stop every descendant, say `what` was interrupted and how to go on, and leave at once
    (exit 130). For a script that runs a flow on Prefect's temporary server (scripts/demo.py): that server gets the
    same Ctrl-C, and a flow engine left waiting for it would hang instead of ending."""

    def handler(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C while stopping changes nothing
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print(
            f"\ninterrupted ({signal.Signals(signum).name}): stopping {what}'s processes; "
            "published artifacts and checkpoints are kept, the next run resumes",
            file=sys.stderr,
            flush=True,
        )
        n = stop_descendants()
        print(f"interrupted: {n} child process(es) stopped", file=sys.stderr, flush=True)
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)
