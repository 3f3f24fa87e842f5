"""Fault tests (issue 14): bad inputs and faults that once gave a silent wrong result, a raw
traceback or a hang. One section (a test class) per fault class of the issue; each test failed
on the code before its fix.

    TestLineage    class 4: lineage is linear in the graph, warns in every format, stays in the root
    TestYaml       class 6: YAML as people write it, binary files, bad `plan` arguments
    TestLeftovers  class 7: temp dirs of killed builds, serve.py stopping on SIGTERM/SIGINT
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import atomic_write_json
from tasks.store.published import MANIFEST
from tests.helpers import run_stage

REPO = Path(__file__).resolve().parent.parent
PIPELINES = REPO / "pipelines.yaml"


# ============================================================================= class 4: lineage


def _key(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:20]


def _art(root: Path, stage: str, name: str, inputs: list[dict], digest: str | None = None) -> dict:
    """A fake-but-valid artifact: a complete manifest (no payload) at `root/stage/key`; returns its input ref."""
    key = _key(name)
    path = root / stage / key
    digest = digest or hashlib.sha256(f"payload of {name}".encode()).hexdigest()
    atomic_write_json(
        path / MANIFEST,
        {
            "schema_version": 1,
            "stage": stage,
            "key": key,
            "pipeline": "fault",
            "created": "2025-01-01T00:00:00+00:00",
            "config": {"name": name},
            "inputs": inputs,
            "code": {"stage_version": "test", "git_commit": None},
            "environment": {},
            "metrics": {"loss": 1.5},
            "files": [],
            "digest": digest,
            "complete": True,
        },
    )
    return {"kind": "artifact", "stage": stage, "key": key, "digest": digest, "path": str(path)}


def _file(path: Path) -> dict:
    return {"kind": "file", "path": str(path), "size": 3, "sha256": hashlib.sha256(b"raw").hexdigest()}


class _CountingStore(ArtifactStore):
    """Counts manifest reads and gives up (AssertionError) past a budget, so a blow-up fails fast."""

    def __init__(self, root, budget: int):
        super().__init__(root)
        self.reads, self.budget = 0, budget

    def read_manifest(self, path):  # noqa: D102  (the store's own is a staticmethod)
        self.reads += 1
        if self.reads > self.budget:
            raise AssertionError(f"lineage read {self.reads} manifests for a graph of {self.budget // 2} nodes")
        return ArtifactStore.read_manifest(path)


def _nodes(tree: dict) -> list[dict]:
    out, stack = [], [tree]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(n.get("inputs", []))
    return out


class TestLineage:
    def test_diamond_of_24_levels_is_linear(self, tmp_path):
        from tasks.store.lineage import lineage_tree, raw_inputs, render

        root = tmp_path / "art"
        level = [_art(root, "data", "d", [_file(tmp_path / "corpus.txt")])]
        for i in range(24):  # two nodes per level, each built from both nodes of the level below
            level = [_art(root, "pretrain", f"{i}{side}", [dict(r) for r in level]) for side in "ab"]
        top = _art(root, "export", "top", level)
        n_artifacts = 1 + 2 * 24 + 1
        store = _CountingStore(root, budget=2 * n_artifacts)
        t0 = time.perf_counter()
        tree = lineage_tree(store, top["path"])
        outputs = {fmt: render(tree, fmt) for fmt in ("text", "json", "mermaid", "dot")}
        raws = raw_inputs(tree)
        took = time.perf_counter() - t0
        assert took < 1.0, f"lineage of {n_artifacts} artifacts took {took:.2f}s"
        assert store.reads <= n_artifacts  # each manifest read once
        nodes = _nodes(tree)
        full = [n for n in nodes if n["kind"] == "artifact"]
        assert len(full) == n_artifacts and len({n["key"] for n in full}) == n_artifacts
        refs = [n for n in nodes if n["kind"] == "artifact-ref"]
        assert len(refs) == 2 * 24 - 1 and all(r["ref"] == "shown above" for r in refs)
        assert len(outputs["text"].splitlines()) == len(nodes) == n_artifacts + len(refs) + 1  # + the raw file
        assert len(raws) == 1 and raws[0]["path"].endswith("corpus.txt")
        # the graph formats draw the DAG: every artifact once (full label), every edge once
        edges = [ln for ln in outputs["mermaid"].splitlines() if "-->" in ln]
        assert len(edges) == 2 + 4 * 23 + 2 + 1
        assert "[artifact-ref]" not in outputs["mermaid"] and "shown above" not in outputs["dot"]

    def test_shared_input_is_expanded_once_then_referenced(self, tmp_path):
        """A normal pipeline's graph: the tree is unchanged except that a repeated artifact is a reference."""
        from tasks.store.lineage import lineage_tree, raw_inputs, render

        root = tmp_path / "art"
        data = _art(root, "data", "d", [_file(tmp_path / "corpus.txt")])
        pre = _art(root, "pretrain", "p", [data])
        ev = _art(root, "eval", "e", [pre, data])
        exp = _art(root, "export", "x", [pre, ev])
        store = ArtifactStore(root)
        tree = lineage_tree(store, exp["path"])
        assert [c["stage"] for c in tree["inputs"]] == ["pretrain", "eval"]
        assert tree["inputs"][0] == lineage_tree(store, pre["path"])  # first occurrence: the full subtree
        ev_node = tree["inputs"][1]
        assert [(c["kind"], c["key"]) for c in ev_node["inputs"]] == [
            ("artifact-ref", pre["key"]),
            ("artifact-ref", data["key"]),
        ]
        assert ev_node["inputs"][0]["path"] == str(Path(pre["path"]).resolve())
        assert raw_inputs(tree) == raw_inputs(lineage_tree(store, pre["path"]))
        text = render(tree, "text")
        assert f"pretrain/{pre['key']} [shown above]" in text and f"data/{data['key']} [shown above]" in text
        assert text.count(f"pretrain/{pre['key']} (pipeline fault") == 1
        edges = {ln.strip() for ln in render(tree, "mermaid").splitlines() if "-->" in ln}
        assert len(edges) == 6  # file→data, data→pretrain, pretrain→export, pretrain→eval, data→eval, eval→export

    def test_digest_warning_in_every_format(self, tmp_path):
        from tasks.store.lineage import lineage_tree, render

        root = tmp_path / "art"
        data = _art(root, "data", "d", [_file(tmp_path / "corpus.txt")])
        stale = dict(data, digest="0" * 64)  # recorded before the data artifact was rebuilt in place
        pre = _art(root, "pretrain", "p", [stale])
        ev = _art(root, "eval", "e", [pre, stale])  # the second edge to data (a reference) is stale too
        tree = lineage_tree(ArtifactStore(root), ev["path"])
        text = render(tree, "text")
        assert text.count("digest differs") == 2, text
        assert render(tree, "json").count("digest differs") == 2
        assert "digest differs" in render(tree, "mermaid") and "digest differs" in render(tree, "dot")
        fine = lineage_tree(ArtifactStore(root), _art(root, "eval", "ok", [data])["path"])
        assert "digest differs" not in render(fine, "text")

    def test_input_outside_the_root_is_an_error_node(self, tmp_path):
        from tasks.store.lineage import lineage_tree, raw_inputs, render

        root, elsewhere = tmp_path / "art", tmp_path / "elsewhere"
        foreign = _art(elsewhere, "data", "foreign", [_file(tmp_path / "secret.txt")])
        (root / "data").mkdir(parents=True)
        link = root / "data" / _key("link")
        link.symlink_to(Path(foreign["path"]))  # inside by name, outside once resolved
        via_link = dict(foreign, path=str(link))
        dotdot = dict(foreign, path=str(root / ".." / "elsewhere" / "data" / foreign["key"]))
        top = _art(root, "pretrain", "p", [foreign, via_link, dotdot])
        tree = lineage_tree(ArtifactStore(root), top["path"])
        assert len(tree["inputs"]) == 3
        for node in tree["inputs"]:
            assert node["kind"] == "rejected" and "outside the artifact root" in node["error"], node
            assert "inputs" not in node  # not followed
        assert raw_inputs(tree) == []
        text = render(tree, "text")
        assert text.count("outside the artifact root") == 3 and "secret.txt" not in text

    def test_cycle_and_malformed_inputs(self, tmp_path):
        """A crafted cycle stops at a reference; a malformed input entry is an error node, not a KeyError."""
        from tasks.store.lineage import lineage_tree, render

        root = tmp_path / "art"
        a_ref = {
            "kind": "artifact",
            "stage": "pretrain",
            "key": _key("a"),
            "digest": "x",
            "path": str(root / "pretrain" / _key("a")),
        }
        b = _art(root, "pretrain", "b", [a_ref])
        a = _art(root, "pretrain", "a", [b, {"kind": "artifact"}, "junk"])
        tree = lineage_tree(ArtifactStore(root), a["path"])
        cyc = tree["inputs"][0]["inputs"][0]
        assert cyc["kind"] == "artifact-ref" and cyc["ref"] == "cycle" and cyc["key"] == a["key"]
        assert [n["kind"] for n in tree["inputs"][1:]] == ["rejected", "rejected"]
        assert all("malformed input" in n["error"] for n in tree["inputs"][1:])
        for fmt in ("text", "json", "mermaid", "dot"):
            render(tree, fmt)

    def test_very_deep_chain_is_cut_not_a_crash(self, tmp_path):
        from tasks.store.lineage import MAX_DEPTH, lineage_tree, render

        root = tmp_path / "art"
        ref = _art(root, "data", "d", [_file(tmp_path / "corpus.txt")])
        for i in range(1000):  # the old recursive walk died with RecursionError here
            ref = _art(root, "pretrain", f"c{i}", [ref])
        tree = lineage_tree(ArtifactStore(root), ref["path"])
        outputs = [render(tree, fmt) for fmt in ("text", "json", "mermaid", "dot")]
        assert f"lineage deeper than {MAX_DEPTH} artifacts" in outputs[0]
        assert len(outputs[0].splitlines()) == MAX_DEPTH + 1


