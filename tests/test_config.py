"""pipelines.yaml schema: the shipped file validates; bad configs fail with their YAML path and a fix."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config import ConfigError, resolve_pipeline, validate_file

REPO = Path(__file__).resolve().parent.parent
CORPUS = str(REPO / "data/corpora/tinyshakespeare.txt")


def _base() -> dict:
    return {
        "model": {"name": "llama", "preset": "tiny"},
        "data": {"sources": [CORPUS], "seq_length": 64, "tokenizer": {"vocab_size": 512}},
        "pretrain": {"max_steps": 10},
    }


def _write(tmp_path: Path, body: dict, name: str = "p", extra: dict | None = None) -> Path:
    doc = {"default": name, "pipelines": {name: body, **(extra or {})}}
    f = tmp_path / "pipelines.yaml"
    f.write_text(yaml.safe_dump(doc))
    return f


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def test_shipped_pipelines_validate():
    results = validate_file(REPO / "pipelines.yaml")
    assert {"tiny", "demo", "smollm2"} <= set(results)
    if not (REPO / "models/SmolLM2-135M-Instruct.Q4_1.gguf").exists():  # a fresh clone: says how to fetch it
        errs = results.pop("smollm2")
        assert len(errs) == 1 and "pretrain.init_from" in errs[0] and "scripts/fetch_smollm2.sh" in errs[0], errs
    assert all(not errs for errs in results.values()), results


def test_base_inheritance_and_set_overrides(tmp_path):
    f = _write(tmp_path, _base(), extra={"child": {"base": "p", "pretrain": {"micro_batch_size": 4}}})
    cfg = resolve_pipeline(f, "child", ["pretrain.max_steps=17", "eval.tasks=[arc_easy, piqa]"])
    assert cfg.pretrain.micro_batch_size == 4  # from the child
    assert cfg.pretrain.max_steps == 17  # from --set
    assert cfg.data.seq_length == 64  # inherited from the base
    assert cfg.eval.tasks == ["arc_easy", "piqa"]  # YAML-parsed list
    assert cfg.name == "child"


BAD = [
    # (override, expected substrings)
    ({"pretrain": {"max_stpes": 5}}, ["pipelines.p.pretrain.max_stpes", "unknown key", "did you mean 'max_steps'"]),
    ({"modle": {}}, ["pipelines.p.modle", "did you mean 'model'"]),
    ({"pretrain": {"max_steps": "many"}}, ["pipelines.p.pretrain.max_steps", "valid integer"]),
    ({"pretrain": {"micro_batch_size": 0}}, ["pipelines.p.pretrain.micro_batch_size", "out of range", "greater than 0"]),
    ({"pretrain": {"optimizer": {"lr": -1.0}}}, ["pipelines.p.pretrain.optimizer.lr", "out of range"]),
    ({"pretrain": {"precision": "fp8"}}, ["pipelines.p.pretrain.precision", "'fp8' is not allowed", "'fp32'"]),
    (
        {"parallel": {"data_parallel": 2, "tensor_parallel": 2, "device_num": 2}},
        ["pipelines.p.parallel.device_num", "2×2×1 = 4", "set device_num: 4"],
    ),
    (
        {"parallel": {"pipeline_parallel": 2, "micro_batch_num": 1, "device_num": 2}},
        ["pipelines.p.parallel.micro_batch_num", "set micro_batch_num >= 2"],
    ),
    ({"data": {"seq_length": 4096}}, ["pipelines.p.data.seq_length", "max_seq_length=128"]),
    ({"model": {"num_kv_heads": 3}}, ["num_heads", "num_kv_heads"]),
    (
        {"parallel": {"tensor_parallel": 8, "device_num": 8}},
        ["pipelines.p.parallel.tensor_parallel", "must divide num_heads=4"],
    ),
    ({"data": {"sources": ["no/such/corpus.txt"]}}, ["pipelines.p.data.sources[0]", "matches no file", "fix the path"]),
    ({"data": {"tokenizer": {"path": "missing/tokenizer.model"}}}, ["pipelines.p.data.tokenizer.path", "does not exist"]),
    ({"model": {"preset": "huge"}}, ["pipelines.p.model.preset", "unknown preset 'huge'"]),
    ({"data": {"tokenizer": {"vocab_size": 1024}}}, ["pipelines.p.data.tokenizer.vocab_size", "vocab_size=512"]),
    ({"pretrain": {"max_steps": 10, "schedule": {"warmup_steps": 20}}}, ["pipelines.p.pretrain.schedule.warmup_steps", "> max_steps=10"]),
    ({"pretrain": {"optimizer": {"lr": 1e-4, "min_lr": 1e-3}}}, ["pipelines.p.pretrain.optimizer.min_lr", "must be <= lr"]),
    ({"pretrain": {"precision": "bf16"}}, ["pipelines.p.pretrain.precision", "no MindSpore CPU kernels", "use fp32 on CPU"]),
    ({"finetune": {"lora": {"target_modules": ["q_prj"]}}}, ["target_modules[0]", "did you mean 'q_proj'"]),
    ({"checkpoint": {"keep_checkpoint_max": 0}}, ["pipelines.p.checkpoint.keep_checkpoint_max", "out of range"]),
    ({"data": {"validation_fraction": 0.0}}, ["pipelines.p.data.validation_fraction", "no held-out split"]),
    ({"pretrain": {"replay_ratio": 0.2}}, ["pipelines.p.pretrain.replay_ratio", "init_from"]),
    ({"parallel": {"master_port": 80}}, ["pipelines.p.parallel.master_port", "out of range"]),
    ({"data": {"sources": "data/corpora/tinyshakespeare.txt"}}, ["pipelines.p.data.sources", "valid list"]),
]


@pytest.mark.parametrize("override,expected", BAD, ids=[next(iter(o)) + str(i) for i, (o, _) in enumerate(BAD)])
def test_bad_config_names_path_and_fix(tmp_path, override, expected):
    f = _write(tmp_path, _merge(_base(), override))
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    msg = str(ei.value)
    for s in expected:
        assert s in msg, f"{s!r} not in:\n{msg}"


def test_all_errors_reported_together(tmp_path):
    f = _write(tmp_path, _merge(_base(), {"pretrain": {"max_steps": 0, "micro_batch_size": -1}}))
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    assert len(ei.value.errors) == 2


def test_unknown_pipeline_and_cycle(tmp_path):
    f = _write(tmp_path, _base(), extra={"a": {"base": "b"}, "b": {"base": "a"}})
    with pytest.raises(ConfigError, match="no pipeline named 'dmeo'"):
        resolve_pipeline(f, "dmeo")
    with pytest.raises(ConfigError, match="circular 'base:' chain a -> b -> a"):
        resolve_pipeline(f, "a")


def test_bad_set_override(tmp_path):
    f = _write(tmp_path, _base())
    with pytest.raises(ConfigError, match="expected dotted.key=VALUE"):
        resolve_pipeline(f, overrides=["pretrain.max_steps"])
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.max_steps.*valid integer"):
        resolve_pipeline(f, overrides=["pretrain.max_steps=abc"])


def test_config_module_imports_without_mindspore():
    code = "import sys, tasks.config, tasks.cli, tasks.store.artifacts; assert 'mindspore' not in sys.modules, 'mindspore imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_validate_exit_codes(tmp_path):
    f = _write(tmp_path, _merge(_base(), {"pretrain": {"max_stpes": 1}}))
    bad = subprocess.run([sys.executable, "-m", "tasks.cli", "validate", "--config", str(f)], capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2
    assert "pipelines.p.pretrain.max_stpes" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "validate", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny"],
        capture_output=True, text=True, cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    assert "pipeline 'tiny' is valid" in ok.stdout


# ----------------------------------------------------------------------------- issue 27: YAML 1.2 scalars, one budget


def _write_text(tmp_path: Path, pretrain_lines: str, extra: str = "") -> Path:
    f = tmp_path / "pipelines.yaml"
    f.write_text(f"default: p\npipelines:\n  p:\n{extra}    model: {{name: llama, preset: tiny}}\n"
                 f"    data: {{sources: ['{CORPUS}'], seq_length: 64, tokenizer: {{vocab_size: 512}}}}\n"
                 f"    pretrain:\n{pretrain_lines}")
    return f


def test_base_60_is_not_a_number_in_the_file_or_in_set(tmp_path):
    """YAML 1.1 read `1:20` as 80 (base 60): the run trained 80 steps. YAML 1.2 reads text, which fails."""
    f = _write_text(tmp_path, "      max_steps: 1:20\n")
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    assert "pipelines.p.pretrain.max_steps" in str(ei.value) and "base-60" in str(ei.value), str(ei.value)
    f = _write_text(tmp_path, "      max_steps: 20\n")
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.max_steps.*'1:20'.*base-60"):
        resolve_pipeline(f, overrides=["pretrain.max_steps=1:20"])


def test_yaml_1_2_scalars(tmp_path):
    from tasks.config import load_yaml

    assert load_yaml("[010, 0x10, 0o17, 1_000, 1e-3, true, False, ~]") == [10, 16, 15, 1000, 1e-3, True, False, None]
    # YAML 1.1 booleans, base-60 numbers, binary and dates are text
    assert load_yaml("[yes, no, on, off, y, n, 1:20, 0b101, 2024-01-01]") == [
        "yes", "no", "on", "off", "y", "n", "1:20", "0b101", "2024-01-01"]
    f = _write_text(tmp_path, "      max_steps: 010\n", extra="    description: 2024-01-01\n")
    cfg = resolve_pipeline(f, overrides=["eval.prompts=[on, off, yes]", "eval.stop=[no]"])
    assert cfg.pretrain.max_steps == 10 and cfg.description == "2024-01-01"
    assert cfg.eval.prompts == ["on", "off", "yes"] and cfg.eval.stop == ["no"]
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.recompute.*'yes' is text.*true and false"):
        resolve_pipeline(f, overrides=["pretrain.recompute=yes"])


def test_max_steps_and_max_tokens_both_in_the_file_is_an_error(tmp_path):
    f = _write_text(tmp_path, "      max_steps: 20\n      max_tokens: 1024\n")
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    msg = str(ei.value)
    assert "pipelines.p.pretrain.max_tokens" in msg and "pretrain.max_steps (20)" in msg and "keep one" in msg, msg
    with pytest.raises(ConfigError, match="both pretrain.max_steps"):  # both in --set: the same error
        resolve_pipeline(_write_text(tmp_path, "      max_steps: 20\n"),
                         overrides=["pretrain.max_steps=5", "pretrain.max_tokens=1024"])


def test_set_budget_replaces_the_files_other_budget(tmp_path):
    from tasks.stages.pretrain import budget_line, training_steps

    f = _write_text(tmp_path, "      max_steps: 20\n      micro_batch_size: 8\n")
    cfg = resolve_pipeline(f, overrides=["pretrain.max_tokens=1024"])
    assert (cfg.pretrain.max_steps, cfg.pretrain.max_tokens) == (None, 1024)
    assert training_steps(cfg.pretrain, 64) == 2  # 1024 tokens / (8 × 64), not the file's 20 steps
    assert "max_tokens = 1024 tokens = 2 steps" in budget_line(cfg.pretrain, 64)
    assert len(cfg.notes) == 1 and "--set pretrain.max_tokens=1024 replaces pipelines.p.pretrain.max_steps" in cfg.notes[0]
    f = _write_text(tmp_path, "      max_tokens: 4096\n")
    cfg = resolve_pipeline(f, overrides=["pretrain.max_steps=30"])
    assert (cfg.pretrain.max_steps, cfg.pretrain.max_tokens) == (30, None) and training_steps(cfg.pretrain, 64) == 30
    assert "replaces pipelines.p.pretrain.max_tokens" in cfg.notes[0]
    assert resolve_pipeline(f).notes == []
    # a pipeline's own budget replaces its base's other one, in the same way
    f = _write(tmp_path, _base(), extra={"child": {"base": "p", "pretrain": {"max_tokens": 640}}})
    cfg = resolve_pipeline(f, "child")
    assert (cfg.pretrain.max_steps, cfg.pretrain.max_tokens) == (None, 640)


def test_cli_says_which_budget_is_used(tmp_path):
    f = _write_text(tmp_path, "      max_steps: 20\n")
    out = subprocess.run([sys.executable, "-m", "tasks.cli", "validate", "--config", str(f), "--set",
                          "pretrain.max_tokens=1024"], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "note: --set pretrain.max_tokens=1024 replaces pipelines.p.pretrain.max_steps" in out.stderr
    assert "max_tokens: 1024" in out.stdout and "max_steps: null" in out.stdout
