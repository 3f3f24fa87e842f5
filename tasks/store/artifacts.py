"""The artifact store: `<root>/<stage>/<key>/` directories, each with a `manifest.json`.

A stage asks the store for its content key, looks it up, and otherwise builds
the artifact in a temporary directory beside the final one:

    store = ArtifactStore("artifacts")
    key = store.key("data", cfg.section("data"), inputs=[raw_file_input(p) for p in files],
    code=tasks.stages.code_version("data"))
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
store object removes those whose process is gone (`clean_stale`).

The store's parts, each in its own module (import a name from the module that defines it):

| module | concern |
|---|---|
| `tasks/store/disk.py` | sha256 of a file, canonical JSON, fsync, atomic writes |
| `tasks/store/errors.py` | ArtifactError, and one clear line for a storage fault (no space, read-only, ...) |
| `tasks/store/published.py` | reading a manifest, verify-on-load (`verify_published`), rebuild hints |
| `tasks/store/locks.py` | one builder per key (file locks inherited by children), dead builds' directories |
| here | keys, lookups, and the atomic build that writes the manifest |
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.metadata as _md
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.store.disk import atomic_write_json, canonical_json, fsync_dir, sha256_file
from tasks.store.errors import STORAGE_ERRNOS, ArtifactError, storage_error, tree_size
from tasks.store.locks import KEY_LEN, build_dir_name, build_lock, clean_stale
from tasks.store.published import MANIFEST, read_manifest, rebuild_hint, verify_published

__all__ = ["ArtifactStore", "Build", "SCHEMA_VERSION", "git_commit", "environment", "raw_file_input"]

SCHEMA_VERSION = 1
_REPO = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- what goes into a manifest


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


# ----------------------------------------------------------------------------- the store


@dataclass
class Build:
    """A build in progress: write payload files into `dir`, fill `metrics`."""

    dir: Path
    path: Path  # the final location (valid after the `with` block)
    metrics: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # extra manifest fields
    reused: bool = False  # True when another process finished the same key first


class ArtifactStore:
    def __init__(self, root: str | os.PathLike = "artifacts"):
        self.root = Path(root).resolve()
        self._cleaned = False  # leftovers of dead builds are removed on this store's first build
        self._replaces: dict[tuple[str, str], dict[str, Any]] = {}  # (stage, key) being rebuilt: what it replaces

    # -- a forced rerun
    @contextlib.contextmanager
    def replacing(self, stage: str, key: str) -> Iterator[Path | None]:
        """Rebuild (stage, key) although it is published (a forced rerun: `refresh`): the published artifact moves to
        <stage>/.replaced/<key>-<its created time> (kept, out of `lookup` and `list`), and the manifest the block's
        `build` publishes records it under "replaces" (path, created, digest): lineage keeps the previous result.
        Yields the moved path (None when nothing was published). When the block fails before publishing, the
        previous artifact moves back. Under the key's build lock for the move; the stage's `build` takes it again."""
        final = self.path_for(stage, key)
        with self.lock(stage, key):
            old = self.lookup(stage, key)
            moved = None
            if old is not None:
                m = self.read_manifest(old)
                stamp = "".join(c for c in str(m.get("created", "")) if c.isdigit()) or "0"
                moved = final.parent / ".replaced" / f"{key}-{stamp}"
                moved.parent.mkdir(parents=True, exist_ok=True)
                os.rename(old, moved)
                fsync_dir(final.parent)
                self._replaces[(stage, key)] = {
                    "path": str(moved),
                    "created": m.get("created"),
                    "digest": m.get("digest"),
                }
        try:
            yield moved
        except BaseException:
            if moved is not None:
                with self.lock(stage, key):
                    if self.lookup(stage, key) is None and moved.is_dir():
                        os.rename(moved, final)
            raise
        finally:
            self._replaces.pop((stage, key), None)

    # -- one build per key
    def lock(self, stage: str, key: str):
        """Hold the build lock of (stage, key) (tasks/store/locks.py `build_lock`): one builder per key."""
        self.path_for(stage, key)  # a valid address
        return build_lock(self.root, stage, key)

    @contextlib.contextmanager
    def claim(self, stage: str, key: str) -> Iterator[Path | None]:
        """Hold the build lock of (stage, key) around a stage's whole computation, after its lookup missed:
        yields the artifact when another process published it while this one waited (saying so on stderr:
        use it, compute nothing), else None (compute and `build` inside the block, under the lock).

            hit = store.lookup(stage, key)
            if hit is None:
                with store.claim(stage, key) as hit:
                    if hit is None:
                        hit = compute_and_build(...)
        """
        with self.lock(stage, key):
            hit = self.lookup(stage, key)
            if hit is not None:
                print(
                    f"[{stage}] {hit} is published (built by another process meanwhile); using it",
                    file=sys.stderr,
                    flush=True,
                )
            yield hit

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
    read_manifest = staticmethod(read_manifest)

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
        hits = (
            [q for s in self.root.iterdir() if s.is_dir() for q in s.iterdir() if q.name.startswith(ref)]
            if self.root.is_dir()
            else []
        )
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
        return {
            "kind": "artifact",
            "stage": m["stage"],
            "key": m["key"],
            "digest": m["digest"],
            "path": str(Path(path).resolve()),
        }

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
                if n := clean_stale(self.root):
                    print(
                        f"[artifacts] removed {n} build dir(s) left under {self.root} by killed builds", file=sys.stderr
                    )
            tmp = final.parent / build_dir_name(key)
            b = Build(dir=tmp, path=final)
            try:
                try:
                    final.parent.mkdir(parents=True, exist_ok=True)
                    tmp.mkdir()
                    yield b
                    self._publish(b, stage, key, pipeline=pipeline, config=config, inputs=inputs, code=code)
                except OSError as exc:
                    if exc.errno in STORAGE_ERRNOS:  # one line naming the path, never a half-published artifact
                        raise storage_error(exc, exc.filename or tmp, need=tree_size(tmp)) from None
                    raise
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)

    def _publish(
        self,
        b: Build,
        stage: str,
        key: str,
        *,
        pipeline: str | None,
        config: Any,
        inputs: list[dict[str, Any]],
        code: str,
    ) -> None:
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
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="microseconds"),
            "config": config,
            "inputs": inputs,
            "code": {"stage_version": code, "git_commit": git_commit()},
            "environment": environment(),
            "metrics": b.metrics,
            **b.extra,
            **({"replaces": self._replaces[(stage, key)]} if (stage, key) in self._replaces else {}),
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
        """Remove the build directories of dead builds under the root (tasks/store/locks.py); returns how many."""
        return clean_stale(self.root)
