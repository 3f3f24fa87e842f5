"""The stage runner (tasks/stages/runner.py) that the CLI and the flows share: the machine checked once, the stage
key computed once and handed down to the stage's `run`. Stubs stand in for the stage's work (no MindSpore child);
the key, the checks and the CLI wiring are the real ones. The flows' count is tests/test_flows.py's."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from tasks.store.artifacts import ArtifactStore
from tests.helpers import run_stage

REPO = Path(__file__).resolve().parent.parent
PIPELINES = REPO / "pipelines.yaml"


def _stub(store: ArtifactStore, stage: str, key: str, inputs=(), model: bool = False) -> Path:
    """A published artifact of `stage` under `key` (a model.json where a model artifact needs one)."""
    with store.build(stage, key, pipeline="tiny", config={}, inputs=list(inputs), code="test") as b:
        if model:
            (b.dir / "model.json").write_text("{}")
    return b.path


def _counting(counts: Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)

    return wrapper


@pytest.fixture
def counts(monkeypatch) -> Counter:
    """Calls of each stage module's stage_key (by stage name) and of the machine-fit check ("machine")."""
    from tasks.stages import STAGES, runner, stage_module

    c: Counter = Counter()
    for name in STAGES:
        mod = stage_module(name)
        if hasattr(mod, "stage_key"):
            monkeypatch.setattr(mod, "stage_key", _counting(c, name, mod.stage_key))
    check = _counting(c, "machine", runner.machine_fit_errors)
    monkeypatch.setattr(runner, "machine_fit_errors", check)
    return c


def test_cli_train_checks_the_machine_once_and_computes_the_key_once(tmp_path, monkeypatch, counts, capsys):
    from tasks import cli
    from tasks.stages import pretrain

    store = ArtifactStore(tmp_path / "art")
    _stub(store, "data", "d" * 16)
    handed = []

    def child(stage, store_, key, spec, fn, **kw):  # the supervised child: publishes what it was told to
        handed.append(key)
        return _stub(store_, stage, key, model=True)

    monkeypatch.setattr(pretrain, "supervise", child)
    argv = ["train", "--config", str(PIPELINES), "--pipeline", "tiny", "--artifacts", str(store.root)]
    assert cli.main(argv) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts == {"pretrain": 1, "machine": 1}, counts
    assert handed == [path.name] and store.lookup("pretrain", path.name) == path
    assert cli.main(argv) == 0  # a cache hit: no child, and again one key and one check
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]) == path
    assert counts == {"pretrain": 2, "machine": 2} and len(handed) == 1, counts


def test_stage_run_takes_the_key_prepare_computed(tmp_path, monkeypatch, counts):
    """prepare → StageCall.run: the stage module's run gets `keyed` and computes nothing again; it cannot be run
    without one (no second key, no second machine check)."""
    from tasks.config.loader import resolve_pipeline
    from tasks.stages import pretrain
    from tasks.stages.runner import prepare

    store = ArtifactStore(tmp_path / "art")
    data = _stub(store, "data", "d" * 16)
    cfg = resolve_pipeline(PIPELINES, "tiny", [])
    handed = []
    monkeypatch.setattr(
        pretrain,
        "supervise",
        lambda stage, store_, key, *a, **kw: handed.append(key) or _stub(store_, stage, key, model=True),
    )
    call = prepare("pretrain", store, cfg, data_artifact=data)
    assert counts == {"pretrain": 1, "machine": 1} and call.cached() is None
    path = call.run(progress=False)
    assert counts == {"pretrain": 1, "machine": 1} and handed == [call.key] and path == call.cached()
    assert run_stage("pretrain", cfg, store, data, progress=False) == path  # through the runner again: a hit
    assert counts == {"pretrain": 2, "machine": 2} and handed == [call.key]
    with pytest.raises(TypeError, match="keyed"):
        pretrain.run(cfg, store, data, progress=False)


def test_resolve_init_converts_a_source_once_and_finds_an_artifact(tmp_path, monkeypatch, counts):
    """pretrain.init_from naming an HF directory: the convert stage through the runner (one key); an artifact
    reference: the store's artifact, no conversion."""
    from tasks.stages import convert
    from tasks.stages.runner import resolve_init

    hf = tmp_path / "hf"
    hf.mkdir()
    for name, text in (("config.json", "{}"), ("model.safetensors", "w"), ("tokenizer.json", "{}")):
        (hf / name).write_text(text)
    store = ArtifactStore(tmp_path / "art")
    converted = []

    def from_hf(hf_dir, store_, pipeline=None, *, keyed):
        converted.append(keyed[0])
        return _stub(store_, "convert", keyed[0], keyed[1], model=True)

    monkeypatch.setattr(convert, "from_hf", from_hf)
    art = resolve_init(store, "tiny", hf)
    assert counts == {"convert": 1} and converted == [art.name]
    assert resolve_init(store, "tiny", hf) == art and converted == [art.name]  # cached: not converted again
    assert resolve_init(store, "tiny", f"convert/{art.name}") == art and counts == {"convert": 2}
    assert resolve_init(store, "tiny", None) is None


