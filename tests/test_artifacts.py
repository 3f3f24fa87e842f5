"""Artifact store: content keys, atomic builds, races between real processes, paths kept inside the root."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.store.disk import sha256_file
from tasks.store.errors import ArtifactError
from tests.helpers import convert_hf, run_stage


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
    import time

    store = ArtifactStore(root)
    barrier.wait(timeout=60)  # both start building at once
    with store.build("data", key, pipeline="p", config={}, inputs=[], code="v") as b:
        t0 = time.time()
        (b.dir / "who.txt").write_text(tag)
        time.sleep(0.5)
        with open(Path(root) / f"span-{tag}", "w") as f:
            f.write(f"{t0} {time.time()}")


def test_two_processes_racing_leave_one_complete_artifact(tmp_path):
    """Two builds of one key never write at once (the store's per-key lock): one complete artifact remains."""
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
    (a0, a1), (b0, b1) = (map(float, Path(root, f"span-{t}").read_text().split()) for t in "AB")
    assert a1 <= b0 or b1 <= a0, "two builds of one key wrote at the same time"
    # nothing else is left behind: one artifact, no temp dirs
    assert [p.name for p in Path(root, "data").iterdir()] == [key]


# ----------------------------------------------------------------------------- verify on load (issue 27)


def _published_model(root: Path) -> Path:
    """A model-shaped artifact published through the store (weights, model.json, tokenizer bytes): no MindSpore."""
    import numpy as np

    from tasks.store.tensors import save_tensors

    store = ArtifactStore(root)
    key = store.key("pretrain", {"t": 1}, [], "v")
    with store.build("pretrain", key, pipeline="tiny", config={}, inputs=[], code="v") as b:
        save_tensors(b.dir / "model.safetensors", {"w": np.arange(64, dtype=np.float32).reshape(8, 8)})
        (b.dir / "model.json").write_text(json.dumps({"name": "llama", "model": {}, "tokenizer": {}}))
        (b.dir / "tokenizer.model").write_bytes(b"not really sentencepiece")
    return b.path


def _flip_byte(f: Path, at: int = -5) -> None:
    raw = bytearray(f.read_bytes())
    raw[at] ^= 0x01
    f.write_bytes(bytes(raw))  # same size: only the checksum can tell


def test_rebuild_commands_are_the_stage_tables():
    from tasks.stages import STAGES
    from tasks.store.published import REBUILD_COMMANDS

    assert REBUILD_COMMANDS == {s.name: s.command for s in STAGES.values()}


def test_altered_weights_are_refused_on_load_naming_file_digests_and_command(tmp_path):
    from tasks.store.model_artifact import read_info
    from tasks.store.published import verify_published
    from tasks.store.tensors import load_weights

    art = _published_model(tmp_path / "art")
    assert load_weights(art)["w"].shape == (8, 8)  # published bytes load
    f = art / "model.safetensors"
    published = sha256_file(f)
    _flip_byte(f)  # after a successful load in this process: the remembered check must not hide the change
    with pytest.raises(ArtifactError) as ei:
        load_weights(art)
    msg = str(ei.value)
    assert f"{f}: sha256 differs from the manifest" in msg and published in msg and sha256_file(f) in msg, msg
    assert f"delete {art}" in msg and "`msllm train --pipeline tiny`" in msg, msg
    with pytest.raises(ArtifactError, match="model.safetensors: sha256 differs"):
        load_weights(f)  # the file itself, not only the directory
    (art / "model.json").write_text(json.dumps({"name": "llama", "model": {"num_layers": 99}}))
    with pytest.raises(ArtifactError, match="model.json: sha256 differs"):
        read_info(art)
    (art / "extra.bin").write_bytes(b"x")
    with pytest.raises(ArtifactError, match="extra.bin: not listed in"):
        verify_published(art / "extra.bin")


def test_read_tensors_reads_what_safetensors_wrote_and_refuses_a_bad_header(tmp_path):
    """Our reader (each tensor straight into its own array) gives the library's arrays for every dtype numpy has,
    shapes from scalar to empty; a header whose offsets run past the file, overlap, or disagree with the shape is
    one CheckpointError naming the file."""
    import json as _json
    import struct

    import numpy as np
    from safetensors.numpy import load_file, save_file

    from tasks.store.tensors import CheckpointError, read_tensors

    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.normal(size=(3, 5)).astype(np.float32),
        "f16": rng.normal(size=7).astype(np.float16),
        "f64": np.array(2.5, np.float64),
        "i64": np.arange(6, dtype=np.int64).reshape(2, 3),
        "u8": np.arange(4, dtype=np.uint8),
        "b": np.array([True, False]),
        "empty": np.zeros((0, 4), np.float32),
    }
    f = tmp_path / "t.safetensors"
    save_file(arrays, str(f), metadata={"k": "v"})
    got, lib = read_tensors(f, "x"), load_file(str(f))
    assert got.keys() == lib.keys() == arrays.keys()
    for k in arrays:
        assert got[k].dtype == lib[k].dtype and got[k].shape == lib[k].shape and np.array_equal(got[k], lib[k])

    def with_header(name, edit):
        raw = f.read_bytes()
        n = struct.unpack("<Q", raw[:8])[0]
        header = _json.loads(raw[8 : 8 + n])
        edit(header)
        h = _json.dumps(header).encode()
        bad = tmp_path / name
        bad.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])
        return bad

    def past_end(h):
        h["f32"]["data_offsets"][1] += 10**6

    def overlap(h):
        h["f16"]["data_offsets"] = list(h["f32"]["data_offsets"])
        h["f16"]["shape"] = [30]

    def shape(h):
        h["f32"]["shape"] = [3, 6]

    for bad in (
        with_header("end.safetensors", past_end),
        with_header("overlap.safetensors", overlap),
        with_header("shape.safetensors", shape),
    ):
        with pytest.raises(CheckpointError, match=rf"^{bad}: not a readable safetensors file .*rerun it$"):
            read_tensors(bad, "rerun it")


