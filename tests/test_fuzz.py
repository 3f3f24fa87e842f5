"""The fuzz targets (fuzz/): a smoke run of every target in CI (each reader holds its contract on a few hundred
generated inputs), the harness catching a planted violation, and the findings of the fuzzers' runs as regression
tests (docs/RELIABILITY.md, "Fuzzing")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOKE_EXAMPLES = 150


@pytest.mark.integration  # ~30 s: every target in a child of its own, a few hundred inputs each
def test_every_target_holds_its_contract_in_a_smoke_run():
    from fuzz.targets import TARGETS

    r = subprocess.run(
        [sys.executable, "-m", "fuzz", "all", "--examples", str(SMOKE_EXAMPLES)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [row["target"] for row in rows] == list(TARGETS), r.stderr[-2000:]
    for row in rows:
        assert row["violations"] == [], row
        assert row["examples"] >= SMOKE_EXAMPLES and row["allowed_errors"] <= row["examples"], row
    assert r.returncode == 0


def test_the_harness_reports_a_foreign_exception_with_its_smallest_input(monkeypatch):
    """A reader that raises anything but its allowed errors is a finding: the round stops, the input is shrunk."""
    from hypothesis import strategies as st

    import fuzz.__main__ as runner
    from fuzz import targets

    def reader(n, tmp):
        if n > 10:
            raise KeyError(n)
        if n < 0:
            raise ValueError(n)  # allowed

    boom = targets.Target("boom", lambda: st.integers(-100, 100), reader, lambda: (ValueError,), "a planted bug")
    monkeypatch.setitem(targets.TARGETS, "boom", boom)
    stats = runner._child("boom", 200, 0)
    assert stats["violations"] and stats["violations"][0]["input"] == "11", stats["violations"]
    assert stats["violations"][0]["error"] == "KeyError: 11"


def test_a_hung_input_is_a_finding_and_a_paused_run_is_not(monkeypatch):
    """An input that spins is stopped by the CPU-time alarm and reported as a hang; inputs that wait (sleep: the
    clock runs, the CPU does not) past both per-input limits are not findings; and a child paused (SIGSTOP) and
    continued (SIGCONT), as a long run is while a benchmark needs the machine quiet, finishes with no finding: the
    budgets are CPU time, not the clock's. (The pause alone could not tell: it mostly lands between inputs, in
    hypothesis's own code, so a clock-based per-input check passed it; the waiting inputs fail one.)"""
    import os
    import signal
    import threading
    import time

    from hypothesis import strategies as st

    import fuzz.__main__ as runner
    from fuzz import targets
    from tasks.training.hardware import process_cpu_seconds

    def spin(n, tmp):
        while n == 7:
            pass

    hang = targets.Target("hang", lambda: st.integers(0, 9), spin, lambda: (), "a planted hang")
    monkeypatch.setitem(targets.TARGETS, "hang", hang)
    monkeypatch.setattr(targets, "SECONDS_PER_INPUT", 0.1)
    stats = runner._child("hang", 100, 0)
    assert stats["violations"] and stats["violations"][0]["error"].startswith("Hang: no answer in 0.2 s")
    assert stats["violations"][0]["input"] == "7"

    def wait(n, tmp):
        time.sleep(0.25)  # past SECONDS_PER_INPUT (0.1) and the alarm (0.2) by the clock, ~0 CPU

    waits = targets.Target("waits", lambda: st.just(0), wait, lambda: (), "inputs that wait")
    monkeypatch.setitem(targets.TARGETS, "waits", waits)
    stats = runner._child("waits", 100, 60, until=3)  # one example a round (st.just), three rounds
    assert stats["violations"] == [] and stats["examples"] == 3, stats
    assert stats["wall_seconds"] >= 0.7 and stats["seconds"] < stats["wall_seconds"], stats

    def pause(proc_name: str) -> None:  # the run's child, once it is fuzzing (2 CPU s in): stopped for 3 s
        deadline = time.time() + 60
        while time.time() < deadline:
            for pid in os.listdir("/proc"):
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                try:
                    ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                if b"--child" in cmd and proc_name.encode() in cmd and ppid == os.getpid():  # this run's child
                    while process_cpu_seconds(int(pid)) < 2.0:  # past its imports (~1 CPU s), into the inputs
                        time.sleep(0.05)
                    os.kill(int(pid), signal.SIGSTOP)
                    time.sleep(3.0)
                    os.kill(int(pid), signal.SIGCONT)
                    return
            time.sleep(0.05)

    t = threading.Thread(target=pause, args=("safetensors",))
    t.start()
    # 2.5 CPU s of fuzzing (a parent budget of 2.5 + 60 + 30 CPU s), paused 3 s in between: the child's run and the
    # parent's watch (it polls the child's CPU time) come through the stop and continue (the clocks: the waits above)
    res = runner._run_target("safetensors", 100, 2.5)
    t.join()
    assert res["violations"] == [], res
    assert res["wall_seconds"] >= res["seconds"] + 2.5, res  # the pause happened while it ran


