"""Builders running at once: one builder per artifact key (an OS file lock), and the build directories
that killed builders leave behind.

    with build_lock(root, "pretrain", key): ...     # one builder per key, across processes and threads
    env = held_locks_env()                          # hand this thread's locks to a child it waits for
    tmp = root / stage / build_dir_name(key)        # `.tmp-<key>-<pid>-<random>@<host>`
    clean_stale(root)                               # remove those of dead processes on this host

A process killed mid-build (kill -9, OOM, power loss) leaves its build directory behind; `clean_stale`
removes those whose process is gone: same host, and the pid no longer running or now a different process
(started after the directory was last written). Live builds, other hosts' builds and anything not named
like a build directory are left alone.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import re
import shutil
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from tasks.store.errors import storage_error

KEY_LEN = 20  # hex digits of an artifact key (ArtifactStore.key)

LOCK_DIR = ".locks"
LOCKS_ENV = "MSLLM_STORE_LOCKS"
"""`stage/key,...`: build locks a parent process holds for this one (a stage's supervised child, msrun ranks)."""
_INHERITED_LOCKS = frozenset(t for t in os.environ.get(LOCKS_ENV, "").split(",") if t)
_THREAD = threading.local()  # .held: the stage/key locks this thread holds


def _held() -> set[str]:
    if not hasattr(_THREAD, "held"):
        _THREAD.held = set()
    return _THREAD.held


def held_locks_env() -> dict[str, str]:
    """The environment entry that hands this thread's build locks to a child process it starts and waits for."""
    tokens = sorted(_INHERITED_LOCKS | _held())
    return {LOCKS_ENV: ",".join(tokens)} if tokens else {}


@contextlib.contextmanager
def build_lock(root: Path, stage: str, key: str) -> Iterator[None]:
    """Hold the build lock of (stage, key): one builder per key across processes, threads and hosts that
    share a file system with working flock.

    An OS file lock (fcntl.flock on `<root>/.locks/<stage>.<key>.lock`): the kernel drops it when its holder
    dies (kill -9 included), so a crashed build never blocks the next one. A second identical run waits
    here (saying so on stderr), then finds the artifact the first one published. Re-entrant in one
    thread; a child process the holder starts and waits for (the supervised stage child, msrun ranks)
    inherits it through MSLLM_STORE_LOCKS (`held_locks_env`). Lock files are left in place (removing one
    would race with a process about to lock it).
    """
    token = f"{stage}/{key}"
    if token in _INHERITED_LOCKS or token in _held():
        yield
        return
    path = root / LOCK_DIR / f"{stage}.{key}.lock"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise storage_error(exc, path) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "?"
            print(
                f"[artifacts] {stage}/{key} is being built by another process ({holder}); waiting for it",
                file=sys.stderr,
                flush=True,
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
        _held().add(token)
        try:
            yield
        finally:
            _held().discard(token)
    finally:
        os.close(fd)  # releases the lock


# Build dirs: `.tmp-<key>-<pid>-<8 hex>@<host tag>` (without the tag: written before the tag existed).
_TMP_BUILD = re.compile(rf"^\.tmp-[0-9a-f]{{{KEY_LEN}}}-(?P<pid>[0-9]+)-[0-9a-f]{{8}}(?:@(?P<host>[0-9a-f]{{8}}))?$")
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def build_dir_name(key: str) -> str:
    """The name of a build directory of `key` for this process: what `clean_stale` recognises."""
    return f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}@{HOST}"


def clean_stale(root: Path) -> int:
    """Remove the `.tmp-*` build directories of dead builds under `root` (see the module doc); returns how many."""
    n = 0
    if not root.is_dir():
        return 0
    for stage_dir in root.iterdir():
        if not stage_dir.is_dir():
            continue
        for t in stage_dir.glob(".tmp-*"):
            m = _TMP_BUILD.match(t.name)
            if m is None or (m["host"] or HOST) != HOST:
                continue  # not a store build dir (e.g. `.tmp-step_*` checkpoints), or another host's
            try:
                written = t.stat().st_mtime
            except OSError:
                continue
            if pid_alive(int(m["pid"])) and not _started_after(int(m["pid"]), written):
                continue
            shutil.rmtree(t, ignore_errors=True)
            n += not t.exists()
    return n


def _started_after(pid: int, t: float, slack: float = 2.0) -> bool:
    """True when process `pid` started after time `t` (so it cannot be what wrote something at `t`)."""
    import psutil  # lazy: ~20 ms; the CLI imports this module

    try:
        return psutil.Process(pid).create_time() > t + slack
    except (psutil.Error, OSError):
        return False


def pid_alive(pid: int) -> bool:
    """Whether a process with this id exists (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