def test_read_tensors_holds_the_weights_once_while_it_reads(tmp_path):
    """Reading a 256 MB file raises the process's high-water mark by the arrays' size, not twice it (the library's
    load_file keeps the file's bytes beside the arrays; safe_open's mapped pages count in RSS too). Bound: the
    arrays (1x) plus a quarter for the allocator and the interpreter; reading twice over is 2x."""
    import subprocess
    import sys

    import numpy as np
    from safetensors.numpy import save_file

    f = tmp_path / "w.safetensors"
    save_file({f"w{i}": np.full((1 << 22,), i, np.float32) for i in range(16)}, str(f))  # 16 x 16 MiB
    code = (
        "import sys; sys.path.insert(0, sys.argv[2])\n"
        "from tasks.store.tensors import read_tensors\n"
        "hwm = lambda: int([l for l in open('/proc/self/status') if l.startswith('VmHWM')][0].split()[1]) * 1024\n"
        "before = hwm(); w = read_tensors(sys.argv[1], 'x'); print(hwm() - before, sum(a.nbytes for a in w.values()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(f), str(Path(__file__).resolve().parents[1])],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    grew, size = int(out[0]), int(out[1])
    assert size == 16 << 24 and grew <= 1.25 * size, (grew, size)


def test_altered_onnx_is_refused_by_the_server_backend_and_the_standalone_script(tmp_path, capsys):
    from tasks.deploy import onnx_generate
    from tasks.serving.backends import OnnxBackend

    store = ArtifactStore(tmp_path / "art")
    key = store.key("export", {}, [], "v")
    with store.build("export", key, pipeline="tiny", config={}, inputs=[], code="v") as b:
        (b.dir / "model.onnx").write_bytes(b"onnx bytes " * 100)
        (b.dir / "tokenizer.model").write_bytes(b"tok")
        digests = {n: sha256_file(b.dir / n) for n in ("model.onnx", "tokenizer.model")}
        (b.dir / "export.json").write_text(json.dumps({"digests": digests}))
    onnx_generate.check_export(b.path)  # as published: fine
    _flip_byte(b.path / "model.onnx")
    with pytest.raises(ArtifactError, match=r"model.onnx: sha256 differs.*`msllm export --pipeline tiny`"):
        OnnxBackend(b.path)  # before onnxruntime reads a byte of it
    with pytest.raises(
        onnx_generate.ExportChanged, match=rf"model.onnx: sha256 differs.*expected {digests['model.onnx']}"
    ):
        onnx_generate.check_export(b.path)
    # a copy of the export without its manifest is still checked, by export.json's digests
    copy = tmp_path / "copied"
    copy.mkdir()
    for n in ("model.onnx", "tokenizer.model", "export.json"):
        (copy / n).write_bytes((b.path / n).read_bytes())
    assert onnx_generate.main([str(copy), "ROMEO:"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error:" in err and "model.onnx: sha256 differs" in err and "Traceback" not in err


# ----------------------------------------------------------------------------- one build per key (issue 27)


def _slow_child(spec: dict) -> Path:
    """A stage child that records that it ran, works a while, then publishes."""
    import time

    store = ArtifactStore(spec["root"])
    with open(Path(spec["root"]) / "ran.log", "a") as f:
        f.write(f"{spec['tag']}\n")
    time.sleep(1.0)
    with store.build("pretrain", spec["key"], pipeline="p", config={}, inputs=[], code="v") as b:
        (b.dir / "model.bin").write_text(spec["tag"])
    return b.path


def _identical_run(root: str, key: str, tag: str, barrier, out) -> None:
    from tasks.runtime.supervise import supervise

    barrier.wait(timeout=60)
    path = supervise(
        "pretrain", ArtifactStore(root), key, {"root": root, "key": key, "tag": tag}, _slow_child, isolate=False
    )
    out.put((tag, str(path)))


def test_two_identical_runs_at_once_build_once_and_both_return_the_artifact(tmp_path):
    """Two identical `train` runs at once both trained (metrics.jsonl had every step twice): now the second
    waits on the key's lock, then returns what the first published."""
    root = str(tmp_path / "art")
    key = ArtifactStore.key("pretrain", {}, [], "twice")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_identical_run, args=(root, key, tag, barrier, out)) for tag in ("A", "B")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    results = dict(out.get(timeout=5) for _ in procs)
    ran = Path(root, "ran.log").read_text().split()
    assert len(ran) == 1, f"the stage ran {len(ran)} times for one key"
    assert results["A"] == results["B"] == str(ArtifactStore(root).lookup("pretrain", key))
    assert Path(results["A"], "model.bin").read_text() == ran[0]


def test_lock_is_released_when_its_holder_is_killed(tmp_path):
    import subprocess
    import sys
    import time

    root = tmp_path / "art"
    key = ArtifactStore.key("pretrain", {}, [], "kill")
    code = (
        f"import time; from tasks.store.artifacts import ArtifactStore as S\n"
        f"with S({str(root)!r}).lock('pretrain', {key!r}):\n    print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        holder.kill()  # kill -9: no cleanup code runs
        holder.wait()
        t0 = time.time()
        with ArtifactStore(root).lock("pretrain", key):
            pass
        assert time.time() - t0 < 5
    finally:
        if holder.poll() is None:
            holder.kill()


# ----------------------------------------------------------------------------- storage faults (issue 27)


def test_out_of_space_mid_build_is_one_line_and_leaves_nothing(tmp_path):
    import errno

    store = ArtifactStore(tmp_path / "art")
    key = store.key("data", {}, [], "enospc")
    with pytest.raises(ArtifactError) as ei:
        with store.build("data", key, pipeline="p", config={}, inputs=[], code="v") as b:
            (b.dir / "shard-0.bin").write_bytes(b"x" * 3 * 2**20)
            raise OSError(errno.ENOSPC, "No space left on device", str(b.dir / "shard-1.bin"))
    msg = str(ei.value)
    assert "\n" not in msg and "shard-1.bin: no space left on the device" in msg, msg
    assert " free" in msg and "had written 3.0 MiB" in msg and "nothing was published" in msg, msg
    assert ei.value.permanent
    assert store.lookup("data", key) is None and list((tmp_path / "art" / "data").iterdir()) == []


@pytest.mark.parametrize("where", ["lock", "mkdir", "rename"])
def test_read_only_root_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, where):
    """Tests run as root, where chmod stops no write: the read-only file system is simulated at the OS call."""
    import errno
    import os as _os

    store = ArtifactStore(tmp_path / "art")
    key = store.key("data", {}, [], "erofs-" + where)
    (tmp_path / "art" / "data").mkdir(parents=True)

    def refuse(*args, **kw):
        raise OSError(errno.EROFS, "Read-only file system", str(args[0]))

    real_open, real_mkdir = _os.open, Path.mkdir
    if where == "lock":
        monkeypatch.setattr(
            _os, "open", lambda p, *a, **k: refuse(p) if str(p).endswith(".lock") else real_open(p, *a, **k)
        )
    elif where == "mkdir":
        monkeypatch.setattr(
            Path,
            "mkdir",
            lambda self, *a, **k: refuse(self) if self.name.startswith(".tmp-") else real_mkdir(self, *a, **k),
        )
    else:
        monkeypatch.setattr(_os, "rename", refuse)
    with pytest.raises(ArtifactError) as ei:
        with store.build("data", key, pipeline="p", config={}, inputs=[], code="v") as b:
            (b.dir / "x.bin").write_bytes(b"x")
    msg = str(ei.value)
    assert "\n" not in msg and "cannot write (read-only file system)" in msg and "--artifacts" in msg, msg
    monkeypatch.undo()
    assert store.lookup("data", key) is None and list((tmp_path / "art" / "data").iterdir()) == []


def test_storage_faults_are_permanent_and_one_line(tmp_path):
    """A full disk in a training child was retried (an OSError, or safetensors' SafetensorError "… (os error 28)",
    counted as transient) and printed a traceback per attempt. A storage fault is now permanent and one line
    naming the file; other OSErrors stay retryable."""
    import errno

    import numpy as np
    from safetensors.numpy import save_file

    from tasks.runtime.supervise import is_permanent, storage_fault

    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "ckpt" / "model.safetensors"))
    assert is_permanent(full)
    assert "model.safetensors: no space left on the device" in str(storage_fault(full))
    try:  # the error safetensors' Rust writer raises, made real: its directory is missing (os error 2)
        save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "missing" / "w.safetensors"))
    except Exception as exc:  # noqa: BLE001  (SafetensorError has no importable base to name)
        rust = type(exc)(str(exc).replace("(os error 2)", "(os error 28)"))
    assert type(rust).__name__ == "SafetensorError" and is_permanent(rust)
    assert "no space left on the device" in str(storage_fault(rust, tmp_path))
    assert not is_permanent(OSError(errno.ECONNRESET, "Connection reset by peer"))
    assert storage_fault(RuntimeError("CUDA error")) is None