# ----------------------------------------------------------------------------- what the fuzzers found

HF = {
    "vocab_size": 300,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
}


@pytest.mark.parametrize(
    "change, key",
    [
        ({"rope_scaling": ["linear", 2]}, "rope_scaling"),  # was AttributeError: 'list' object has no attribute 'get'
        ({"rope_parameters": True}, "rope_parameters"),
        ({"intermediate_size": None}, "intermediate_size"),  # was ModelConfig's ValueError, naming no config key
        ({"max_position_embeddings": [-629]}, "max_position_embeddings"),
        ({"num_key_value_heads": "2"}, "num_key_value_heads"),
        ({"vocab_size": 300.5}, "vocab_size"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"rms_norm_eps": "1e-5"}, "rms_norm_eps"),  # was ValueError from float()
        ({"rope_theta": {}}, "rope_theta"),  # was TypeError from float()
        ({"rope_theta": float("nan")}, "rope_theta"),
        ({"initializer_range": [0.02]}, "initializer_range"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),  # was silently true
        ({"num_attention_heads": 3}, "config.json"),  # 16 is not divisible by 3: ModelConfig's reason, as ours
    ],
)
def test_a_malformed_config_json_field_is_one_conversion_error_naming_it(change, key):
    from model.convert import ConversionError, config_from_hf

    with pytest.raises(ConversionError) as err:
        config_from_hf({**HF, **change})
    assert str(err.value).startswith("config.json") and key in str(err.value), err.value


def test_a_config_json_that_is_not_an_object_is_a_conversion_error():
    from model.convert import ConversionError, config_from_hf

    for bad in ([], "llama", None, 3):
        with pytest.raises(ConversionError, match="must hold a JSON object"):
            config_from_hf(bad)


@pytest.mark.parametrize(
    "info, want",
    [
        ('0{"name": "llama"}', "not valid JSON"),  # was json.JSONDecodeError out of read_info
        ("[]", "no 'model' object"),
        ('{"model": {"vocab_size": "many"}}', "its model config does not hold"),  # was ModelConfig's ValueError
        ('{"model": {"layers": 1}}', "its model config does not hold"),
    ],
)
def test_a_resigned_model_json_that_does_not_hold_is_one_artifact_error(tmp_path, info, want):
    """model.json edited and its digest rewritten in the manifest (the fuzz target model_artifact's re-signing): the
    loaders (read_info, model_config, load_network) refuse it with one ArtifactError naming the file."""
    from fuzz.targets import _model_artifact
    from tasks.store.errors import ArtifactError

    with pytest.raises(ArtifactError, match=want) as err:
        _model_artifact((info, True, None), tmp_path)
    assert "model.json" in str(err.value)