def test_prepare_refuses_before_any_key(tmp_path, counts):
    from tasks.config.loader import resolve_pipeline
    from tasks.config.schema import ConfigError
    from tasks.stages import UnknownStage
    from tasks.stages.runner import prepare

    store = ArtifactStore(tmp_path / "art")
    data = _stub(store, "data", "d" * 16)
    huge = resolve_pipeline(PIPELINES, "tiny", ["pretrain.train.loop.micro_batch_size=1000000000000"])
    with pytest.raises(ConfigError, match=r"pipelines\.tiny\.pretrain\.train\.loop\.micro_batch_size"):
        prepare("pretrain", store, huge, data_artifact=data)
    assert counts == {"machine": 1}  # refused by the memory plan: no key computed
    with pytest.raises(UnknownStage):
        prepare("nope", store)
    with pytest.raises(ValueError, match="not run by the stage runner"):
        prepare("merged", store)


def test_a_forced_rerun_publishes_under_the_same_key_and_keeps_the_previous(tmp_path):
    """ArtifactStore.replacing (StageCall.refresh): the published artifact moves to <stage>/.replaced/, out of
    lookup and list; the rebuild publishes under the same key with "replaces" naming it (path, created, digest),
    and the lineage shows it; a rebuild that fails puts the previous artifact back."""
    from tasks.store.lineage import lineage_tree, render

    store = ArtifactStore(tmp_path)
    key = "ab" * 10
    first = _stub(store, "eval", key)
    m1 = store.read_manifest(first)
    with store.replacing("eval", key) as previous:
        assert store.lookup("eval", key) is None and previous.parent.name == ".replaced" and previous.is_dir()
        assert [p for p, _ in store.list("eval")] == []
        again = _stub(store, "eval", key)
    assert again == first and store.lookup("eval", key) == first
    m2 = store.read_manifest(first)
    assert m2["replaces"] == {"path": str(previous), "created": m1["created"], "digest": m1["digest"]}
    assert store.read_manifest(previous)["created"] == m1["created"] != m2["created"]
    tree = lineage_tree(store, first)
    assert tree["replaces"]["path"] == str(previous) and f"kept at {previous}" in render(tree)
    assert "replaces" not in store.read_manifest(_stub(store, "eval", "cd" * 10))  # only the rebuilt key's

    with pytest.raises(RuntimeError, match="boom"), store.replacing("eval", key) as moved:  # the rebuild fails
        assert store.lookup("eval", key) is None
        raise RuntimeError("boom")
    assert store.lookup("eval", key) == first and not moved.exists()
    assert store.read_manifest(first)["created"] == m2["created"]


def test_cli_refresh_evaluates_again_under_the_same_key(tmp_path, capsys):
    """`msllm eval --refresh`: the same eval computed again and published under its key (a plain rerun is a
    cache hit that computes nothing), the previous record kept and named in the new manifest."""
    from tasks.cli import main
    from tests.helpers import tiny_model_artifact

    art = tiny_model_artifact(tmp_path)
    base = ["--config", str(PIPELINES), "--pipeline", "tiny", "--artifacts", str(tmp_path), "--from", str(art)]
    sets = ["--set", "eval.tasks=[]", "--set", "eval.prompts=[]"]
    assert main(["eval", *base, *sets]) == 0
    path = Path(capsys.readouterr().out.strip().splitlines()[-1])
    m1 = ArtifactStore(tmp_path).read_manifest(path)
    assert main(["eval", *base, *sets]) == 0  # cache hit: the same record
    assert ArtifactStore(tmp_path).read_manifest(path)["created"] == m1["created"]
    capsys.readouterr()
    assert main(["eval", *base, *sets, "--refresh"]) == 0
    out = capsys.readouterr()
    assert Path(out.out.strip().splitlines()[-1]) == path and "forced rerun" in out.err
    m2 = ArtifactStore(tmp_path).read_manifest(path)
    assert m2["key"] == m1["key"] and m2["created"] != m1["created"]
    assert m2["replaces"]["created"] == m1["created"]
    assert ArtifactStore(tmp_path).read_manifest(Path(m2["replaces"]["path"]))["digest"] == m1["digest"]
