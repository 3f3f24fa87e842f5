"""scripts/bench/report.py and host.py: results lines become docs tables; --isa avx2 caps every library named."""

from __future__ import annotations

import argparse
import json

from helpers import load_bench

report = load_bench("report")
host = load_bench("host")


def test_record_appends_the_printed_line_with_its_tag(tmp_path, capsys):
    out = tmp_path / "r.jsonl"
    report.record({"bench": "train", "tokens_per_s": 1.5}, argparse.Namespace(results=str(out), tag="smoke"))
    report.record({"bench": "train", "tokens_per_s": 2.5}, argparse.Namespace(results=str(out), tag=""))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines == [{"bench": "train", "tokens_per_s": 1.5, "tag": "smoke"}, {"bench": "train", "tokens_per_s": 2.5}]
    assert capsys.readouterr().out.splitlines()[0] == json.dumps(lines[0])


def test_render_one_table_per_bench_newest_first_with_nested_figures():
    rows = [
        {
            "bench": "train",
            "date": "2026-12-01",
            "cpu": "X",
            "cpu_isa": "avx512",
            "threads": 2,
            "tokens_per_s": 100.0,
            "hf": {"sdpa": {"tokens_per_s": 50.0}, "compile": {"error": "a | b"}},
        },
        {
            "bench": "train",
            "date": "2026-12-02",
            "cpu": "X",
            "cpu_isa": "avx512",
            "emulated_isa": "avx2",
            "threads": 2,
            "tokens_per_s": 80.0,
            "hf": {"sdpa": {"tokens_per_s": 40.0}},
        },
        {"bench": "other", "date": "2026-12-02", "figure": 3, "nested": {"x": 1}},
    ]
    md = report.render(rows, "r.jsonl")
    train = md.split("## train")[1].split("## ")[0]
    body = [x for x in train.splitlines() if x.startswith("| 2026")]
    assert body[0].startswith("| 2026-12-02") and "avx2" in body[0] and "| 80 |" in body[0]
    assert "| 100 | 50 |" in body[1] and "a \\| b" in body[1]
    assert "figure" in md.split("## other")[1] and "nested" not in md.split("## other")[1]
    assert "No results yet" in report.render([], "r.jsonl")


