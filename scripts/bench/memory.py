"""Decode / serve memory: peak RSS over prompt lengths and many requests, beside HF `generate`, in one run.

The memory model a served or decoding model should meet (docs/SERVING.md, "Memory"):

    peak RSS <= runtime + weights + KV cache + activations of one prefill chunk
    budget    = weights (fp32) + KV cache (2 * layers * kv_heads * context * head_dim * 4 bytes) + 1 GiB

and it must stay flat: no growth per new prompt length or per request. This bench measures it for
`--preset` (random weights: memory does not depend on the values) with a `--context`-slot KV cache:

1. `ladder`: prompts of 16, 64, 256, 1024 and up to context - `--new-tokens` tokens, one after another,
   `--new-tokens` greedy tokens each (the RSS after each, and its time);
2. `requests`: `--requests` prompts of random lengths in 1..context - new tokens (seeded), one after another:
   RSS after the first tenth and at the end (`growth_gb`: what the last nine tenths added).

Each side runs in a process of its own (so each peak is its own, VmHWM), one after the other (never
side by side: the machine has two cores): this project's `Generator` (the decode path the server's
MindSpore backend uses: chunked prefill, each chunk one fused kernel call (PrefillStep), then one per token) and HF
transformers
`LlamaForCausalLM.generate` (PyTorch, sdpa, its dynamic cache) on the same prompts (`--no-hf` skips it).
Prints one JSON line labelled with the CPU and ISA (scripts/bench/host.py) and appends it to
docs/bench/results.jsonl (scripts/bench/report.py writes docs/BENCHMARKS.md from it).

`--stage eval`: the eval stage's loglikelihood scorer (`TokenScorer`, batch 8) over `--requests` synthetic
multiple-choice requests (context 20..`--eval-max-len` tokens, continuation 1..12), beside the computation
lm-eval's `hf` model runs for them (right-padded batch, full forward, log_softmax over [B, T, V]).
`--weights fp16|q8_0` (eval.weights): the eval stage's own `MindSporeLM` on a model artifact of --preset's shape
(random weights, written once into the artifact store: scripts/bench/serve_memory.py `random_model`), scoring
through its fused steps in that format (`StepScorer`); `--model DIR`: that artifact instead.

    python scripts/bench/memory.py --preset smollm2-135m --context 2048 --requests 200
    python scripts/bench/memory.py --stage eval --preset smollm2-135m --requests 64
    python scripts/bench/memory.py --stage eval --preset llama-3.2-1b --weights q8_0 --requests 24
    python scripts/bench/memory.py --preset smollm2-360m --context 2048 --requests 50
    python scripts/bench/memory.py --preset tiny --context 128 --requests 20 --tag smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 1024**3


def _rss_gb() -> float:
    """This process's resident memory now (VmRSS), in GB (10^9 bytes)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _peak_gb() -> float:
    """This process's peak resident memory (VmHWM: `tasks.training.hardware.peak_rss_bytes`), in GB."""
    from tasks.training.hardware import peak_rss_bytes

    return peak_rss_bytes() / 1e9


