"""Artifact store: content keys, atomic builds, races between real processes, paths kept inside the root."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from tasks.store.artifacts import ArtifactError, ArtifactStore, raw_file_input, sha256_file


def test_key_depends_on_content_not_path(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("same bytes")
    b.write_text("same bytes")
    k = ArtifactStore.key
    ka = k("data", {"x": 1}, [raw_file_input(a)], "v1")
    assert ka == k("data", {"x": 1}, [raw_file_input(b)], "v1")  # other path, same bytes
    b.write_text("other bytes")
    assert ka != k("data", {"x": 1}, [raw_file_input(b)], "v1")  # same path, other bytes
    assert ka != k("data", {"x": 2}, [raw_file_input(a)], "v1")  # config
    assert ka != k("data", {"x": 1}, [raw_file_input(a)], "v2")  # code version
    assert ka != k("eval", {"x": 1}, [raw_file_input(a)], "v1")  # stage


def test_build_writes_manifest_and_lookup(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    key = store.key("data", {}, [], "v")
    assert store.lookup("data", key) is None
    with store.build("data", key, pipeline="p", config={"a": 1}, inputs=[], code="v") as b:
        (b.dir / "x.bin").write_bytes(b"hello")
        b.metrics["n"] = 3
    path = store.lookup("data", key)
    assert path == b.path and path.is_dir()
    m = store.verify(path)
    assert m["stage"] == "data" and m["key"] == key and m["metrics"] == {"n": 3} and m["pipeline"] == "p"
    assert m["files"] == [{"path": "x.bin", "size": 5, "sha256": sha256_file(path / "x.bin")}]
    assert "mindspore" in m["environment"] and m["code"]["stage_version"] == "v"
    assert store.newest("data", "p") == path and store.newest("data", "other") is None
    # corruption is detected and named
    (path / "x.bin").write_bytes(b"HELLO")
    with pytest.raises(ArtifactError, match="x.bin: sha256 differs"):
        store.verify(path)


def test_failed_build_leaves_nothing(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    key = store.key("data", {}, [], "v")
    with pytest.raises(RuntimeError):
        with store.build("data", key, pipeline="p", config={}, inputs=[], code="v") as b:
            (b.dir / "half.bin").write_bytes(b"partial")
            raise RuntimeError("stage crashed")
    assert store.lookup("data", key) is None
    assert list((tmp_path / "art" / "data").iterdir()) == []


def test_directory_without_complete_manifest_is_ignored(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    key = "ab" * 10
    d = tmp_path / "art" / "data" / key
    d.mkdir(parents=True)
    assert store.lookup("data", key) is None
    (d / "manifest.json").write_text(json.dumps({"stage": "data"}))  # no complete flag
    assert store.lookup("data", key) is None
    assert store.list("data") == []


def test_paths_stay_inside_root(tmp_path):
    store = ArtifactStore(tmp_path / "art")
    with pytest.raises(ArtifactError, match="outside the artifact root"):
        store.inside(tmp_path / "art" / ".." / "elsewhere")
    with pytest.raises(ArtifactError):
        store.path_for("data", "../../etc")
    with pytest.raises(ArtifactError):
        store.path_for("../x", "abcd")


def _racer(root: str, key: str, tag: str, barrier) -> None:
    store = ArtifactStore(root)
    with store.build("data", key, pipeline="p", config={}, inputs=[], code="v") as b:
        (b.dir / "who.txt").write_text(tag)
        barrier.wait(timeout=60)  # both builds are in flight before either renames


def test_two_processes_racing_leave_one_complete_artifact(tmp_path):
    root = str(tmp_path / "art")
    key = ArtifactStore.key("data", {}, [], "race")
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_racer, args=(root, key, tag, barrier)) for tag in ("A", "B")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    store = ArtifactStore(root)
    path = store.lookup("data", key)
    assert path is not None
    store.verify(path)
    assert (path / "who.txt").read_text() in ("A", "B")
    # nothing else is left behind: one artifact, no temp dirs
    assert [p.name for p in Path(root, "data").iterdir()] == [key]
