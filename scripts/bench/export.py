"""Decode speed of the exported model, side by side: MindSpore vs onnxruntime (fp32, int8) vs onnxruntime-genai, all
with a KV cache.

A random-init model of `--preset` (default `small`, the demo's shape) is exported the way the
export stage does it (tasks/deploy/onnx_decoder.py from the weights; `tasks.deploy.formats.export_int8`;
genai_config.json as `tasks.deploy.formats.write_genai_files` writes it), then each runtime greedy-generates
`--new-tokens` (default 256) after a `--prompt-tokens` (default 16) prompt, batch 1:

  - MindSpore: `model.generate.Generator` (jit prefill + jit KV-cache decode step, compiled first);
  - onnxruntime fp32 and int8: `tasks.deploy.onnx_generate.OnnxGenerator` (prefill, then one call per
    token feeding present back as past);
  - onnxruntime-genai: `onnxruntime_genai.Generator` over the same model.onnx (greedy; EOS is
    held off with min_length so every runtime generates the same count).

For each: prefill = generating 1 token, total = generating N; decode tokens/s = (N - 1) / (total -
prefill); each figure is the median of `--repeats` runs, after a warm-up. onnxruntime and genai
use `--threads` intra-op threads (default: onnxruntime's choice, one per physical core). Also
reported: whether the greedy tokens agree (fp32 and genai must equal MindSpore's; int8 may drift),
the file sizes, and the ratios docs/BENCHMARKS.md tabulates (onnxruntime fp32 / MindSpore, int8 / fp32,
genai / MindSpore). Prints one JSON line, labelled with the CPU and ISA (scripts/bench/host.py), and
appends it to docs/bench/results.jsonl (`--results`, `--tag`; scripts/bench/report.py).

    python scripts/bench/export.py [--preset small] [--prompt-tokens 16] [--new-tokens 256] [--repeats 3]
    python scripts/bench/export.py --preset tiny --prompt-tokens 4 --new-tokens 8 --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host import add_isa_arg, apply_isa, describe  # noqa: E402  (scripts/bench/)
from report import add_record_args, record  # noqa: E402


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rates(gen_fn, n: int, repeats: int) -> dict:
    """prefill ms, total s and decode tokens/s of a `gen_fn(max_new_tokens) -> tokens` (warmed up first)."""
    gen_fn(2)
    prefill = _median_s(lambda: gen_fn(1), repeats)
    total = _median_s(lambda: gen_fn(n), repeats)
    decode = (total - prefill) / (n - 1)
    return {
        "prefill_ms": round(prefill * 1e3, 2),
        "decode_ms_per_token": round(decode * 1e3, 3),
        "decode_tokens_per_s": round(1 / decode, 1) if decode > 0 else None,
        "total_s": round(total, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime / genai intra-op threads")
    add_isa_arg(ap)
    add_record_args(ap)
    a = ap.parse_args()
    apply_isa(a.isa)  # onnxruntime has no ISA cap of its own: under --isa avx2 only MindSpore's side is capped

    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.fused_decode import decode_kernel_path
    from model.generate import Generator
    from tasks.deploy.checks import genai_generate
    from tasks.deploy.formats import export_int8
    from tasks.deploy.onnx_decoder import build_decoder, save_model
    from tasks.deploy.onnx_generate import OnnxGenerator
    from tasks.modeling.build import build_network

    cfg = ModelConfig.from_name(a.preset)
    p, n = a.prompt_tokens, a.new_tokens
    max_len = p + n
    if max_len > cfg.max_seq_length or n < 2 or p < 1:
        raise SystemExit(
            f"need prompt + new tokens ({p} + {n}) <= {a.preset}'s max_seq_length {cfg.max_seq_length}, "
            "a prompt token and at least 2 new tokens"
        )
    net = build_network("llama", cfg, seed=0).net
    net.set_train(False)
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, cfg.vocab_size, p)]
    res: dict = {
        "bench": "export",
        **describe(a.threads),
        "kernel_body": decode_kernel_path(),
        "preset": a.preset,
        "parameters": cfg.num_parameters,
        "prompt_tokens": p,
        "new_tokens": n,
        "batch": 1,
        "repeats": a.repeats,
        "threads": a.threads,
        "cpus": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        weights = {q.name: q.asnumpy() for q in net.trainable_params()}
        t0 = time.perf_counter()
        save_model(build_decoder(cfg.to_dict(), weights), d / "model.onnx")
        res["onnx_build_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        export_int8(d / "model.onnx", d / "model.int8.onnx")
        res["int8_quantize_s"] = round(time.perf_counter() - t0, 2)
        res["onnx_mb"] = round((d / "model.onnx").stat().st_size / 1e6, 2)
        res["int8_mb"] = round((d / "model.int8.onnx").stat().st_size / 1e6, 2)
        # genai reads genai_config.json (no tokenizer files needed: it generates from token ids); EOS (2) is held
        # off with min_length, as MindSpore and OnnxGenerator run without an eos_id here
        import onnxruntime_genai as og

        _write_genai_config(d, cfg.to_dict(), a.threads)

        ms_gen = Generator(net, max_len=max_len)
        ms_gen.compile(p, n)
        ort = {
            k: OnnxGenerator(d / f, threads=a.threads, max_len=max_len)
            for k, f in (("fp32", "model.onnx"), ("int8", "model.int8.onnx"))
        }
        genai_model = og.Model(str(d))

        def genai(k: int) -> list[int]:
            return genai_generate(genai_model, prompt, k, hold_eos=True)

        runs = {
            "mindspore": lambda k: ms_gen.generate(prompt, k),
            "onnx_fp32": lambda k: ort["fp32"].generate(prompt, k),
            "onnx_int8": lambda k: ort["int8"].generate(prompt, k),
            "genai": genai,
        }
        tokens = {}
        for name, fn in runs.items():
            res[name] = _rates(fn, n, a.repeats)
            tokens[name] = fn(n)
    ms = res["mindspore"]["decode_tokens_per_s"]

    def ratio(x, y):
        return round(x / y, 2) if x and y else None

    res.update(
        onnx_vs_mindspore_decode=ratio(res["onnx_fp32"]["decode_tokens_per_s"], ms),
        int8_vs_fp32_decode=ratio(res["onnx_int8"]["decode_tokens_per_s"], res["onnx_fp32"]["decode_tokens_per_s"]),
        genai_vs_mindspore_decode=ratio(res["genai"]["decode_tokens_per_s"], ms),
        same_tokens={k: tokens[k] == tokens["mindspore"] for k in ("onnx_fp32", "onnx_int8", "genai")},
        int8_tokens_agree=sum(x == y for x, y in zip(tokens["onnx_int8"], tokens["mindspore"])),
    )
    record(res, a)


def _write_genai_config(d: Path, model_config: dict, threads: int | None) -> None:
    from tasks.deploy.onnx_decoder import genai_config
    from tasks.store.disk import atomic_write_json

    cfg = genai_config(model_config, eos_id=2, bos_id=1, pad_id=0)
    if threads:
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = threads
    atomic_write_json(d / "genai_config.json", cfg)


if __name__ == "__main__":
    main()