def prompts(a, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    import numpy as np

    rng = np.random.default_rng(0)
    top = a.context - a.new_tokens
    ladder = [n for n in (16, 64, 256, 1024) if n < top] + [top]
    lengths = rng.integers(1, top + 1, a.requests)
    draw = lambda n: [int(t) for t in rng.integers(3, vocab, int(n))]  # noqa: E731
    return [draw(n) for n in ladder], [draw(n) for n in lengths]


def eval_rows(a, vocab: int) -> list[tuple[list[int], int]]:
    """Loglikelihood requests shaped like multiple-choice ones: (context + continuation ids, continuation length)."""
    import numpy as np

    rng = np.random.default_rng(1)
    out = []
    for _ in range(a.requests):
        n, tail = int(rng.integers(20, a.eval_max_len)), int(rng.integers(1, 13))
        out.append(([int(t) for t in rng.integers(3, vocab, n + tail)], tail))
    return out


def run_eval_side(a, cfg) -> dict:
    """The eval stage's scorer (ours: `TokenScorer`, batch `--batch-size`; hf: the computation of lm-eval's `hf`
    model's `_loglikelihood_tokens`: the batch right-padded, the full forward, log_softmax over [B, T, V], the
    continuation's log-probabilities gathered) over the same requests, longest first as both order them."""
    rows = sorted(eval_rows(a, cfg.vocab_size), key=lambda r: -len(r[0]))
    t0 = time.perf_counter()
    if a.side == "ours":
        from model.runtime import setup_mindspore

        setup_mindspore()
        from tasks.modeling.build import build_network
        from tasks.stages.evaluate.lm_adapter import TokenScorer

        if a.model:  # the eval stage's own model: MindSporeLM on the artifact, in eval.weights `a.weights`
            from tasks.stages.evaluate.lm_adapter import MindSporeLM

            lm = MindSporeLM(pretrained=a.model, batch_size=a.batch_size, weights=a.weights)
            scorer = lm.scorer
            if isinstance(scorer, TokenScorer) and a.max_bytes:
                scorer.max_bytes = a.max_bytes
        else:
            net = build_network("llama", cfg, seed=0).net
            net.set_train(False)
            scorer = TokenScorer(net, batch_size=a.batch_size, max_bytes=a.max_bytes)
        loaded = _rss_gb()
        scorer.score([(ids[:-1], ids[1:]) for ids, _ in rows], tails=[tail for _, tail in rows])
        path = f"{type(scorer).__name__} ({getattr(scorer, 'gen', None) and scorer.gen.weights or 'fp32'})"
    else:
        import torch
        import torch.nn.functional as F

        hf = _hf_model(a, cfg)
        loaded = _rss_gb()
        with torch.no_grad():
            for b in range(0, len(rows), a.batch_size):
                batch = rows[b : b + a.batch_size]
                t = max(len(ids) - 1 for ids, _ in batch)
                inp = torch.zeros((len(batch), t), dtype=torch.long)
                for r, (ids, _) in enumerate(batch):
                    inp[r, : len(ids) - 1] = torch.tensor(ids[:-1])
                logp = F.log_softmax(hf(inp).logits, dim=-1)
                for r, (ids, tail) in enumerate(batch):
                    n = len(ids) - 1
                    # the continuation's log-likelihood, as lm-eval computes it (the value itself is not kept)
                    logp[r, n - tail : n].gather(-1, torch.tensor(ids[n - tail + 1 :]).unsqueeze(-1)).sum()
        path = "hf forward + log_softmax"
    return {
        "side": a.side,
        "path": path,
        "loaded_rss_gb": round(loaded, 3),
        "requests": len(rows),
        "batch_size": a.batch_size,
        "s": round(time.perf_counter() - t0, 1),
        "peak_rss_gb": round(_peak_gb(), 3),
    }


def _hf_model(a, cfg):
    """HF LlamaForCausalLM (sdpa) of `cfg`'s shape, random weights, from `model.convert.config_to_hf` (as train.py)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.convert import config_to_hf

    torch.set_num_threads(a.threads)
    hf = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    return LlamaForCausalLM(LlamaConfig(**hf, attn_implementation="sdpa")).eval()


def model_config(a):
    """The shape benched: --model's (a model artifact) or --preset's."""
    from model.config import ModelConfig

    if a.model:
        from tasks.store.model_artifact import read_info

        return ModelConfig.from_dict(read_info(a.model)["model"])
    return ModelConfig.from_name(a.preset)


def run_side(a) -> dict:
    """One side in this process: load, then the ladder and the requests; RSS after each phase."""

    cfg = model_config(a)
    if a.stage == "eval":
        return run_eval_side(a, cfg)
    ladder, requests = prompts(a, cfg.vocab_size)
    if a.side == "ours":
        from model.runtime import setup_mindspore

        setup_mindspore()
        from model.generate import Generator
        from tasks.modeling.build import build_network

        net = build_network("llama", cfg, seed=0).net
        net.set_train(False)
        gen = Generator(net, max_len=a.context)
        path = gen.decode_path

        def generate(p):
            return gen.generate(p, a.new_tokens)
    else:
        import torch

        hf = _hf_model(a, cfg)
        path = "hf sdpa"

        def generate(p):
            with torch.no_grad():
                out = hf.generate(
                    torch.tensor([p]),
                    max_new_tokens=a.new_tokens,
                    min_new_tokens=a.new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
            return out[0, len(p) :].tolist()

    res = {"side": a.side, "decode_path": path, "loaded_rss_gb": round(_rss_gb(), 3), "ladder": []}
    for p in ladder:
        t0 = time.perf_counter()
        generate(p)
        res["ladder"].append(
            {"prompt_tokens": len(p), "s": round(time.perf_counter() - t0, 2), "rss_gb": round(_rss_gb(), 3)}
        )
    first = max(1, len(requests) // 10)
    t0 = time.perf_counter()
    for i, p in enumerate(requests):
        generate(p)
        if i + 1 == first:
            res["rss_after_first_tenth_gb"] = round(_rss_gb(), 3)
    res["requests"] = len(requests)
    res["requests_s"] = round(time.perf_counter() - t0, 1)
    res["rss_end_gb"] = round(_rss_gb(), 3)
    res["growth_gb"] = round(res["rss_end_gb"] - res.get("rss_after_first_tenth_gb", res["rss_end_gb"]), 3)
    res["peak_rss_gb"] = round(_peak_gb(), 3)
    return res


def main() -> None:
    from host import add_isa_arg, apply_isa, describe
    from report import add_record_args, record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--stage",
        choices=["decode", "eval"],
        default="decode",
        help="decode: the server's decode path; eval: the loglikelihood scorer",
    )
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument(
        "--weights",
        choices=["fp32", "fp16", "q8_0"],
        default="fp32",
        help="eval: eval.weights, the scorer's weight format (fp16 / q8_0: the eval stage's MindSporeLM on a model "
        "artifact of --preset's shape with random weights, written once into --artifacts)",
    )
    ap.add_argument("--model", default=None, help="eval: a model artifact to score with (MindSporeLM) instead")
    ap.add_argument("--artifacts", default=os.environ.get("MSLLM_ARTIFACTS", "artifacts"), help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=8, help="eval: rows per call (eval.batch_size)")
    ap.add_argument("--eval-max-len", type=int, default=500, help="eval: longest context, tokens")
    ap.add_argument(
        "--max-bytes", type=int, default=None, help="eval: TokenScorer's activation cap per call (default: its own)"
    )
    ap.add_argument("--context", type=int, default=2048, help="decode: KV cache slots (the server's context)")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads on the HF side")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--side", choices=["ours", "hf"], help=argparse.SUPPRESS)  # a child's one side
    add_isa_arg(ap)
    add_record_args(ap)
    a = ap.parse_args()
    if a.side:
        print(json.dumps(run_side(a)))
        return
    apply_isa(a.isa)
    if a.stage == "eval" and a.weights != "fp32" and not a.model:
        from serve_memory import fetch_model, random_model

        from model.runtime import setup_mindspore

        setup_mindspore()
        a.model = str(random_model(a.preset, fetch_model(a), Path(a.artifacts)))
    from serve_memory import weights_bytes

    cfg = model_config(a)
    if a.stage == "decode" and a.context > cfg.max_seq_length:
        ap.error(f"--context {a.context} exceeds {a.preset}'s max_seq_length {cfg.max_seq_length}")
    weights_gb = weights_bytes(cfg, a.weights if a.stage == "eval" else "fp32") / 1e9
    kv_gb = 2 * cfg.num_layers * cfg.num_kv_heads * a.context * cfg.head_dim * 4 / 1e9
    budget_gb = weights_gb + kv_gb + GIB / 1e9
    res = {
        "bench": "memory",
        **describe(threads=a.threads),
        "stage": a.stage,
        "preset": a.preset,
        "requests": a.requests,
        "weights": a.weights if a.stage == "eval" else "fp32",
        "weights_gb": round(weights_gb, 3),
    }
    if a.stage == "decode":
        res.update(
            context=a.context, new_tokens=a.new_tokens, kv_cache_gb=round(kv_gb, 3), budget_gb=round(budget_gb, 3)
        )
    else:
        from tasks.stages.evaluate.lm_adapter import TokenScorer

        res.update(batch_size=a.batch_size, eval_max_len=a.eval_max_len, max_bytes=a.max_bytes or TokenScorer.MAX_BYTES)
    sides = ["ours"] + ([] if a.no_hf else ["hf"])
    for side in sides:
        args = [
            sys.executable,
            __file__,
            "--side",
            side,
            "--stage",
            a.stage,
            "--preset",
            a.preset,
            "--context",
            str(a.context),
            "--new-tokens",
            str(a.new_tokens),
            "--requests",
            str(a.requests),
            "--threads",
            str(a.threads),
            "--batch-size",
            str(a.batch_size),
            "--eval-max-len",
            str(a.eval_max_len),
            *(["--max-bytes", str(a.max_bytes)] if a.max_bytes else []),
            *(["--model", a.model] if a.model else []),
            "--weights",
            a.weights,
        ]
        out = subprocess.run(args, capture_output=True, text=True, env=os.environ)
        if out.returncode:
            res[side] = {
                "error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"
            }
            print(out.stderr[-3000:], file=sys.stderr)
            continue
        res[side] = json.loads(out.stdout.strip().splitlines()[-1])
    ours = res.get("ours", {})
    if "peak_rss_gb" in ours:
        res["peak_rss_gb"] = ours["peak_rss_gb"]
        if a.stage == "decode":
            res["within_budget"] = ours["peak_rss_gb"] <= budget_gb
            res["growth_gb"] = ours["growth_gb"]
    if "peak_rss_gb" in res.get("hf", {}) and "peak_rss_gb" in ours:
        res["rss_vs_hf"] = round(ours["peak_rss_gb"] / res["hf"]["peak_rss_gb"], 2)
    record(res, a)


if __name__ == "__main__":
    main()
