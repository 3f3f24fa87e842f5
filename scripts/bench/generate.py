"""Decode and eval throughput: tokens/s with and without the KV cache, lm-eval requests/s.

A random-init model of `--preset` (default `small`, the demo's shape) generates
`--new-tokens` (256) greedy tokens after a `--prompt-tokens` prompt, once through the
jit-compiled KV-cache decode step and once recomputing the full forward each step
(jit, padded to 32-token buckets); compilation is done before the clock starts for
both. Then `MindSporeLM._loglikelihood_tokens` scores `--requests` synthetic
(context, continuation) pairs shaped like multiple-choice requests (context 20–100
tokens, continuation 1–12) with `--batch-size`, after one warm-up pass. Prints one
JSON line.

    python scripts/bench/generate.py [--preset small] [--new-tokens 256] [--requests 256]
    python scripts/bench/generate.py --preset tiny --new-tokens 16 --requests 16     # smoke run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args()

    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.generate import Generator
    from model.llama import LlamaForCausalLM
    from tasks.stages.evaluate.lm_adapter import MindSporeLM

    cfg = ModelConfig.from_name(a.preset)
    if a.prompt_tokens + a.new_tokens > cfg.max_seq_length:
        raise SystemExit(f"prompt + new tokens ({a.prompt_tokens + a.new_tokens}) exceed {a.preset}'s "
                         f"max_seq_length {cfg.max_seq_length}")
    net = LlamaForCausalLM(cfg, seed=0)
    net.set_train(False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt_tokens)]
    gen = Generator(net)

    res: dict = {"bench": "generate", "preset": a.preset, "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens}
    tokens = {}
    for name, cached in (("cached", True), ("uncached", False)):
        t0 = time.perf_counter()
        gen.compile(len(prompt), a.new_tokens, use_cache=cached)
        res[f"{name}_compile_s"] = round(time.perf_counter() - t0, 2)
        t0 = time.perf_counter()
        tokens[name] = gen.generate(prompt, a.new_tokens, use_cache=cached)  # no eos: always the full length
        dt = time.perf_counter() - t0
        res[f"{name}_tokens_per_s"] = round(len(tokens[name]) / dt, 2)
    res["kv_speedup"] = round(res["cached_tokens_per_s"] / res["uncached_tokens_per_s"], 2)
    res["same_tokens"] = tokens["cached"] == tokens["uncached"]
    res["decode_ms_per_token"] = round(1000 / res["cached_tokens_per_s"], 2)

    lm = MindSporeLM(net=net, tokenizer=None, eot_token_id=2, batch_size=a.batch_size, progress=False)
    reqs = [(None, [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(20, 101)))],
             [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(1, 13)))]) for _ in range(a.requests)]
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)  # warm-up: compiles each length bucket
    res["eval_compile_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)
    dt = time.perf_counter() - t0
    n_tok = sum(min(len(c) + len(x), lm.max_length + 1) - 1 for _, c, x in reqs)
    res.update(eval_requests_per_s=round(a.requests / dt, 2), eval_tokens_per_s=round(n_tok / dt, 1),
               eval_batch_size=a.batch_size, eval_shapes=sorted(lm.scorer.shapes_compiled))
    print(json.dumps(res))


if __name__ == "__main__":
    main()
