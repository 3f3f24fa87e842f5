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
    assert {"tiny", "demo"} <= set(results)
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