@pytest.mark.parametrize(
    "patch, want",
    [
        ("tokens_count", "claims 4611686018427387904 items"),  # was a MemoryError out of gguf-py's reader
        ("tokens_uint8", "claims"),  # the same count over one-byte items
        ("kv_count", "metadata entries"),
    ],
)
def test_a_gguf_claiming_more_than_it_holds_is_refused_before_reading(tmp_path, patch, want):
    """A claimed count past the bytes left (`python -m fuzz gguf` found a metadata array of 2^62 items running the
    reader out of memory): one GGUFError naming the file, in bounded time and memory (model/gguf_header.py)."""
    import resource

    from fuzz.seeds import seeds
    from model.gguf import GGUFError, read_metadata

    data = bytearray((seeds() / "model.gguf").read_bytes())
    key = b"tokenizer.ggml.tokens"
    at = data.index(key) + len(key)  # then: type u32 (9: array), item type u32, count u64
    if patch == "tokens_count":
        data[at + 8 : at + 16] = (2**62).to_bytes(8, "little")
    elif patch == "tokens_uint8":
        data[at + 4 : at + 8] = (0).to_bytes(4, "little")
        data[at + 8 : at + 16] = (2**62).to_bytes(8, "little")
    else:
        data[16:24] = (2**40).to_bytes(8, "little")
    path = tmp_path / "crafted.gguf"
    path.write_bytes(bytes(data))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(GGUFError, match=want) as err:
        read_metadata(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    # no list or array sized by the claim (2^62 items): the peak grows by far less than a 100 MB (ru_maxrss: KiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000


@pytest.mark.parametrize(
    "files, want",
    [
        ([{"size": 1, "sha256": "0" * 64}], "files\\[0\\] has no path"),  # was KeyError: 'path' out of verify
        ({"model.json": 1}, "'files' is not a list"),
        ([{"path": "../../etc/passwd", "size": 1, "sha256": "0" * 64}], "not a path inside the artifact"),
        ([{"path": "/etc/passwd", "size": 1, "sha256": "0" * 64}], "not a path inside the artifact"),
        ([{"path": "model.json", "size": "1", "sha256": "0" * 64}], "files\\[0\\] has no size"),
    ],
)
def test_an_edited_manifest_file_list_is_one_artifact_error(tmp_path, files, want):
    """A manifest whose `files` entries lack their keys or point outside the artifact (`python -m fuzz
    model_artifact` found a KeyError out of ArtifactStore.verify): one ArtifactError naming the manifest."""
    from fuzz.seeds import model_artifact
    from fuzz.targets import _model_artifact
    from tasks.store.errors import ArtifactError

    m = json.loads((model_artifact() / "manifest.json").read_text())
    m["files"] = files
    info = (model_artifact() / "model.json").read_text()
    with pytest.raises(ArtifactError, match=want) as err:
        _model_artifact((info, False, json.dumps(m)), tmp_path)
    assert "manifest.json: corrupt manifest" in str(err.value)


@pytest.mark.parametrize(
    "text, where, key",
    [
        ("0: a\npipelines: {p: {}}\n", "", "0 is a number"),  # was TypeError in difflib ("did you mean")
        ("pipelines: {0: {}}\n", "pipelines: ", "0 is a number"),
        ("pipelines: {p: {data: {1.5: x}}}\n", "pipelines.p.data: ", "1.5 is a number"),
        (
            "pipelines:\n  p:\n    data:\n      sources: [{true: 1}]\n",
            "pipelines.p.data.sources[0]: ",
            "True is a boolean",
        ),
        ("pipelines: {p: {pretrain: {null: 1}}}\n", "pipelines.p.pretrain: ", "None is a null"),
    ],
)
def test_a_key_that_is_not_text_is_one_config_error_naming_where(tmp_path, text, where, key):
    """fuzz/ target pipelines (s61): a mutated pipelines.yaml whose document began `0: ...` reached the unknown-key
    hint's difflib with an int and raised TypeError; every mapping key anywhere is now checked to be text first."""
    from tasks.config.loader import resolve_pipeline
    from tasks.config.schema import ConfigError

    path = tmp_path / "pipelines.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        resolve_pipeline(path, "p", [])
    assert str(err.value) == f"{path}: {where}the key {key}, " + (
        "not text (YAML reads unquoted keys such as `0:`, `1.5:`, `true:` or `null:` so); quote it or rename it"
    )
