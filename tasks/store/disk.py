"""Bytes on disk, as the store and every writer under the artifact root need them: the sha256 of a file,
canonical JSON (what keys and digests hash), fsync of a directory, and atomic writes (temp file beside the
target, fsync, rename: a reader sees the old file or the new one, never half of one).

    sha256_file(path)                 # hex digest, read in 1 MiB blocks
    atomic_write_json(path, obj)      # indented JSON, written atomically
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def fsync_dir(path: Path) -> None:
    """fsync a directory (its entries: a rename into it is durable); a no-op where the OS refuses."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write to a temp file beside `path`, fsync, rename: readers see the old file or the new one."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(p.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())
