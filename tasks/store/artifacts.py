"""The artifact store: `<root>/<stage>/<key>/` directories, each with a `manifest.json`.

A stage asks the store for its content key, looks it up, and otherwise builds
the artifact in a temporary directory beside the final one:

    store = ArtifactStore("artifacts")
    key = store.key("data", cfg.section("data"), inputs=[raw_file_input(p) for p in files], code=tasks.stages.code_version("data"))
    hit = store.lookup("data", key)
    if hit is None:
        with store.build("data", key, pipeline="demo", config=..., inputs=...) as b:
            (b.dir / "tokenizer.model").write_bytes(...)
            b.metrics["documents"] = 123
        hit = b.path

The key hashes the stage, its resolved config section, its inputs' digests (raw
files by the sha256 of their bytes, never by path) and the stage's code
version. The build is atomic: files are fsynced, the manifest is written last,
and the directory is renamed into place; a directory without a complete
manifest is never returned. When two processes race on one key, the first
rename wins and the loser's copy is discarded. Nothing is read back with pickle.

A build directory is named `.tmp-<key>-<pid>-<random>@<host>`. A process killed
mid-build (kill -9, OOM, power loss) leaves it behind; the first build of each
store object removes those whose process is gone (`clean_stale`): same host,
and the pid no longer running or now a different process (started after the
directory was last written). Live builds, other hosts' builds and anything
not named like a build directory are left alone.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import fcntl
import hashlib
import importlib.metadata as _md
import json
import os
import platform
import re
import shutil
import socket
import sys
import subprocess
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

MANIFEST = "manifest.json"
SCHEMA_VERSION = 1
KEY_LEN = 20
_REPO = Path(__file__).resolve().parents[2]

class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete, corrupt or outside the artifact root."""

    permanent = True  # rerunning the stage that reads it cannot repair it (tasks/runtime/supervise.is_permanent)


# ----------------------------------------------------------------------------- hashing


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=False
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment() -> dict[str, str]:
    env = {"python": platform.python_version()}
    for dist in ("mindspore", "prefect", "numpy", "datasets", "sentencepiece", "lm_eval", "onnx", "onnxruntime"):
        try:
            env[dist] = _md.version(dist)
        except _md.PackageNotFoundError:
            pass
    try:
        env["package"] = _md.version("msllm")
    except _md.PackageNotFoundError:
        env["package"] = "unknown"
    return env


def raw_file_input(path: str | os.PathLike) -> dict[str, Any]:
    """An input that is a raw file: identified by its bytes (sha256), the path kept for review only."""
    p = Path(path)
    return {"kind": "file", "path": str(p.resolve()), "size": p.stat().st_size, "sha256": sha256_file(p)}


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


# ----------------------------------------------------------------------------- verify on load

# The msllm command that builds each artifact kind, for "rebuild it" hints. It is the stage table's `command`
# (tasks/stages/__init__.py), which the store may not import (the stage table imports the store);
# tests/test_artifacts.py keeps the two equal.
REBUILD_COMMANDS = {"data": "data", "pretrain": "train", "finetune": "finetune", "merged": "finetune",
                    "eval": "eval", "export": "export", "convert": "convert --from-hf DIR"}
_VERIFIED: dict[str, tuple] = {}  # resolved path -> stat stamp of a file whose sha256 matched its manifest


def _file_stamp(st: os.stat_result) -> tuple:
    # ctime too: any write changes it, and unlike mtime no user can set it back
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


def artifact_dir_of(path: str | os.PathLike, levels: int = 4) -> Path | None:
    """The published artifact directory holding `path` (the nearest parent with a manifest.json), or None."""
    p = Path(path).resolve()
    for d in [p, *p.parents][: levels + 1]:
        if d.is_dir() and (d / MANIFEST).is_file():
            return d
    return None


def rebuild_hint(manifest: dict[str, Any], artifact: Path) -> str:
    """What rebuilds an artifact: delete it, run the command that built it."""
    stage = manifest.get("stage", "?")
    cmd = REBUILD_COMMANDS.get(stage, stage)
    pipe = f" --pipeline {manifest['pipeline']}" if manifest.get("pipeline") and stage != "convert" else ""
    return f"rebuild it: delete {artifact} and run `msllm {cmd}{pipe}` (the {stage} stage)"