def test_save_tensors_on_a_full_disk_names_the_file(tmp_path):
    """safetensors' Rust writer fails on a full disk with SafetensorError "… (os error 28)", naming no file: now
    one ArtifactError line naming it, and no temp file left. A real 64 KiB tmpfs (root only)."""
    import os
    import subprocess

    import numpy as np

    from tasks.store.tensors import save_tensors

    if os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (the full disk)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN)")
    try:
        with pytest.raises(ArtifactError) as ei:
            save_tensors(mnt / "w.safetensors", {"w": np.zeros(1 << 18, np.float32)})  # 1 MiB
        msg = str(ei.value)
        assert f"{mnt / 'w.safetensors'}: no space left on the device" in msg and "\n" not in msg, msg
        assert ei.value.permanent and list(mnt.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_artifact_root_that_is_a_file_says_not_a_directory(tmp_path):
    """`--artifacts /etc/passwd` said "permission denied" (the lock's mkdir under a file: ENOTDIR)."""
    import subprocess
    import sys

    f = tmp_path / "a-file"
    f.write_text("x")
    store = ArtifactStore(f / "art")
    key = store.key("data", {}, [], "enotdir")
    with pytest.raises(ArtifactError) as ei:
        with store.build("data", key, pipeline="p", config={}, inputs=[], code="v"):
            pass
    assert f"{f} is not a directory" in str(ei.value) and "permission denied" not in str(ei.value), str(ei.value)
    repo = Path(__file__).resolve().parent.parent
    for arg, what in ((str(f), "is a file"), (str(f / "x"), f"lies under {f}, a file")):
        out = subprocess.run(
            [sys.executable, "-m", "tasks.cli", "train", "--pipeline", "tiny", "--artifacts", arg],
            capture_output=True,
            text=True,
            cwd=repo,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert f"--artifacts: {arg}: not a directory ({what})" in out.stderr, out.stderr


@pytest.mark.integration
def test_two_identical_data_runs_compute_once(tmp_path, capfd):
    """Two identical data runs at once: the second waited for the build lock the store's build took, then
    tokenized everything again (its copy discarded at publish). Now the stage lock spans the computation: the
    waiter returns what the first published and computes nothing."""
    import threading
    import time

    from tasks.config.loader import resolve_pipeline
    from tasks.stages import data

    repo = Path(__file__).resolve().parent.parent
    cfg = resolve_pipeline(repo / "pipelines.yaml", "tiny", ["data.num_workers=1"])
    store = ArtifactStore(tmp_path / "art")
    key = data.stage_key(cfg, store)[0]
    lock = store.root / ".locks" / f"data.{key}.lock"
    out: dict[str, Path] = {}

    def run(name: str) -> None:
        out[name] = run_stage("data", cfg, ArtifactStore(store.root), progress=True)

    first = threading.Thread(target=run, args=("first",))
    first.start()
    deadline = time.monotonic() + 60
    while not (lock.is_file() and lock.read_text().startswith("pid ")):  # the first holds the lock: it computes
        assert time.monotonic() < deadline and first.is_alive(), "the first run never took the lock"
        time.sleep(0.01)
    second = threading.Thread(target=run, args=("second",))
    second.start()
    first.join()
    second.join()
    err = capfd.readouterr().err
    assert out["first"] == out["second"] == store.lookup("data", key), out
    assert err.count("data: training a bpe tokenizer") == 1, err  # one computation
    assert f"data/{key} is being built by another process" in err and "[data] " in err, err
    assert f"{out['first']} is published (built by another process meanwhile); using it" in err, err


@pytest.mark.integration
def test_a_conversion_waiting_for_an_identical_one_uses_what_it_published(tmp_path, capfd, monkeypatch):
    """convert ran under the store's build lock only: a second identical `convert --from-hf` read and converted
    every tensor, then waited at the build, then threw its copy away. Now it waits at the stage lock, before any
    work, and returns the artifact the first one published. The first run is this thread, holding the lock
    while the second (a thread) waits; the tensors are read once."""
    import threading
    import time

    from helpers import tiny_model_artifact

    from tasks.stages import convert

    (tmp_path / "src").mkdir()
    hf_dir = convert.to_hf(tiny_model_artifact(tmp_path / "src"), tmp_path / "hf")
    key = convert_hf(hf_dir, ArtifactStore(tmp_path / "probe")).name  # a content key: the same in any store
    store = ArtifactStore(tmp_path / "art")
    reads = []
    real_read = convert.read_hf_tensors
    monkeypatch.setattr(
        convert, "read_hf_tensors", lambda d: reads.append(threading.current_thread().name) or real_read(d)
    )
    out: dict[str, Path] = {}
    second = threading.Thread(
        target=lambda: out.update(second=convert_hf(hf_dir, ArtifactStore(store.root))), name="second"
    )
    err = ""
    with store.lock("convert", key):  # the first run has started converting
        second.start()
        deadline = time.monotonic() + 60
        while f"convert/{key} is being built by another process" not in err:  # the second one waits for it
            assert time.monotonic() < deadline and second.is_alive(), err
            time.sleep(0.02)
            err += capfd.readouterr().err
        out["first"] = convert_hf(hf_dir, store)
    second.join()
    err += capfd.readouterr().err
    assert out["first"] == out["second"] == store.lookup("convert", key)
    assert reads == ["MainThread"], reads  # converted once, by the run holding the lock
    assert f"[convert] {out['first']} is published (built by another process meanwhile); using it" in err, err
