"""pipelines.yaml schema: the shipped file validates; bad configs fail with their YAML path and a fix."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tasks.config.loader import resolve_pipeline, validate_file
from tasks.config.schema import ConfigError

REPO = Path(__file__).resolve().parent.parent
CORPUS = str(REPO / "data/corpora/tinyshakespeare.txt")


def _base() -> dict:
    return {
        "model": {"name": "llama", "preset": "tiny"},
        "data": {"sources": [CORPUS], "seq_length": 64, "tokenizer": {"vocab_size": 512}},
        "pretrain": {"train": {"loop": {"max_steps": 10}}},
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
    f = _write(
        tmp_path, _base(), extra={"child": {"base": "p", "pretrain": {"train": {"loop": {"micro_batch_size": 4}}}}}
    )
    cfg = resolve_pipeline(f, "child", ["pretrain.train.loop.max_steps=17", "eval.tasks=[arc_easy, piqa]"])
    assert cfg.pretrain.train.loop.micro_batch_size == 4  # from the child
    assert cfg.pretrain.train.loop.max_steps == 17  # from --set
    assert cfg.data.seq_length == 64  # inherited from the base
    assert cfg.eval.tasks == ["arc_easy", "piqa"]  # YAML-parsed list
    assert cfg.name == "child"


BAD = [
    # (override, expected substrings)
    (
        {"pretrain": {"train": {"loop": {"max_stpes": 5}}}},
        ["pipelines.p.pretrain.train.loop.max_stpes", "unknown key", "did you mean 'max_steps'"],
    ),
    ({"modle": {}}, ["pipelines.p.modle", "did you mean 'model'"]),
    (
        {"pretrain": {"train": {"loop": {"max_steps": "many"}}}},
        ["pipelines.p.pretrain.train.loop.max_steps", "valid integer"],
    ),
    (
        {"pretrain": {"train": {"loop": {"micro_batch_size": 0}}}},
        ["pipelines.p.pretrain.train.loop.micro_batch_size", "out of range", "greater than 0"],
    ),
    ({"pretrain": {"train": {"optimizer": {"lr": -1.0}}}}, ["pipelines.p.pretrain.train.optimizer.lr", "out of range"]),
    (
        {"pretrain": {"train": {"precision": {"dtype": "fp8"}}}},
        ["pipelines.p.pretrain.train.precision.dtype", "'fp8' is not allowed", "'fp32'"],
    ),
    (
        {"parallel": {"data_parallel": 2, "tensor_parallel": 2, "device_num": 2}},
        ["pipelines.p.parallel.device_num", "2×2 = 4", "set device_num: 4"],
    ),
    (
        {"plan": {"pipeline_parallel": 2, "micro_batch_num": 1}},
        ["pipelines.p.plan.micro_batch_num", "set micro_batch_num >= 2"],
    ),
    ({"data": {"seq_length": 4096}}, ["pipelines.p.data.seq_length", "max_seq_length=128"]),
    ({"model": {"num_kv_heads": 3}}, ["num_heads", "num_kv_heads"]),
    (
        {"parallel": {"tensor_parallel": 8, "device_num": 8}},
        ["pipelines.p.parallel.tensor_parallel", "must divide num_heads=4"],
    ),
    ({"data": {"sources": ["no/such/corpus.txt"]}}, ["pipelines.p.data.sources[0]", "matches no file", "fix the path"]),
    (
        {"data": {"tokenizer": {"path": "missing/tokenizer.model"}}},
        ["pipelines.p.data.tokenizer.path", "does not exist"],
    ),
    ({"model": {"preset": "huge"}}, ["pipelines.p.model.preset", "unknown preset 'huge'"]),
    ({"data": {"tokenizer": {"vocab_size": 1024}}}, ["pipelines.p.data.tokenizer.vocab_size", "vocab_size=512"]),
    (
        {"pretrain": {"train": {"loop": {"max_steps": 10}, "schedule": {"warmup_steps": 20}}}},
        ["pipelines.p.pretrain.train.schedule.warmup_steps", "> max_steps=10"],
    ),
    (
        {"pretrain": {"train": {"optimizer": {"lr": 1e-4, "min_lr": 1e-3}}}},
        ["pipelines.p.pretrain.train.optimizer.min_lr", "must be <= lr"],
    ),
    (
        {"pretrain": {"train": {"precision": {"dtype": "bf16"}}}},
        ["pipelines.p.pretrain.train.precision.dtype", "no MindSpore CPU kernels", "use fp32 on CPU"],
    ),
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
    f = _write(tmp_path, _merge(_base(), {"pretrain": {"train": {"loop": {"max_steps": 0, "micro_batch_size": -1}}}}))
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
        resolve_pipeline(f, overrides=["pretrain.train.loop.max_steps"])
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.train.loop.max_steps.*valid integer"):
        resolve_pipeline(f, overrides=["pretrain.train.loop.max_steps=abc"])


def test_config_module_imports_without_mindspore():
    code = (
        "import sys, tasks.config, tasks.cli, tasks.store.artifacts; "
        "assert 'mindspore' not in sys.modules, 'mindspore imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_cli_validate_exit_codes(tmp_path):
    f = _write(tmp_path, _merge(_base(), {"pretrain": {"train": {"loop": {"max_stpes": 1}}}}))
    bad = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "validate", "--config", str(f)], capture_output=True, text=True, cwd=REPO
    )
    assert bad.returncode == 2
    assert "pipelines.p.pretrain.train.loop.max_stpes" in bad.stderr and "Traceback" not in bad.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "validate", "--config", str(REPO / "pipelines.yaml"), "--pipeline", "tiny"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert ok.returncode == 0, ok.stderr
    assert "pipeline 'tiny' is valid" in ok.stdout


# ----------------------------------------------------------------------------- issue 27: YAML 1.2 scalars, one budget


def _write_text(tmp_path: Path, pretrain_lines: str, extra: str = "") -> Path:
    f = tmp_path / "pipelines.yaml"
    f.write_text(
        f"default: p\npipelines:\n  p:\n{extra}    model: {{name: llama, preset: tiny}}\n"
        f"    data: {{sources: ['{CORPUS}'], seq_length: 64, tokenizer: {{vocab_size: 512}}}}\n"
        "    pretrain:\n      train:\n        loop:\n"
        + "".join("    " + ln + "\n" for ln in pretrain_lines.splitlines())
    )
    return f


def test_base_60_is_not_a_number_in_the_file_or_in_set(tmp_path):
    """YAML 1.1 read `1:20` as 80 (base 60): the run trained 80 steps. YAML 1.2 reads text, which fails."""
    f = _write_text(tmp_path, "      max_steps: 1:20\n")
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    assert "pipelines.p.pretrain.train.loop.max_steps" in str(ei.value) and "base-60" in str(ei.value), str(ei.value)
    f = _write_text(tmp_path, "      max_steps: 20\n")
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.train.loop.max_steps.*'1:20'.*base-60"):
        resolve_pipeline(f, overrides=["pretrain.train.loop.max_steps=1:20"])


def test_yaml_1_2_scalars(tmp_path):
    from tasks.config.yaml12 import load_yaml

    assert load_yaml("[010, 0x10, 0o17, 1_000, 1e-3, true, False, ~]") == [10, 16, 15, 1000, 1e-3, True, False, None]
    # YAML 1.1 booleans, base-60 numbers, binary and dates are text
    assert load_yaml("[yes, no, on, off, y, n, 1:20, 0b101, 2024-01-01]") == [
        "yes",
        "no",
        "on",
        "off",
        "y",
        "n",
        "1:20",
        "0b101",
        "2024-01-01",
    ]
    f = _write_text(tmp_path, "      max_steps: 010\n", extra="    description: 2024-01-01\n")
    cfg = resolve_pipeline(f, overrides=["eval.prompts=[on, off, yes]", "eval.stop=[no]"])
    assert cfg.pretrain.train.loop.max_steps == 10 and cfg.description == "2024-01-01"
    assert cfg.eval.prompts == ["on", "off", "yes"] and cfg.eval.stop == ["no"]
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.recompute.*'yes' is text.*true and false"):
        resolve_pipeline(f, overrides=["pretrain.recompute=yes"])


def test_max_steps_and_max_tokens_both_in_the_file_is_an_error(tmp_path):
    f = _write_text(tmp_path, "      max_steps: 20\n      max_tokens: 1024\n")
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    msg = str(ei.value)
    assert (
        "pipelines.p.pretrain.train.loop.max_tokens" in msg
        and "pretrain.train.loop.max_steps (20)" in msg
        and "keep one" in msg
    ), msg
    with pytest.raises(ConfigError, match="both pretrain.train.loop.max_steps"):  # both in --set: the same error
        resolve_pipeline(
            _write_text(tmp_path, "      max_steps: 20\n"),
            overrides=["pretrain.train.loop.max_steps=5", "pretrain.train.loop.max_tokens=1024"],
        )


def test_set_budget_replaces_the_files_other_budget(tmp_path):
    from tasks.training.schedule import budget_line, training_steps

    f = _write_text(tmp_path, "      max_steps: 20\n      micro_batch_size: 8\n")
    cfg = resolve_pipeline(f, overrides=["pretrain.train.loop.max_tokens=1024"])
    assert (cfg.pretrain.train.loop.max_steps, cfg.pretrain.train.loop.max_tokens) == (None, 1024)
    assert training_steps(cfg.pretrain.train.loop, 64) == 2  # 1024 tokens / (8 × 64), not the file's 20 steps
    assert "max_tokens = 1024 tokens = 2 steps" in budget_line(cfg.pretrain.train.loop, 64)
    assert (
        len(cfg.notes) == 1
        and "--set pretrain.train.loop.max_tokens=1024 replaces pipelines.p.pretrain.train.loop.max_steps"
        in cfg.notes[0]
    )
    f = _write_text(tmp_path, "      max_tokens: 4096\n")
    cfg = resolve_pipeline(f, overrides=["pretrain.train.loop.max_steps=30"])
    assert (cfg.pretrain.train.loop.max_steps, cfg.pretrain.train.loop.max_tokens) == (30, None) and training_steps(
        cfg.pretrain.train.loop, 64
    ) == 30
    assert "replaces pipelines.p.pretrain.train.loop.max_tokens" in cfg.notes[0]
    assert resolve_pipeline(f).notes == []
    # a pipeline's own budget replaces its base's other one, in the same way
    f = _write(tmp_path, _base(), extra={"child": {"base": "p", "pretrain": {"train": {"loop": {"max_tokens": 640}}}}})
    cfg = resolve_pipeline(f, "child")
    assert (cfg.pretrain.train.loop.max_steps, cfg.pretrain.train.loop.max_tokens) == (None, 640)


def test_cli_says_which_budget_is_used(tmp_path):
    f = _write_text(tmp_path, "      max_steps: 20\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tasks.cli",
            "validate",
            "--config",
            str(f),
            "--set",
            "pretrain.train.loop.max_tokens=1024",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    assert (
        "note: --set pretrain.train.loop.max_tokens=1024 replaces pipelines.p.pretrain.train.loop.max_steps"
        in out.stderr
    )
    assert "max_tokens: 1024" in out.stdout and "max_steps: null" in out.stdout


# ----------------------------------------------------------------------------- issue 26: one train section


def test_old_keys_are_errors_naming_the_new_key(tmp_path):
    """The shape before issue 26 is refused with a one-line migration, never reinterpreted."""
    body = _merge(
        _base(),
        {
            "pretrain": {"max_steps": 5, "optimizer": {"lr": 1e-3}},
            "finetune": {"lr": 1e-2, "warmup_steps": 1},
            "continued": {"max_steps": 4},
            "parallel": {"pipeline_parallel": 2},
        },
    )
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(_write(tmp_path, body))
    msg = str(ei.value)
    for old, new in (
        ("pretrain.max_steps", "pretrain.train.loop.max_steps"),
        ("pretrain.optimizer", "pretrain.train.optimizer"),
        ("finetune.lr", "finetune.train.optimizer.lr"),
        ("finetune.warmup_steps", "finetune.train.schedule.warmup_steps"),
        ("continued.max_steps", "continued.train.loop.max_steps"),
        ("parallel.pipeline_parallel", "plan.pipeline_parallel"),
    ):
        assert f"pipelines.p.{old}: moved to {new}" in msg, msg
    with pytest.raises(ConfigError, match=r"pipelines.p.pretrain.precision: moved to pretrain.train.precision.dtype"):
        resolve_pipeline(_write(tmp_path, _base()), overrides=["pretrain.precision=fp16"])  # --set too


def test_finetune_inherits_only_the_listed_pretrain_keys(tmp_path):
    """A pretrain-only setting (lr, warmup, budget, accumulation, precision, weight decay) never leaks into
    finetune; the keys of FINETUNE_INHERITS do, unless finetune sets them."""
    from tasks.config.schema import FINETUNE_INHERITS

    assert "optimizer.lr" not in FINETUNE_INHERITS and "loop.max_steps" not in FINETUNE_INHERITS
    pre = {
        "optimizer": {"lr": 5e-2, "min_lr": 1e-3, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.3},
        "schedule": {"warmup_steps": 7},
        "loop": {"max_steps": 10, "gradient_accumulation": 3, "grad_clip": 0.5, "peak_flops": 1e11},
        "fused_kernels": False,
    }
    f = _write(tmp_path, _merge(_base(), {"pretrain": {"train": pre}}))
    ft = resolve_pipeline(f).finetune.train
    assert (ft.optimizer.lr, ft.optimizer.min_lr, ft.optimizer.weight_decay) == (1e-3, None, 0.0)  # finetune's own
    assert ft.optimizer.final_lr == 1e-4 and ft.schedule.warmup_steps == 5
    assert (ft.loop.max_steps, ft.loop.gradient_accumulation, ft.loop.save_steps) == (50, 1, 50)
    assert (ft.optimizer.beta2, ft.optimizer.eps, ft.loop.grad_clip, ft.loop.peak_flops) == (0.99, 1e-6, 0.5, 1e11)
    assert ft.fused_kernels is False  # inherited on purpose (FINETUNE_INHERITS)
    ft = resolve_pipeline(
        f, overrides=["finetune.train.optimizer.beta2=0.9", "finetune.train.loop.max_tokens=512"]
    ).finetune.train
    assert ft.optimizer.beta2 == 0.9 and (ft.loop.max_steps, ft.loop.max_tokens) == (None, 512)  # its own budget wins


def test_continued_inherits_all_of_pretrain_train(tmp_path):
    f = _write(
        tmp_path,
        _merge(
            _base(),
            {
                "pretrain": {
                    "train": {
                        "optimizer": {"lr": 2e-3, "min_lr": 2e-4},
                        "loop": {"max_tokens": 4096, "max_steps": None},
                    }
                },
                "continued": {"train": {"loop": {"max_steps": 6}, "schedule": {"warmup_steps": 1}}},
            },
        ),
    )
    cfg = resolve_pipeline(f)
    ct = cfg.continued.train
    assert (ct.optimizer.lr, ct.optimizer.min_lr, ct.schedule.warmup_steps) == (2e-3, 2e-4, 1)
    assert (ct.loop.max_steps, ct.loop.max_tokens) == (6, None)  # continued's budget replaces pretrain's other one
    run = cfg.for_continued(["x.txt"])
    assert run.pretrain.train == ct and run.data.sources == ["x.txt"]
    with pytest.raises(ConfigError, match=r"pipelines.p.continued.train.optimizer.min_lr: 0.0002 > lr=0.0001"):
        resolve_pipeline(f, overrides=["continued.train.optimizer.lr=1e-4"])


def test_an_inherited_error_is_reported_once(tmp_path):
    f = _write(
        tmp_path,
        _merge(_base(), {"pretrain": {"train": {"optimizer": {"eps": -1.0}, "schedule": {"warmup_steps": 20}}}}),
    )
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    assert len(ei.value.errors) == 1 and "pipelines.p.pretrain.train.optimizer.eps" in ei.value.errors[0]
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(_write(tmp_path, _merge(_base(), {"pretrain": {"train": {"schedule": {"warmup_steps": 20}}}})))
    assert ei.value.errors == [
        "pipelines.p.pretrain.train.schedule.warmup_steps: 20 > max_steps=10; warmup must fit in the run"
    ]


def test_finetune_trains_in_fp32(tmp_path):
    f = _write(tmp_path, _base())
    with pytest.raises(ConfigError, match="pipelines.p.finetune.train.precision.dtype: fine-tuning trains in fp32"):
        resolve_pipeline(f, overrides=["finetune.train.precision.dtype=fp16"])


# ----------------------------------------------------------------------------- issue 35: YAML alias bombs, size caps


def _laughs(levels: int) -> str:
    """A "billion laughs": each anchor a list of ten aliases of the one before (10**levels strings)."""
    parts = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, levels):
        parts.append(f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    return "[" + ", ".join(parts) + "]"


def _bomb_file(tmp_path: Path, levels: int) -> Path:
    f = tmp_path / "pipelines.yaml"
    f.write_text(
        f"default: p\npipelines:\n  p:\n    model: {{name: llama, preset: tiny}}\n"
        f"    data:\n      seq_length: 64\n      tokenizer: {{vocab_size: 512}}\n"
        f"      sources: {_laughs(levels)}\n    pretrain: {{train: {{loop: {{max_steps: 10}}}}}}\n"
    )
    return f


def _validate(*args: str, timeout: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    import time

    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "tasks.cli", "validate", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
    )
    return out, time.monotonic() - t0


def test_alias_bomb_in_the_file_is_refused_before_it_expands(tmp_path):
    """A billion laughs in data.sources ran validation for more than 60 s; now composing stops at the alias that
    passes the limit, naming the file, its line and the limit."""
    from tasks.config.yaml12 import MAX_ALIAS_NODES

    f = _bomb_file(tmp_path, 5)  # 10**5 strings: few enough to finish (wrongly: a type error) before the limit existed
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f)
    msg = str(ei.value)
    assert f"{f}:8: alias *a" in msg and f"past {MAX_ALIAS_NODES:,} nodes" in msg and "fewer levels" in msg, msg
    out, took = _validate("--config", str(_bomb_file(tmp_path, 10)))  # 10**10: hours of validation before
    assert out.returncode == 2 and "Traceback" not in out.stderr and f"past {MAX_ALIAS_NODES:,} nodes" in out.stderr
    assert took < 20, took


def test_alias_bomb_in_set_and_a_recursive_alias_are_refused(tmp_path):
    f = _write(tmp_path, _base())
    with pytest.raises(ConfigError, match=r"^--set data.sources: alias \*a\d in VALUE expands the document past"):
        resolve_pipeline(f, overrides=[f"data.sources={_laughs(5)}"])
    with pytest.raises(ConfigError, match=r"--set data.sources: alias \*r in VALUE refers to a node that contains it"):
        resolve_pipeline(f, overrides=["data.sources=&r [a, *r]"])
    f.write_text(f.read_text() + "  q: &loop {base: p, eval: *loop}\n")
    with pytest.raises(ConfigError, match=r"pipelines.yaml:\d+: alias \*loop refers to a node that contains it"):
        resolve_pipeline(f)


def test_aliases_within_the_limit_still_work(tmp_path):
    src = yaml.safe_dump([CORPUS], default_flow_style=True).strip()
    f = tmp_path / "pipelines.yaml"
    f.write_text(
        "default: p\npipelines:\n  p:\n    model: &m {name: llama, preset: tiny}\n"
        f"    data: {{sources: &s {src}, seq_length: 64, tokenizer: {{vocab_size: 512}}}}\n"
        "    pretrain: {train: {loop: {max_steps: 10}}}\n    continued: {sources: *s}\n"
        "  q: {base: p, model: {<<: *m, preset: tiny}}\n"
    )
    assert resolve_pipeline(f, "q").continued.sources == [CORPUS]


def test_a_huge_file_or_set_value_is_refused_before_parsing(tmp_path):
    """A 50 MB description gave no answer in 120 s (PyYAML's pure-Python scanner). Now the size is checked
    first: one line naming the file (or --set key) and the limit."""
    from tasks.config.yaml12 import MAX_FILE_BYTES, MAX_SET_BYTES

    f = _write(tmp_path, _base())
    with f.open("a") as fh:
        fh.write("# " + "c" * MAX_FILE_BYTES + "\n")  # comments count: 50 MB of them took 54 s
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(f))}: [\d,]+ bytes, over the {MAX_FILE_BYTES // 1024} KiB limit"
    ):
        resolve_pipeline(f)
    huge = tmp_path / "huge.yaml"
    with huge.open("w") as fh:
        fh.write("default: p\npipelines:\n  p:\n    description: ")
        for _ in range(50):
            fh.write("a" * (1 << 20))
    out, took = _validate("--config", str(huge))
    assert out.returncode == 2 and f"{huge}: 52,428,8" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert took < 20, took
    with pytest.raises(
        ConfigError, match=rf"^--set description: [\d,]+ characters, over the {MAX_SET_BYTES // 1024} KiB"
    ):
        resolve_pipeline(_write(tmp_path, _base()), overrides=["description=" + "a" * MAX_SET_BYTES])


def test_eval_batch_size_past_what_a_scoring_call_holds_is_refused(tmp_path):
    """eval.batch_size 10**6 validated; the scorer silently clamped it to what 1 GiB of activations holds."""
    from model.config import ModelConfig

    cap = ModelConfig.from_name("tiny").scoring_rows(1, 10**9)  # rows of one token: the most one call takes
    assert 8 < cap < 10**6
    f = _write(tmp_path, _base())
    with pytest.raises(ConfigError) as ei:
        resolve_pipeline(f, overrides=["eval.batch_size=1000000"])
    msg = str(ei.value)
    assert msg.startswith("pipelines.p.eval.batch_size: 1000000 rows per scoring call") and f"at most {cap} rows" in msg
    assert msg.endswith(f"set eval.batch_size at most {cap}"), msg
    assert resolve_pipeline(f, overrides=[f"eval.batch_size={cap}"]).eval.batch_size == cap
