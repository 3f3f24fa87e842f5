"""The store's one error (ArtifactError), and one clear line for a storage fault while writing under the
artifact root (no space, quota, read-only, permission): which path, what is wrong, the space needed when
known, and the fix. Both are permanent: rerunning the same stage cannot repair them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from pathlib import Path


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, corrupt or outside the artifact root."""

    permanent = True  # rerunning the stage that reads it cannot repair it (tasks/runtime/supervise.is_permanent)


STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
)
"""OSErrors of the storage itself: the same write fails again on retry until someone frees space, fixes access
or names a directory."""


_RUST_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how Rust's std::io::Error ends its text: "(os error 28)"


def as_os_error(exc: BaseException, path: str | os.PathLike | None = None) -> OSError | None:
    """`exc` when it is an OSError; an OSError (named `path`) for a library error that wraps one as Rust's
    std::io::Error reads ("… No space left on device (os error 28)": safetensors' SafetensorError, which
    is neither an OSError nor names the file); else None."""
    if isinstance(exc, OSError):
        return exc
    m = _RUST_OS_ERROR.search(str(exc))
    if m is None:
        return None
    code = int(m.group(1))
    return OSError(code, os.strerror(code), None if path is None else str(path))


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def tree_size(path: Path) -> int:
    """Bytes written so far under a build directory (what a retry will need at least)."""
    total = 0
    with contextlib.suppress(OSError):
        for q in path.rglob("*"):
            with contextlib.suppress(OSError):
                if q.is_file():
                    total += q.stat().st_size
    return total


def storage_error(exc: OSError, path: str | os.PathLike, need: int | None = None) -> ArtifactError:
    """One clear line for a storage fault while writing under the artifact root: which path, what is wrong,
    how much space is needed when known, and the fix. Permanent: retrying the same write cannot help."""
    p = Path(path)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        probe = next((q for q in (p, *p.parents) if q.exists()), Path("/"))
        try:
            free = f"{_size(shutil.disk_usage(probe).free)} free"
        except OSError:
            free = "free space unknown"
        needs = f", the build had written {_size(need)} and needs more" if need else ""
        what = "disk quota exceeded" if exc.errno == errno.EDQUOT else "no space left on the device"
        return ArtifactError(
            f"{p}: {what} ({free}{needs}); nothing was published: free space there or pass "
            "--artifacts DIR on a disk with room"
        )
    if exc.errno == errno.ENOTDIR:
        probe = next((q for q in (p, *p.parents) if q.exists()), None)
        where = f"{probe} is not a directory" if probe is not None and not probe.is_dir() else "not a directory"
        return ArtifactError(
            f"{p}: cannot write ({where}); nothing was published: the artifact root must be a "
            "directory: pass --artifacts DIR naming a directory (created if missing)"
        )
    if exc.errno == errno.EFBIG:
        return ArtifactError(
            f"{p}: cannot write (file too large for this file system or the process's file size "
            "limit, ulimit -f); nothing was published: raise the limit or pass --artifacts DIR on "
            "another file system"
        )
    what = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
    return ArtifactError(
        f"{p}: cannot write ({what}); nothing was published: the artifact root must be writable: "
        "fix its permissions or pass --artifacts DIR on a writable disk"
    )