def test_isa_avx2_caps_each_library_and_the_kernels():
    env = host.isa_env("avx2")
    assert env["MSLLM_KERNEL_ISA"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env["OPENBLAS_CORETYPE"] == "Haswell"
    assert all(f.startswith("AVX512") for f in env.get("NPY_DISABLE_CPU_FEATURES", "").split())


_WORKER = """import json, sys
if sys.argv[1] == "fail":
    print("no such model", file=sys.stderr)
    sys.exit(3)
print("a line that is not JSON")
print(json.dumps({"ready": True}), flush=True)
times = [float(t) for t in sys.argv[1].split(",")]
for i, line in enumerate(sys.stdin):
    if line.strip() != "run":
        break
    if times[i] < 0:  # dies in this round
        sys.exit(4)
    print(json.dumps({"step_s": times[i], "loss": 2.0}), flush=True)
print(json.dumps({"peak_rss_bytes": 7, "loss": 2.0, "step_s": -1.0}), flush=True)
"""


def test_interleaved_sides_time_in_rounds_and_ratios_stay_within_a_round():
    """`train.py --rounds`: each side's step_s is the median of its rounds and a ratio the median of the rounds'
    ratios: a machine twice as slow in one round moves both sides of that round, not the ratio. A side that
    fails before it is ready is an error line (a compile failure) or, where fatal, the bench's one error."""
    import sys

    import pytest

    for name, mod in (("host", host), ("report", report)):  # train.py's own imports, as when run from scripts/bench
        sys.modules.setdefault(name, mod)
    try:
        train = load_bench("train")
    finally:
        for name, mod in (("host", host), ("report", report)):
            if sys.modules.get(name) is mod:
                del sys.modules[name]
    a = argparse.Namespace(rounds=3, batch=2, seq=4, load=False)
    cmd = lambda kind, extra: [sys.executable, "-c", _WORKER, kind]  # noqa: E731  (kind: the worker's step times)
    specs = {
        "ours": ("1.0,2.0,1.0", [], True),
        "ref": ("1.1,2.2,1.2", [], True),
        "broken": ("fail", [], False),
        "flaky": ("1.0,-1,1.0", [], False),
    }  # flaky: a compile side that dies in the second round
    env = lambda kind: {}  # noqa: E731  (each side's environment; the workers need none)
    out = train._interleaved(specs, cmd, env, a)
    assert out["ours"]["rounds_step_s"] == [1.0, 2.0, 1.0] and out["ours"]["step_s"] == 1.0
    assert out["ours"]["tokens_per_s"] == 8.0 and out["ours"]["peak_rss_bytes"] == 7
    assert out["broken"] == {"error": "exit 3: no such model"} and out["flaky"]["error"].startswith("exit ")
    # rounds 1.1x, 1.1x, 1.2x: the median ratio 1.1 (the ratio of the medians would say 1.2, the mean 1.13)
    assert abs(train._ratio(out["ours"], out["ref"]) - 1.1) < 1e-12  # float64 quotients of exact inputs: an ulp
    with pytest.raises(SystemExit, match="broken side failed"):
        train._interleaved({"broken": ("fail", [], True)}, cmd, env, a)
    # --load: each round times a side quiet, then beside the busy loop; the slowdown is the rounds' median
    loaded = train._interleaved(
        {"ours": ("1.0,2.0,1.5,3.0", [], True)}, cmd, env, argparse.Namespace(**{**vars(a), "rounds": 2, "load": True})
    )
    assert loaded["ours"]["rounds_step_s"] == [1.0, 1.5] and loaded["ours"]["load_step_s"] == 2.5
    assert loaded["ours"]["load_slowdown"] == 0.5


def test_padded_tokenizer_and_stored_weight_bytes(tmp_path):
    """serve_memory's stand-in tokenizer for a larger random-weight vocabulary (Llama-3.2-1B's 128256): every id below
    the new size decodes, the original ids encode and decode as before; and the budget's weight bytes per format."""
    import sys

    from model.config import ModelConfig
    from tasks.tokenizer import load_tokenizer
    from tests.helpers import train_tiny_hf_tokenizer

    path = list(sys.path)
    try:
        sm = load_bench("serve_memory")
    finally:  # it puts scripts/bench on sys.path (for its own runs): never left there (helpers.load_bench)
        sys.path[:] = path
    src = train_tiny_hf_tokenizer(tmp_path / "src", vocab_size=300)
    orig = load_tokenizer(src)
    tok = load_tokenizer(sm.padded_tokenizer(src, tmp_path / "padded", 1000))
    assert orig.vocab_size == 300 and tok.vocab_size == 1000
    text = "Thou art more lovely, 1604."
    assert tok.encode(text) == orig.encode(text) and tok.decode(tok.encode(text)) == orig.decode(orig.encode(text))
    assert tok.decode([999, 300]) == "benchpad999benchpad300" and tok.eos_id() == orig.eos_id()
    assert tok.info()["vocab_size"] == 1000 and tok.sha256 != orig.sha256
    cfg = ModelConfig.from_name("llama-3.2-1b")
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    assert sm.weights_bytes(cfg, "fp32") == 4 * cfg.num_parameters
    assert sm.weights_bytes(cfg, "fp16") == 2 * (cfg.num_parameters - norms) + 4 * norms
    assert sm.weights_bytes(cfg, "q8_0") == (cfg.num_parameters - norms) // 32 * 34 + 4 * norms
    assert cfg.num_parameters == 1_235_814_400  # Llama-3.2-1B's published count (tied embedding)


def test_peak_rss_of_another_process_is_its_own_high_water_mark():
    """`peak_rss_bytes(pid)` (the serve bench's server, the llama.cpp bench's tools) reads that process's VmHWM: a
    child that touched 200 MB and freed it still reports at least that, this process's own peak is not it, and a
    process that is gone reads 0."""
    import os
    import subprocess
    import sys

    import pytest

    from tasks.training.hardware import peak_rss_bytes

    if not os.path.exists("/proc/self/status"):
        pytest.skip("VmHWM is Linux's /proc/<pid>/status")
    code = "import sys; b = b'\\x01' * 200_000_000; del b; print('ready', flush=True); sys.stdin.read()"
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        assert peak_rss_bytes(child.pid) >= 200_000_000
        assert peak_rss_bytes(child.pid) != peak_rss_bytes()
    finally:
        child.communicate("")
    assert peak_rss_bytes(child.pid) == 0
