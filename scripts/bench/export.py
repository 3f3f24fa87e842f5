"""Inference latency of the exported model: onnxruntime vs MindSpore, prefill and per-token decode.

A random-init model of `--preset` (default `small`, the demo's shape) is exported the way
the export stage does it (`tasks.export.export_onnx` at [1, --seq-length], and MindIR with
dynamic shapes), then greedy-generates `--new-tokens` after a `--prompt-tokens` prompt:

  - onnxruntime (`tasks.onnx_generate.OnnxGenerator`): the fixed-shape ONNX model has no KV
    cache, so prefill and every decode step are one full [1, seq_length] forward;
  - MindSpore (`model.generate.Generator`, jit, KV cache over the same seq_length window):
    prefill = `generate(prompt, 1)`, decode = the rest of `generate(prompt, N)` per token;
  - one full [1, seq_length] forward each through onnxruntime, MindSpore jit and the
    reloaded MindIR (`nn.GraphCell`): the same work on each runtime.

Compilation and session creation happen before any clock starts; each timing is the
median of `--repeats` runs. Prints one JSON line.

    python scripts/bench/export.py [--preset small] [--seq-length 128] [--prompt-tokens 16] [--new-tokens 64]
    python scripts/bench/export.py --preset tiny --seq-length 16 --prompt-tokens 4 --new-tokens 4 --repeats 1  # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _median_s(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--seq-length", type=int, default=128, help="the ONNX export length (export.seq_length)")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()

    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    import mindspore as ms

    from model.config import ModelConfig
    from model.generate import Generator
    from model.llama import LlamaForCausalLM
    from tasks.export import export_mindir, export_onnx
    from tasks.onnx_generate import OnnxGenerator

    cfg = ModelConfig.from_name(a.preset)
    t, p, n = a.seq_length, a.prompt_tokens, a.new_tokens
    if t > cfg.max_seq_length or p + n > t or n < 2:
        raise SystemExit(f"need prompt + new tokens ({p} + {n}) <= seq_length {t} <= {a.preset}'s max_seq_length "
                         f"{cfg.max_seq_length}, and at least 2 new tokens")

    def fresh():  # one Cell per export: MindSpore cannot export the same Cell twice in a process
        net = LlamaForCausalLM(cfg, seed=0)
        net.set_train(False)
        return net

    net = fresh()
    prompt = [int(x) for x in np.random.default_rng(0).integers(3, cfg.vocab_size, p)]
    x = np.zeros((1, t), np.int32)
    x[0, :p] = prompt
    res: dict = {"bench": "export", "preset": a.preset, "parameters": cfg.num_parameters, "seq_length": t,
                 "prompt_tokens": p, "new_tokens": n, "repeats": a.repeats}
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path, mindir_path = Path(tmp) / "model.onnx", Path(tmp) / "model.mindir"
        t0 = time.perf_counter()
        export_onnx(fresh(), onnx_path, 1, t)
        res["onnx_export_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        export_mindir(fresh(), mindir_path)
        res["mindir_export_s"] = round(time.perf_counter() - t0, 2)
        ort_gen = OnnxGenerator(onnx_path)
        graph = ms.nn.GraphCell(ms.load(str(mindir_path)))

        # onnxruntime: every step is the same full forward (no KV cache in a fixed-shape graph)
        ort_gen.generate(prompt, 2)  # warm-up
        ort_prefill = _median_s(lambda: ort_gen.generate(prompt, 1), a.repeats)
        ort_total = _median_s(lambda: ort_gen.generate(prompt, n), a.repeats)
        ort_tokens = ort_gen.generate(prompt, n)

        # MindSpore: jit prefill + jit KV-cache decode step, compiled before timing
        gen = Generator(net, max_len=t)
        gen.compile(p, n)
        ms_prefill = _median_s(lambda: gen.generate(prompt, 1), a.repeats)
        ms_total = _median_s(lambda: gen.generate(prompt, n), a.repeats)
        ms_tokens = gen.generate(prompt, n)

        # the same work on each runtime: one full [1, T] forward
        def full_forward(ids):  # a def, not a lambda: MindSpore's jit parser needs it on its own line
            return net(ids)

        fwd = ms.jit(full_forward)
        fwd(ms.Tensor(x)).asnumpy()
        graph(ms.Tensor(x)).asnumpy()
        forward = {
            "onnx": _median_s(lambda: ort_gen.session.run(None, {"input_ids": x}), a.repeats),
            "mindspore_jit": _median_s(lambda: fwd(ms.Tensor(x)).asnumpy(), a.repeats),
            "mindir": _median_s(lambda: graph(ms.Tensor(x)).asnumpy(), a.repeats),
        }

    ort_decode = (ort_total - ort_prefill) / (n - 1)
    ms_decode = (ms_total - ms_prefill) / (n - 1)
    res.update(
        onnx_prefill_ms=round(ort_prefill * 1e3, 2), onnx_decode_ms_per_token=round(ort_decode * 1e3, 2),
        onnx_tokens_per_s=round(n / ort_total, 1),
        mindspore_prefill_ms=round(ms_prefill * 1e3, 2), mindspore_decode_ms_per_token=round(ms_decode * 1e3, 2),
        mindspore_tokens_per_s=round(n / ms_total, 1),
        onnx_vs_mindspore_decode=round(ms_decode / ort_decode, 2) if ort_decode > 0 else None,
        forward_ms={k: round(v * 1e3, 2) for k, v in forward.items()},
        same_tokens=ort_tokens == ms_tokens,
    )
    print(json.dumps(res))


if __name__ == "__main__":
    main()