def verify_published(path: str | os.PathLike, *, force: bool = False) -> Path:
    """Check a file of a published artifact against the sha256 its manifest records, before anyone uses it.

    Every reader of a published artifact calls this for each file it loads (model weights, model.json,
    tokenizer, ONNX, shards), so what is loaded is what was published. Policy: a full sha256 of the file,
    once per process for an unchanged file (the stat stamp, ctime included, is remembered after a match;
    any write to the file changes its ctime, so it is hashed again). A mismatch, a file missing from the
    manifest or a size change raises ArtifactError naming the file, the expected and the actual digest
    and the command that rebuilds the artifact. A file in a directory without a manifest.json is not a
    published artifact (a build in progress, a hand-made directory): it is returned unchecked, with one
    warning line on stderr for a directory that looks like an artifact (the caller decides whether to accept it).
    `force=True` hashes the file even when this process checked it before (`ArtifactStore.verify`). Returns the path.
    """
    fp = Path(path)
    try:
        st = fp.stat()
    except FileNotFoundError:
        raise ArtifactError(f"{fp}: missing; the artifact is incomplete: rebuild it") from None
    key = str(fp.resolve())
    if not force and _VERIFIED.get(key) == _file_stamp(st):
        return fp
    art = artifact_dir_of(fp)
    if art is None:
        print(f"[artifacts] warning: {fp.parent} has no {MANIFEST}: not a published artifact, {fp.name} is not "
              "checked", file=sys.stderr)
        return fp
    manifest = ArtifactStore.read_manifest(art)
    rel = Path(key).relative_to(art).as_posix()
    entry = next((f for f in manifest.get("files", []) if f.get("path") == rel), None)
    if entry is None:
        raise ArtifactError(f"{fp}: not listed in {art / MANIFEST}, so it was not published with the artifact; "
                            f"{rebuild_hint(manifest, art)}")
    actual = sha256_file(fp)
    if actual != entry.get("sha256"):
        size = "" if st.st_size == entry.get("size") else f" (size {st.st_size} bytes, published {entry.get('size')})"
        raise ArtifactError(f"{fp}: sha256 differs from the manifest: {art / MANIFEST} records {entry.get('sha256')}, "
                            f"the file has {actual}{size}; it changed after it was published (corrupt or edited): "
                            f"{rebuild_hint(manifest, art)}")
    _VERIFIED[key] = _file_stamp(st)
    return fp


# ----------------------------------------------------------------------------- storage faults

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM})
"""OSErrors of the storage itself: the same write fails again on retry until someone frees space or fixes access."""


def _size(n: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n} bytes"


def _tree_size(path: Path) -> int:
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
        return ArtifactError(f"{p}: {what} ({free}{needs}); nothing was published: free space there or pass "
                             "--artifacts DIR on a disk with room")
    what = "read-only file system" if exc.errno == errno.EROFS else "permission denied"
    return ArtifactError(f"{p}: cannot write ({what}); nothing was published: the artifact root must be writable: "
                         "fix its permissions or pass --artifacts DIR on a writable disk")


# ----------------------------------------------------------------------------- the store


@dataclass
class Build:
    """A build in progress: write payload files into `dir`, fill `metrics`."""

    dir: Path
    path: Path  # the final location (valid after the `with` block)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # extra manifest fields
    reused: bool = False  # True when another process finished the same key first


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


