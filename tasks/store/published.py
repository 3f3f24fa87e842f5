"""A published artifact on disk: its `manifest.json`, and verify-on-load (every reader checks each file it loads
against the sha256 the manifest records, so what is loaded is what was published).

    m = read_manifest(artifact_dir)            # ArtifactError when missing, corrupt or incomplete
    verify_published(artifact_dir / "model.safetensors")   # the path, or ArtifactError naming the fix

ArtifactStore (tasks/store/artifacts.py) writes the manifests; this module only reads them.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tasks.store.disk import sha256_file
from tasks.store.errors import ArtifactError

MANIFEST = "manifest.json"


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the artifact directory `path`; ArtifactError when it is missing, corrupt or incomplete."""
    m = Path(path) / MANIFEST
    try:
        data = json.loads(m.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ArtifactError(f"{path}: no {MANIFEST}; not a complete artifact (rerun the stage)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{m}: corrupt manifest ({exc}); delete the directory and rerun the stage") from None
    if not isinstance(data, dict) or data.get("complete") is not True or "digest" not in data:
        raise ArtifactError(f"{m}: incomplete manifest; delete the directory and rerun the stage")
    if problem := _files_problem(data.get("files")):
        raise ArtifactError(f"{m}: corrupt manifest ({problem}); delete the directory and rerun the stage")
    return data


def _files_problem(files) -> str | None:
    """Why a manifest's `files` is not a list of {path: a relative path inside the artifact, size, sha256}, or None
    (a crafted one could name files outside the artifact, or lack the keys every reader indexes)."""
    if not isinstance(files, list):
        return "'files' is not a list"
    for i, f in enumerate(files):
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not isinstance(f.get("sha256"), str):
            return f"files[{i}] has no path and sha256"
        if isinstance(f.get("size"), bool) or not isinstance(f.get("size"), int):
            return f"files[{i}] has no size"
        rel = Path(f["path"])
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            return f"files[{i}].path {f['path']!r} is not a path inside the artifact"
    return None


# The msllm command that builds each artifact kind, for "rebuild it" hints. It is the stage table's `command`
# (tasks/stages/__init__.py), which the store may not import (the stage table imports the store);
# tests/test_artifacts.py keeps the two equal.
REBUILD_COMMANDS = {
    "data": "data",
    "pretrain": "train",
    "finetune": "finetune",
    "merged": "finetune",
    "eval": "eval",
    "export": "export",
    "convert": "convert --from-hf DIR",
}
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
        print(
            f"[artifacts] warning: {fp.parent} has no {MANIFEST}: not a published artifact, {fp.name} is not checked",
            file=sys.stderr,
        )
        return fp
    manifest = read_manifest(art)
    rel = Path(key).relative_to(art).as_posix()
    entry = next((f for f in manifest.get("files", []) if f.get("path") == rel), None)
    if entry is None:
        raise ArtifactError(
            f"{fp}: not listed in {art / MANIFEST}, so it was not published with the artifact; "
            f"{rebuild_hint(manifest, art)}"
        )
    actual = sha256_file(fp)
    if actual != entry.get("sha256"):
        size = "" if st.st_size == entry.get("size") else f" (size {st.st_size} bytes, published {entry.get('size')})"
        raise ArtifactError(
            f"{fp}: sha256 differs from the manifest: {art / MANIFEST} records {entry.get('sha256')}, "
            f"the file has {actual}{size}; it changed after it was published (corrupt or edited): "
            f"{rebuild_hint(manifest, art)}"
        )
    _VERIFIED[key] = _file_stamp(st)
    return fp
