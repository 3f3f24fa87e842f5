"""scripts/bench/report.py and host.py: results lines become docs tables; --isa avx2 caps every library named."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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
    rows = [{"bench": "train", "date": "2026-12-01", "cpu": "X", "cpu_isa": "avx512", "threads": 2,
             "tokens_per_s": 100.0, "hf": {"sdpa": {"tokens_per_s": 50.0}, "compile": {"error": "a | b"}}},
            {"bench": "train", "date": "2026-12-02", "cpu": "X", "cpu_isa": "avx512", "emulated_isa": "avx2",
             "threads": 2, "tokens_per_s": 80.0, "hf": {"sdpa": {"tokens_per_s": 40.0}}},
            {"bench": "other", "date": "2026-12-02", "figure": 3, "nested": {"x": 1}}]
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