# ============================================================================= class 6: YAML and arguments


def _write_yaml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "pipelines.yaml"
    p.write_text(text, encoding="utf-8")
    return p


_TINY = """\
pipelines:
  t:
    model: {{name: llama, preset: tiny}}
    data: {{sources: [{src}], seq_length: 64, tokenizer: {{vocab_size: 512}}}}
    pretrain:
      train:
        loop: {{max_steps: 20}}
        optimizer: {{lr: {lr}, min_lr: {min_lr}, weight_decay: {wd}}}
"""


def _main(argv: list[str]) -> tuple[int, str, str]:
    from tasks.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as exc:  # argparse errors
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


class TestYaml:
    SRC = str(REPO / "data/corpora/tinyshakespeare.txt")

    @pytest.mark.parametrize(
        "lr,min_lr,wd,want",
        [
            ("1e-3", "1.0e-5", "1E-2", (1e-3, 1e-5, 1e-2)),
            ("1.0e-3", "0", "0.1", (1e-3, 0.0, 0.1)),  # plain forms are unchanged (ints stay ints → floats by schema)
            ("+2e-4", "1.5e-6", "1e0", (2e-4, 1.5e-6, 1.0)),
            ("3.0E-3", ".5e-5", "1_0e-2", (3e-3, 5e-6, 0.1)),
        ],
    )
    def test_exponent_floats_in_the_file(self, tmp_path, lr, min_lr, wd, want):
        from tasks.config.loader import resolve_pipeline

        cfg = resolve_pipeline(_write_yaml(tmp_path, _TINY.format(src=self.SRC, lr=lr, min_lr=min_lr, wd=wd)), "t")
        o = cfg.pretrain.train.optimizer
        assert (o.lr, o.min_lr, o.weight_decay) == pytest.approx(want)
        assert all(isinstance(v, float) for v in (o.lr, o.min_lr, o.weight_decay))

    def test_exponent_floats_in_set_and_what_stays_a_string(self, tmp_path):
        from tasks.config.loader import parse_override, resolve_pipeline

        path = _write_yaml(tmp_path, _TINY.format(src=self.SRC, lr="1e-3", min_lr="0.0", wd="0.0"))
        cfg = resolve_pipeline(path, "t", ["pretrain.train.optimizer.lr=1.0e6", "pretrain.train.optimizer.min_lr=2e-5"])
        assert cfg.pretrain.train.optimizer.lr == 1.0e6 and cfg.pretrain.train.optimizer.min_lr == 2e-5
        assert parse_override("a={x: 1e-3, y: [2E5, 7]}")[1] == {"x": 1e-3, "y": [2e5, 7]}
        for text, value in (
            ("10", 10),
            ("0x10", 16),
            ("1e", "1e"),
            ("e5", "e5"),
            ("1.2.3", "1.2.3"),
            ("v1e3", "v1e3"),
            ("1e-3x", "1e-3x"),
            (".inf", float("inf")),
        ):
            assert parse_override(f"a={text}")[1] == value, text

    @pytest.mark.parametrize(
        "text,key,line",
        [
            ("pipelines:\n  t:\n    model: {name: llama}\n    model: {preset: tiny}\n", "model", 4),
            ("pipelines:\n  t:\n    pretrain:\n      max_steps: 5\n      max_steps: 50\n", "max_steps", 5),
            ("default: t\npipelines:\n  t: {}\ndefault: u\n", "default", 4),
            ("pipelines:\n  t:\n    data: {seq_length: 64, seq_length: 128}\n", "seq_length", 3),
        ],
    )
    def test_duplicate_key_names_key_and_line(self, tmp_path, text, key, line):
        from tasks.config.loader import read_pipelines_file
        from tasks.config.schema import ConfigError

        path = _write_yaml(tmp_path, text)
        with pytest.raises(ConfigError) as exc:
            read_pipelines_file(path)
        msg = str(exc.value)
        assert f"{path}:{line}: duplicate key '{key}'" in msg and "keep one" in msg, msg
        rc, _, err = _main(["validate", "--config", str(path)])
        assert rc == 2 and f"duplicate key '{key}'" in err and "Traceback" not in err

    def test_duplicate_key_in_set_and_merge_keys_still_work(self, tmp_path):
        from tasks.config.loader import parse_override, read_pipelines_file
        from tasks.config.schema import ConfigError

        with pytest.raises(ConfigError, match=r"--set a=\{x: 1, x: 2\}: duplicate key 'x'"):
            parse_override("a={x: 1, x: 2}")
        path = _write_yaml(
            tmp_path, "pipelines:\n  t: &b {model: {name: llama}}\n  u:\n    <<: *b\n    model: {name: x}\n"
        )
        assert read_pipelines_file(path)["pipelines"]["u"] == {"model": {"name": "x"}}

    @pytest.mark.parametrize(
        "payload",
        [
            bytes(random.Random(0).randrange(256) for _ in range(4096)),
            b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\x00\x00\x00\x10" + bytes(range(256)),
            b"pipelines:\n  t: {}\n\x00\x00\x00\x00",
            bytes(random.Random(1).randrange(0x80, 0x100) for _ in range(2048)),
        ],
        ids=["random", "png", "nul", "high-bytes"],
    )
    def test_binary_config_is_a_config_error(self, tmp_path, payload):
        bad = tmp_path / "weird.yaml"
        bad.write_bytes(payload)
        rc, _, err = _main(["validate", "--config", str(bad)])
        assert rc == 2, err
        assert str(bad) in err and "Traceback" not in err and "YAML" in err, err

    def test_binary_config_through_the_real_command(self, tmp_path):
        bad = tmp_path / "logo.png"
        bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
        out = subprocess.run(
            [sys.executable, "-m", "tasks.cli", "plan", "--config", str(bad)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and str(bad) in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "not a text file" in out.stderr

    @pytest.mark.parametrize(
        "args,arg",
        [
            (["--devices", "0"], "--devices"),
            (["--devices", "-3"], "--devices"),
            (["--devices", "two"], "--devices"),
            (["--device-memory", "lots"], "--device-memory"),
            (["--device-memory", "0GiB"], "--device-memory"),
            (["--device-memory=-4GiB"], "--device-memory"),
            (["--device-memory", "infGiB"], "--device-memory"),
            (["--device-memory", "nan"], "--device-memory"),
        ],
    )
    def test_plan_arguments(self, args, arg):
        rc, _, err = _main(["plan", "--config", str(PIPELINES), "--pipeline", "tiny", *args])
        assert rc == 2, err
        assert f"argument {arg}" in err and "Traceback" not in err, err
        assert ("positive whole number" if arg == "--devices" else "e.g. 32GiB") in err, err

    def test_plan_accepts_good_arguments(self):
        rc, out, err = _main(
            ["plan", "--config", str(PIPELINES), "--pipeline", "tiny", "--devices", "2", "--device-memory", "1.5GiB"]
        )
        assert rc == 0 and "layouts for 2 device(s) × 1.5 GiB" in out, err

    def test_mostly_invalid_documents_are_dropped(self):
        from tasks.config.schema import CleanSection
        from tasks.stages.data.cleaning import Cleaner
        from tasks.stages.data.schema import SKIP_REASONS

        rng = random.Random(0)
        garbage = bytes(
            rng.randrange(0x80, 0x100) if rng.random() > 0.05 else rng.randrange(0x61, 0x7B) for _ in range(3000)
        )
        cases = [
            (garbage.decode("utf-8", "surrogateescape"), False),  # binary, no NUL bytes
            (("ab" + "\udcff" * 3) * 50, False),  # 60% invalid bytes
            (("abc" + "\udcff" * 2) * 50, True),  # 40%: repaired and kept
            ("A clean paragraph of text. " * 5 + "\ufffd" * 200, False),  # already-replaced garbage
            ("Un texte propre, accentué — et un � égaré.", True),
        ]
        c = Cleaner(CleanSection(min_chars=1))
        kept = [c.add(text) for text, _ in cases]
        assert kept == [want for _, want in cases]
        assert "mostly_invalid" in SKIP_REASONS and c.stats.skipped["mostly_invalid"] == 3
        assert c.stats.repaired["invalid_utf8"] == 1  # a dropped document is not counted as repaired too
        assert c.stats.seen == c.stats.kept + sum(c.stats.skipped.values())

    def test_mostly_invalid_file_is_counted_in_the_manifest(self, tmp_path):
        from tasks.config.loader import resolve_pipeline
        from tests.helpers import SHAKESPEARE, train_tiny_tokenizer

        paras = [p for p in SHAKESPEARE.read_text(encoding="utf-8").split("\n\n") if len(p) >= 200][:60]
        (tmp_path / "good.txt").write_text("\n\n".join(paras) + "\n", encoding="utf-8")
        rng = random.Random(2)
        (tmp_path / "blob.txt").write_bytes(
            bytes(rng.randrange(0x80, 0x100) if rng.random() > 0.03 else 0x20 for _ in range(20_000))
        )
        sources = json.dumps([str(tmp_path / "good.txt"), str(tmp_path / "blob.txt")])
        cfg = resolve_pipeline(PIPELINES, "tiny", [f"data.sources={sources}", "data.num_shards=1"], check_files=False)
        tok = train_tiny_tokenizer(tmp_path / "tok.model", 512)
        art = run_stage("data", cfg, ArtifactStore(tmp_path / "art"), tokenizer_model=tok, progress=False)
        met = ArtifactStore.read_manifest(art)["metrics"]
        assert met["documents_skipped"]["mostly_invalid"] == 1 and met["documents_kept"] == len(paras)
        assert met["documents_repaired"]["invalid_utf8"] == 0


# ============================================================================= class 7: leftovers and shutdown


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


class TestLeftovers:
    def test_temp_dirs_of_dead_builds_are_removed_when_the_store_builds(self, tmp_path):
        from tasks.store.locks import HOST as _HOST  # the host tag of build directories

        root = tmp_path / "art"
        key = _key("k")
        live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            dead_dir = root / "data" / f".tmp-{key}-{_dead_pid()}-0badc0de"  # as the code before the host tag named it
            dead_here = root / "finetune" / f".tmp-{key}-{_dead_pid()}-0badc0de@{_HOST}"
            foreign = "0" * 8 if _HOST != "0" * 8 else "1" * 8
            live_dir = root / "data" / f".tmp-{key}-{live.pid}-0000beef"
            mine = root / "pretrain" / f".tmp-{key}-{os.getpid()}-12345678"
            # pid reused: the live process started after this dir was last written, so it is not its builder
            reused = root / "eval" / f".tmp-{key}-{live.pid}-feedface"
            other = [
                root / "runs" / "pretrain" / key / "checkpoints" / ".tmp-step_00000010-dist",
                root / "data" / f".tmp-{key}-{_dead_pid()}-0badc0de@{foreign}",  # another host's build
                root / "data" / ".tmp-step_00000010-ab12cd",  # not a build dir of the store: left alone
                root / "data" / ".tmp-notakey-1-2",
            ]
            for d in (dead_dir, dead_here, live_dir, mine, reused, *other):
                d.mkdir(parents=True)
                (d / "part.bin").write_bytes(b"x" * 10)
            day_ago = time.time() - 86400
            os.utime(reused, (day_ago, day_ago))
            store = ArtifactStore(root)
            assert dead_dir.exists()  # opening to read removes nothing
            with store.build("data", _key("new"), pipeline="t", config={}, inputs=[], code="t") as b:
                (b.dir / "f.txt").write_text("hi")
            assert not dead_dir.exists() and not dead_here.exists() and not reused.exists()
            assert live_dir.exists() and mine.exists() and all(d.exists() for d in other)
            assert b.path.is_dir() and store.is_complete(b.path)
            live.kill()
            live.wait()
            assert store.clean_stale() == 1 and not live_dir.exists()
        finally:
            if live.poll() is None:
                live.kill()
                live.wait()

    @pytest.mark.slow
    def test_serve_stops_within_5s_on_sigterm_and_sigint(self, tmp_path):
        """scripts/serve.py against a real Prefect server: idle, and with a data flow run in flight."""
        import psutil

        from tests.test_flows import _tiny_config
        from tests.test_server import PREFECT, _stop, _wait_health, server_env

        cfg = _tiny_config(tmp_path)
        port, api, env = server_env(tmp_path)
        server = subprocess.Popen(
            [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=open(tmp_path / "server.log", "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        took, orphans = {}, {}
        try:
            _wait_health(api, 120)
            for sig, busy in [(s, b) for b in (False, True) for s in (signal.SIGTERM, signal.SIGINT)]:
                case = f"{sig.name}{'-busy' if busy else ''}"
                log = tmp_path / f"serve-{case}.log"
                serve = subprocess.Popen(
                    [
                        sys.executable,
                        "scripts/serve.py",
                        "--pipeline",
                        "tiny",
                        "--config",
                        str(cfg),
                        "--artifacts",
                        str(tmp_path / f"art-{case}"),
                        "--cron",
                        "",
                    ],
                    cwd=REPO,
                    env=env,
                    stdout=open(log, "w"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
                try:
                    t0 = time.time()
                    while "trigger" not in log.read_text() and serve.poll() is None and time.time() - t0 < 120:
                        time.sleep(0.5)
                    time.sleep(3)  # into the polling loop
                    assert serve.poll() is None, log.read_text()[-3000:]
                    kids: list = []
                    if busy:  # a data flow run with its worker pool
                        subprocess.run(
                            [PREFECT, "deployment", "run", "data-stage/data-only"],
                            env=env,
                            capture_output=True,
                            timeout=120,
                            check=True,
                        )
                        t0 = time.time()  # until the flow run's process pool is up
                        while len(kids) < 2 and serve.poll() is None and time.time() - t0 < 120:
                            time.sleep(0.5)
                            kids = psutil.Process(serve.pid).children(recursive=True)
                        assert len(kids) >= 2, log.read_text()[-3000:]
                        time.sleep(1)
                        kids = psutil.Process(serve.pid).children(recursive=True)
                    t0 = time.time()
                    os.kill(serve.pid, sig)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        serve.wait(30)
                    took[case] = round(time.time() - t0, 2)
                    assert serve.poll() is not None, f"serve.py still running 30 s after {sig.name}"
                    time.sleep(2)
                    orphans[case] = [k.pid for k in kids if k.is_running() and k.status() != psutil.STATUS_ZOMBIE]
                    for k in kids:
                        with contextlib.suppress(psutil.Error):
                            k.kill()
                    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]
                finally:
                    _stop(serve)
        finally:
            _stop(server)
        print("stop times (s):", took)
        assert all(t < 5 for t in took.values()) and not any(orphans.values()), (took, orphans)


# ============================================================================= issue 27: what is loaded is what was
# published


@pytest.mark.integration
def test_predict_and_serve_refuse_altered_weights(tmp_path):
    """Weights altered inside a published model.safetensors: `predict` answered and exited 0, `serve` served."""
    from tests.helpers import tiny_model_artifact

    root = tmp_path / "art"
    root.mkdir()
    art = tiny_model_artifact(root)
    f = art / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[-7] ^= 0x40  # one weight's exponent bit: same size, other numbers
    f.write_bytes(bytes(raw))
    env = dict(os.environ, GLOG_v="3")
    for argv in (
        [
            "predict",
            "--config",
            str(PIPELINES),
            "--pipeline",
            "tiny",
            "--artifacts",
            str(root),
            "--from",
            str(art),
            "ROMEO:",
        ],
        ["serve", "--config", str(PIPELINES), "--artifacts", str(root), str(art), "--port", "0"],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "tasks.cli", *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 1, (argv[0], out.stdout[-2000:], out.stderr[-2000:])
        assert f"{f}: sha256 differs from the manifest" in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert "msllm train" in out.stderr and out.stdout.strip() == "", out.stdout


class TestResumeAfterKill:
    """Resume after kill -9 failed with `unsupported format string passed to NoneType.__format__`: a run killed
    after its last checkpoint resumed with no step left, so no validation loss, and the summary formatted None."""

    def test_torn_metrics_line_is_dropped(self, tmp_path, capsys):
        from tasks.training.metrics import read_jsonl as _read_jsonl

        f = tmp_path / "metrics.jsonl"
        f.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.4, "val_lo')  # killed mid-write
        assert _read_jsonl(f) == [{"step": 1, "loss": 2.5}]
        assert "dropped 1 partial line" in capsys.readouterr().err

    @pytest.mark.parametrize(
        "history,want",
        [
            ([{"step": 4, "loss": 2.0}, {"step": 5, "loss": 1.5, "val_loss": 1.7}], (1.5, 1.7)),  # everything there
            ([{"step": 4, "loss": 2.0}], (2.0, None)),  # the last record was torn away: val_loss measured again
            ([], (float("nan"), None)),  # metrics.jsonl lost entirely
        ],
    )
    def test_final_losses_of_a_run_resumed_at_its_end(self, history, want):
        import math

        from tasks.training.outcome import final_from_history

        loss, val = final_from_history(history, 5, float("nan"), None)
        assert val == want[1] and (loss == want[0] or (math.isnan(loss) and math.isnan(want[0])))


class TestMachineLimits:
    """`plan --devices 1000000000000` hung (a loop over the device count); `--set pretrain.train.loop.micro_batch_size=
    1000000000000` validated and its child grew to 18 GB."""

    def test_plan_for_a_trillion_devices_answers_at_once(self):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tasks.cli",
                "plan",
                "--config",
                str(PIPELINES),
                "--pipeline",
                "tiny",
                "--devices",
                "1000000000000",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "layouts for 1000000000000 device(s)" in out.stdout, out.stderr[-2000:]

    def test_candidate_layouts_do_not_grow_with_the_device_count(self):
        from model.config import ModelConfig
        from tasks.training.memory import candidate_layouts

        mc = ModelConfig.from_name("tiny")
        t0 = time.perf_counter()
        lays = candidate_layouts(mc, 2**40)
        assert time.perf_counter() - t0 < 0.5 and len(lays) <= 2 * 8 * mc.num_layers
        assert {(x.dp, x.tp, x.pp) for x in candidate_layouts(mc, 8)} >= {(8, 1, 1), (4, 2, 1), (2, 2, 2), (4, 1, 2)}

    @pytest.mark.parametrize(
        "overrides,key,fix",
        [
            (
                ["pretrain.train.loop.micro_batch_size=1000000000000"],
                "pretrain.train.loop.micro_batch_size",
                "lower pretrain.train.loop.micro_batch_size",
            ),
            (
                ["finetune.train.loop.micro_batch_size=1000000000000"],
                "finetune.train.loop.micro_batch_size",
                "lower finetune.train.loop.micro_batch_size",
            ),
            (["parallel.data_parallel=100000", "parallel.device_num=100000"], "parallel.device_num", "fewer ranks"),
        ],
    )
    def test_validation_refuses_what_no_machine_here_can_hold(self, overrides, key, fix):
        from tasks.config.loader import resolve_pipeline
        from tasks.training.memory import GiB, machine_fit_errors

        cfg = resolve_pipeline(PIPELINES, "tiny", overrides)
        errs = machine_fit_errors(cfg, "pipelines.tiny", machine_bytes=16 * GiB)
        assert len(errs) == 1 and errs[0].startswith(f"pipelines.tiny.{key}:") and "GiB by the memory plan" in errs[0]
        assert "this machine has 16.0 GiB" in errs[0] and fix in errs[0], errs
        assert machine_fit_errors(resolve_pipeline(PIPELINES, "tiny"), "p", machine_bytes=16 * GiB) == []
        rc, out, err = _main(
            [
                "validate",
                "--config",
                str(PIPELINES),
                "--pipeline",
                "tiny",
                *[a for o in overrides for a in ("--set", o)],
            ]
        )
        assert rc == 2 and f"pipelines.tiny.{key}" in err and "Traceback" not in err, err


@pytest.mark.integration
def test_eval_publishes_last_so_a_failed_side_output_is_written_by_the_rerun(tmp_path, monkeypatch):
    """eval with a read-only run dir failed after its artifact was published: the rerun was a cache hit and
    the TensorBoard scores were never written. (As root chmod stops nothing: the write fails at the OS call.)"""
    import errno

    from tasks.config.loader import resolve_pipeline
    from tasks.store import tensorboard
    from tasks.store.errors import ArtifactError
    from tests.helpers import tiny_model_artifact

    root = tmp_path / "art"
    root.mkdir()
    model = tiny_model_artifact(root)
    cfg = resolve_pipeline(
        PIPELINES, "tiny", ["eval.tasks=[]", "eval.prompts=[]", "eval.perplexity_files=[]"], check_files=False
    )
    store = ArtifactStore(root)
    real = tensorboard.write_eval

    def read_only(run_dir, *a, **kw):
        raise PermissionError(errno.EROFS, "Read-only file system", str(run_dir))

    monkeypatch.setattr(tensorboard, "write_eval", read_only)
    with pytest.raises(
        ArtifactError, match=r"runs/eval/\w+: cannot write \(read-only file system\); nothing was published"
    ):
        run_stage("eval", cfg, store, model, None, progress=False)
    assert store.list("eval") == []  # nothing published, so the rerun is not a cache hit
    assert not (root / "eval").exists() or not [p for p in (root / "eval").iterdir() if p.name.startswith(".tmp-")]
    monkeypatch.setattr(tensorboard, "write_eval", real)
    path = run_stage("eval", cfg, store, model, None, progress=False)
    key = store.read_manifest(path)["key"]
    assert tensorboard.event_files(root / "runs" / "eval" / key), "the rerun wrote no TensorBoard event file"