class ArtifactStore:
    def __init__(self, root: str | os.PathLike = "artifacts"):
        self.root = Path(root).resolve()
        self._cleaned = False  # leftovers of dead builds are removed on this store's first build

    # -- one build per key
    @contextlib.contextmanager
    def lock(self, stage: str, key: str) -> Iterator[None]:
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
        self.path_for(stage, key)  # a valid address
        path = self.root / LOCK_DIR / f"{stage}.{key}.lock"
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
                print(f"[artifacts] {stage}/{key} is being built by another process ({holder}); waiting for it",
                      file=sys.stderr, flush=True)
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

    # -- keys
    @staticmethod
    def key(stage: str, config: Any, inputs: list[dict[str, Any]], code: str) -> str:
        """Content key: stage + resolved config section + input digests + code version."""
        digests = sorted(
            (i.get("kind", ""), i.get("stage", ""), i.get("sha256") or i.get("digest") or "") for i in inputs
        )
        payload = canonical_json({"stage": stage, "config": config, "inputs": digests, "code": code})
        return hashlib.sha256(payload.encode()).hexdigest()[:KEY_LEN]

    # -- paths
    def inside(self, path: str | os.PathLike) -> Path:
        """Resolve `path` and refuse anything outside the artifact root."""
        p = Path(path)
        p = (p if p.is_absolute() else Path.cwd() / p).resolve()
        if p != self.root and self.root not in p.parents:
            raise ArtifactError(f"{path}: outside the artifact root {self.root}; artifacts must live under --artifacts")
        return p

    def path_for(self, stage: str, key: str) -> Path:
        if not stage.isidentifier() or not all(c in "0123456789abcdef" for c in key) or not key:
            raise ArtifactError(f"bad artifact address {stage}/{key}")
        return self.inside(self.root / stage / key)

    # -- reading
    @staticmethod
    def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
        m = Path(path) / MANIFEST
        try:
            data = json.loads(m.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ArtifactError(f"{path}: no {MANIFEST}; not a complete artifact (rerun the stage)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ArtifactError(f"{m}: corrupt manifest ({exc}); delete the directory and rerun the stage") from None
        if not isinstance(data, dict) or data.get("complete") is not True or "digest" not in data:
            raise ArtifactError(f"{m}: incomplete manifest; delete the directory and rerun the stage")
        return data

    def is_complete(self, path: Path) -> bool:
        try:
            self.read_manifest(path)
            return True
        except ArtifactError:
            return False

    def lookup(self, stage: str, key: str) -> Path | None:
        p = self.path_for(stage, key)
        return p if p.is_dir() and self.is_complete(p) else None

    def list(self, stage: str, pipeline: str | None = None) -> list[tuple[Path, dict[str, Any]]]:
        """Complete artifacts of a stage (optionally of one pipeline), oldest first."""
        d = self.root / stage
        out = []
        if d.is_dir():
            for p in d.iterdir():
                if p.name.startswith(".") or not p.is_dir():
                    continue
                try:
                    m = self.read_manifest(p)
                except ArtifactError:
                    continue
                if pipeline is None or m.get("pipeline") == pipeline:
                    out.append((p, m))
        out.sort(key=lambda pm: (pm[1].get("created", ""), pm[0].name))
        return out

    def newest(self, stage: str, pipeline: str | None = None) -> Path | None:
        items = self.list(stage, pipeline)
        return items[-1][0] if items else None

    def find(self, ref: str) -> Path:
        """An artifact by path, `stage/key`, or a (unique) key prefix."""
        p = Path(ref)
        if p.is_dir():
            p = self.inside(p)
            self.read_manifest(p)
            return p
        if "/" in ref.strip("/") and (self.root / ref).is_dir():
            return self.find(str(self.root / ref))
        hits = [q for s in self.root.iterdir() if s.is_dir() for q in s.iterdir() if q.name.startswith(ref)] if self.root.is_dir() else []
        hits = [h for h in hits if self.is_complete(h)]
        if len(hits) != 1:
            raise ArtifactError(f"{ref}: {'no' if not hits else 'several'} artifacts match under {self.root}")
        return hits[0]

    def verify(self, path: str | os.PathLike) -> dict[str, Any]:
        """Re-hash every file listed in the manifest; raise naming the first mismatch."""
        p = self.inside(path)
        m = self.read_manifest(p)
        for f in m["files"]:
            fp = p / f["path"]
            if not fp.is_file():
                raise ArtifactError(f"{fp}: listed in the manifest but missing; {rebuild_hint(m, p)}")
            verify_published(fp, force=True)
        return m

    @staticmethod
    def input_ref(path: str | os.PathLike) -> dict[str, Any]:
        """An input that is another artifact, identified by its digest."""
        m = ArtifactStore.read_manifest(path)
        return {"kind": "artifact", "stage": m["stage"], "key": m["key"], "digest": m["digest"], "path": str(Path(path).resolve())}

    # -- writing
    @contextlib.contextmanager
    def build(
        self,
        stage: str,
        key: str,
        *,
        pipeline: str | None,
        config: Any,
        inputs: list[dict[str, Any]],
        code: str,
    ) -> Iterator[Build]:
        final = self.path_for(stage, key)
        with self.lock(stage, key):  # one writer per key; re-entrant for a stage that already holds it
            if not self._cleaned:
                self._cleaned = True
                if n := self.clean_stale():
                    print(f"[artifacts] removed {n} build dir(s) left under {self.root} by killed builds", file=sys.stderr)
            tmp = final.parent / f".tmp-{key}-{os.getpid()}-{uuid.uuid4().hex[:8]}@{_HOST}"
            b = Build(dir=tmp, path=final)
            try:
                try:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    tmp.mkdir()
                    yield b
                    self._publish(b, stage, key, pipeline=pipeline, config=config, inputs=inputs, code=code)
                except OSError as exc:
                    if exc.errno in STORAGE_ERRNOS:  # one line naming the path, never a half-published artifact
                        raise storage_error(exc, exc.filename or tmp, need=_tree_size(tmp)) from None
                    raise
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)

    def _publish(self, b: Build, stage: str, key: str, *, pipeline: str | None, config: Any,
                 inputs: list[dict[str, Any]], code: str) -> None:
        """fsync the payload, write the manifest last, rename the build directory into place (the last step)."""
        tmp, final = b.dir, b.path
        files = []
        for fp in sorted(q for q in tmp.rglob("*") if q.is_file()):
            with open(fp, "rb") as f:
                os.fsync(f.fileno())
            rel = fp.relative_to(tmp).as_posix()
            if rel == MANIFEST:
                raise ArtifactError(f"stage {stage} wrote its own {MANIFEST}; the store writes it")
            files.append({"path": rel, "size": fp.stat().st_size, "sha256": sha256_file(fp)})
        digest = hashlib.sha256(canonical_json([(f["path"], f["sha256"]) for f in files]).encode()).hexdigest()
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "stage": stage,
            "key": key,
            "pipeline": pipeline,
            "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds"),
            "config": config,
            "inputs": inputs,
            "code": {"stage_version": code, "git_commit": git_commit()},
            "environment": environment(),
            "metrics": b.metrics,
            **b.extra,
            "files": files,
            "digest": digest,
            "complete": True,
        }
        atomic_write_json(tmp / MANIFEST, manifest)
        fsync_dir(tmp)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno in STORAGE_ERRNOS:
                raise
            # Another process completed the same key first: keep theirs when it is complete.
            if not self.is_complete(final):
                if final.exists():
                    shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
            else:
                b.reused = True
        fsync_dir(final.parent)

    def clean_stale(self) -> int:
        """Remove `.tmp-*` build directories of dead builds (see the module doc); returns how many."""
        n = 0
        if not self.root.is_dir():
            return 0
        for stage_dir in self.root.iterdir():
            if not stage_dir.is_dir():
                continue
            for t in stage_dir.glob(".tmp-*"):
                m = _TMP_BUILD.match(t.name)
                if m is None or (m["host"] or _HOST) != _HOST:
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


# Build dirs: `.tmp-<key>-<pid>-<8 hex>@<host tag>` (without the tag: written before the tag existed).
_TMP_BUILD = re.compile(rf"^\.tmp-[0-9a-f]{{{KEY_LEN}}}-(?P<pid>[0-9]+)-[0-9a-f]{{8}}(?:@(?P<host>[0-9a-f]{{8}}))?$")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _started_after(pid: int, t: float, slack: float = 2.0) -> bool:
    """True when process `pid` started after time `t` (so it cannot be what wrote something at `t`)."""
    import psutil

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
