"""Decode throughput against HF `generate` (PyTorch, KV cache) side by side, and eval throughput.

A random-init model of `--preset` (default `small`, the demo's shape) generates `--new-tokens`
(256) greedy tokens after a `--prompt-tokens` (16) prompt, batch 1, on these paths in one run:

- this project's `Generator` with its KV cache: the prompt in fused chunks, then one call of the fused
  kernel per token (model/decode_kernel.cc, through ctypes; `decode_path` says "decoder" where it could not
  be built) -- the headline `tokens_per_s`,
- HF transformers `LlamaForCausalLM.generate` on PyTorch with its default attention (`sdpa`; `--hf-attn
  eager`) and its cache (`use_cache=True`), the same weights (converted with model/convert.py), in its
  own process that stays up for the whole run (`--no-hf` skips it; needs the `reference` extra),
- the same `Generator` with `fused=False`: every token on MindSpore's own kernels (`decoder_tokens_per_s`),
- the same `Generator` recomputing the full forward each step (jit, 32-token buckets): the
  secondary `kv_speedup` field only (one round; that path is already compiled and bucketed).

The fused step and HF each run on every thread count of `--threads` (default 1 and 2), in `--rounds`
(3) interleaved rounds (every path once per round), so load on a shared machine hits them alike; each
side's figure is its best thread count's best round (`tokens_per_s_by_threads` has them all). On a
2-core machine that others use, 2-thread runs (ours and PyTorch's, both OpenMP) can collapse when a
thread is descheduled at a barrier: taking each side's best thread count keeps the baseline honest.
`speedup_vs_hf` is best against best; `speedup_vs_hf_rounds` the same ratio within each round.

Decode speed is also given as a fraction of this machine's memory-bandwidth limit: bytes of matmul
weights read per token (every projection and the LM head, fp32) over the BEST of independent read
bandwidths measured in the same rounds (best round, best thread count), never the measured decode alone:
numpy's GEMV and the fused step's own GEMV (model/decode_kernel.cc `Gemv`) on an fp32 matrix of the
model's weight bytes per token, and a plain read loop (numpy sums over chunks, one per thread) over a
buffer of the same size and over one of at least 2x L3 (DRAM). Weights that fit in L3 stay there between
tokens, and the weight-sized measurements see that too. `bandwidth_limit_by` names the winner,
`bandwidth_gb_per_s` has all four. No fraction can exceed 1: were a decode faster than the limit, the
limit would be wrong; it is then clipped to 1 and `bandwidth_note` (and stderr) says so loudly.
Compilation / warm-up happen before the clock starts on every path.
Peak RSS (VmHWM over the timed rounds): `hf_peak_rss_gb` is the HF process's, which holds only its side;
`peak_rss_gb` is this process's, which holds every timed path at once (`peak_rss_scope` lists them), so it bounds
any one path's from above; scripts/bench/memory.py runs each side alone for the per-path figure.
Then `MindSporeLM._loglikelihood_tokens` scores `--requests` synthetic (context, continuation) pairs
shaped like multiple-choice requests (context 20–100 tokens, continuation 1–12) with `--batch-size`,
after one warm-up pass. Prints one JSON line, labelled with the CPU, ISA levels and the decode kernel's
body (scripts/bench/host.py; `--isa avx2` emulates an AVX2-only CPU), and appends it to
docs/bench/results.jsonl (`--results`, `--tag`; scripts/bench/report.py writes docs/BENCHMARKS.md).

`--preset smollm2-135m`: SmolLM2-135M's shape (30 layers, 576 wide, vocab 49152, tied embeddings, 538 MB
of fp32 weights read per token) with random weights on both sides (the decode speed does not depend on
the values; greedy tokens of random weights are not meaningful text), so no download is needed.

    python scripts/bench/generate.py [--preset small] [--new-tokens 256] [--threads 1,2] [--rounds 3] [--requests 256]
    python scripts/bench/generate.py --preset smollm2-135m --new-tokens 64 --requests 0
    python scripts/bench/generate.py --preset tiny --new-tokens 16 --requests 16 --tag smoke     # smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from host import BUSY_LOOP, add_isa_arg, apply_isa, busy_loop, describe  # noqa: E402  (scripts/bench/)
from report import add_record_args, record  # noqa: E402


def l3_bytes() -> int:
    """This CPU's last-level cache size (bytes) from sysfs; 0 when unknown."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text.rstrip("KMGkmg") or 0) * mult


class ReadBench:
    """Bytes/s of fp32 GEMVs y = W x on a ~nbytes matrix W [rows, 4096] (numpy's BLAS, threads set through
    threadpoolctl where installed; the fused decode step's own GEMV, model/decode_kernel.cc `Gemv`, through
    ctypes) and of a plain read of the same bytes (numpy sums over one chunk per thread; numpy releases the
    GIL in reductions): bytes / best time. Buffers are built once; `measure` adds one more batch of timed
    repeats, so calls interleaved with the decode rounds see the same load."""

    def __init__(self, nbytes: int, lib: str | None, gemv: bool = True):
        import numpy as np

        cols = 4096
        self.a = np.ones((max(1, nbytes // (4 * cols)), cols), np.float32)  # every page written
        self.v = np.ones(cols, np.float32)
        self.y = np.zeros(self.a.shape[0], np.float32)
        self.impls = ["read"] + (["numpy_gemv"] if gemv else [])
        self.kernel = None
        if lib is not None and gemv:
            import ctypes

            fn = ctypes.CDLL(lib).Gemv
            fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
            self.kernel = fn
            self.impls.append("kernel_gemv")
        self.best: dict[tuple[str, int], float] = {}
        self._pool = None

    def _run(self, impl: str, threads: int) -> None:
        import numpy as np

        if impl == "kernel_gemv":
            self.kernel(self.a.ctypes.data, self.v.ctypes.data, self.y.ctypes.data, *self.a.shape, threads)
        elif impl == "numpy_gemv":
            self.a @ self.v
        elif threads == 1:
            self.a.sum()
        else:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor

                self._pool = ThreadPoolExecutor(8)
            list(self._pool.map(np.sum, np.array_split(self.a, threads)))

    def measure(self, threads: int, repeats: int) -> None:
        import contextlib

        try:
            from threadpoolctl import threadpool_limits

            limit = threadpool_limits(threads)
        except ImportError:  # numpy's default: all cores
            limit = contextlib.nullcontext()
        with limit:
            for impl in self.impls:
                self._run(impl, threads)  # warm up (threads started; an in-cache matrix loaded)
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    self._run(impl, threads)
                    dt = time.perf_counter() - t0
                    self.best[impl, threads] = min(self.best.get((impl, threads), float("inf")), dt)

    def bytes_per_s(self) -> dict[str, float]:
        return {impl: max(self.a.nbytes / t for (i, _), t in self.best.items() if i == impl) for impl in self.impls}


STORED = {"fp16": 2 / 4, "q8_0": 34 / 32 / 4}
"""The stored weight formats the fused step reads, and their bytes per weight as a fraction of fp32's."""


def weight_bytes_per_token(cfg) -> int:
    """fp32 bytes of the weights one decode step multiplies by: every projection and the LM head."""
    h, kv, f = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * f
    return 4 * (cfg.num_layers * per_layer + cfg.vocab_size * h)


def _hf_side(a: argparse.Namespace) -> None:
    """HF LlamaForCausalLM.generate (greedy, use_cache=True) on the weights in a.weights: prints one JSON
    line when loaded and warm, then one per line read from stdin (a timed generation each)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from model.config import ModelConfig
    from model.convert import config_to_hf

    threads = [int(t) for t in a.threads.split(",")]
    torch.set_num_threads(max(threads))
    cfg = ModelConfig.from_name(a.preset)
    hf_cfg = {k: v for k, v in config_to_hf(cfg).items() if k not in ("architectures", "model_type", "dtype")}
    model = LlamaForCausalLM(LlamaConfig(**hf_cfg, attn_implementation=a.hf_attn))
    missing, unexpected = model.load_state_dict(load_file(a.weights), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise SystemExit(f"HF side: weights do not fit: missing {missing[:3]}, unexpected {unexpected[:3]}")
    model.eval()
    prompt = torch.tensor([json.loads(a.prompt)], dtype=torch.long)
    kw = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        model.generate(prompt, max_new_tokens=8, min_new_tokens=8, **kw)  # warm-up
        print(json.dumps({"ready": True, "attn": model.config._attn_implementation}), flush=True)
        for line in sys.stdin:
            torch.set_num_threads(int(line))
            t0 = time.perf_counter()
            out = model.generate(prompt, max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, **kw)
            dt = time.perf_counter() - t0
            new = out[0, prompt.shape[1] :].tolist()
            print(json.dumps({"tokens_per_s": len(new) / dt, "tokens": new}), flush=True)


class _HFWorker:
    """The HF side in its own process, kept up so its rounds interleave with ours."""

    def __init__(self, a: argparse.Namespace, net, prompt: list[int]):
        from safetensors.numpy import save_file

        from model.convert import native_to_hf

        self.log = tempfile.TemporaryFile("w+")
        with tempfile.TemporaryDirectory() as tmp:
            weights = os.path.join(tmp, "weights.safetensors")
            save_file(native_to_hf({p.name: p.asnumpy() for p in net.get_parameters()}, net.config), weights)
            env = dict(os.environ, OMP_NUM_THREADS=str(max(int(t) for t in a.threads.split(","))), GLOG_v="3")
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--side",
                    "hf",
                    "--preset",
                    a.preset,
                    "--weights",
                    weights,
                    "--prompt",
                    json.dumps(prompt),
                    "--new-tokens",
                    str(a.new_tokens),
                    "--threads",
                    str(a.threads),
                    "--hf-attn",
                    a.hf_attn,
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self.log,
                text=True,
                env=env,
            )
            self.info = self._read()  # the weights are loaded once this line arrives

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.seek(0)
            raise SystemExit(
                f"the HF side failed (exit {self.proc.returncode}); install the `reference` extra or "
                f"pass --no-hf:\n{self.log.read()[-3000:]}"
            )
        return json.loads(line)

    def run(self, threads: int) -> dict:
        self.proc.stdin.write(f"{threads}\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()
        self.log.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument(
        "--threads",
        default="1,2",
        help="thread counts for the fused decode step, PyTorch (HF) and numpy's GEMV, comma-separated",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timed rounds of HF, fused and decoder")
    ap.add_argument("--requests", type=int, default=256, help="eval requests; 0 skips the eval part")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers / PyTorch baseline")
    ap.add_argument("--hf-attn", default="sdpa", help="HF's attention implementation (default: its own, sdpa)")
    add_isa_arg(ap)
    add_record_args(ap)
    ap.add_argument(
        "--stored",
        default="fp16,q8_0",
        help="also time the fused step reading these stored weight formats (`Generator(weights=...)`, `msllm serve "
        "--weights`; '' for none) on every thread count: <format>_tokens_per_s and its bandwidth fraction",
    )
    ap.add_argument(
        "--load",
        action="store_true",
        help="also time every side beside one `nice -n 19` busy loop, in the same rounds (quiet, then loaded): "
        "load_<side>_tokens_per_s and load_slowdown (1 - loaded / quiet within each round, the median of the rounds; "
        "load_slowdown_best: best against best)",
    )
    ap.add_argument("--side", choices=["hf"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "hf":
        _hf_side(a)
        return
    apply_isa(a.isa)  # re-execs under the emulated CPU's environment; the HF process inherits it

    import numpy as np

    from model import runtime

    runtime.setup_mindspore()
    from model.config import ModelConfig
    from model.fused_decode import build_decode_kernel, decode_kernel_path
    from model.generate import Generator
    from tasks.modeling.build import build_network
    from tasks.stages.evaluate.lm_adapter import MindSporeLM

    cfg = ModelConfig.from_name(a.preset)
    if a.prompt_tokens + a.new_tokens > cfg.max_seq_length:
        raise SystemExit(
            f"prompt + new tokens ({a.prompt_tokens + a.new_tokens}) exceed {a.preset}'s "
            f"max_seq_length {cfg.max_seq_length}"
        )
    net = build_network("llama", cfg, seed=0).net
    net.set_train(False)
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, cfg.vocab_size, a.prompt_tokens)]
    counts = [int(t) for t in a.threads.split(",")]
    fused = {t: Generator(net, threads=t) for t in counts}
    plain = Generator(net, fused=False)
    gen = fused[counts[-1]]

    res: dict = {
        "bench": "generate",
        "spin_wait": runtime.SPIN_WAIT,  # MindSpore's pool waits (model/runtime.py spin_waits)
        **describe(a.threads),
        "kernel_body": decode_kernel_path(),
        "preset": a.preset,
        "prompt_tokens": a.prompt_tokens,
        "new_tokens": a.new_tokens,
        "batch": 1,
        "decode_path": gen.decode_path,
        "decode_reason": gen.decode_reason,
        "rounds": a.rounds,
        "threads": counts,
    }
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing and not a.no_hf:
        res["hf_skipped"] = f"{', '.join(missing)} not installed (the `reference` extra)"
    hf = None if a.no_hf or missing else _HFWorker(a, net, prompt)
    paths = {**{f"cached@{t}": g for t, g in fused.items()}, "decoder": plain}
    if gen.decode_path != "fused":  # every Generator decodes on MindSpore kernels: time it once
        paths = {f"cached@{counts[-1]}": gen}
    else:  # the same fused step on stored matrices: fp16 (2 bytes a weight), q8_0 (34 bytes per 32)
        for fmt in [f for f in a.stored.split(",") if f]:
            gens = {f"{fmt}@{t}": Generator(net, threads=t, weights=fmt) for t in counts}
            if all(g.weights == fmt for g in gens.values()):
                paths.update(gens)
            else:  # this model does not take the format (Q8_0: rows of whole 32-weight blocks): said, not timed
                res[f"{fmt}_skipped"] = next(iter(gens.values())).decode_reason
    t0 = time.perf_counter()
    for g in paths.values():
        g.compile(len(prompt), a.new_tokens)
    res["cached_compile_s"] = round(time.perf_counter() - t0, 2)
    per_token = weight_bytes_per_token(cfg)
    l3 = l3_bytes()
    lib = build_decode_kernel()
    # the limit: the best of independent reads of the weight bytes (and of DRAM, past 2x L3)
    benches = {"": ReadBench(per_token, lib)}
    if per_token < 2 * l3 or not l3:
        benches["dram_"] = ReadBench(max(2 * l3, 256 << 20), None, gemv=False)
    tps: dict[str, list[float]] = {}
    tokens: dict[str, list[int]] = {}
    for _ in range(a.rounds):  # interleaved, so load on a shared machine hits every path alike
        for t in counts:
            for name, rb in benches.items():
                rb.measure(t, 3 if name else max(2, min(10, (256 << 20) // per_token)))
        for phase in ("", "load:") if a.load else ("",):  # quiet, then beside the busy loop (--load)
            with busy_loop() if phase else contextlib.nullcontext():
                for t in counts if hf is not None else ():
                    out = hf.run(t)
                    tps.setdefault(f"{phase}hf@{t}", []).append(out["tokens_per_s"])
                    tokens["hf"] = out["tokens"]
                for name, g in paths.items():
                    t0 = time.perf_counter()
                    tokens[name] = g.generate(prompt, a.new_tokens)  # no eos: always the full length
                    tps.setdefault(phase + name, []).append(len(tokens[name]) / (time.perf_counter() - t0))
    # peak RSS over the timed rounds, read before the uncached path compiles: HF's process holds only its side; ours
    # holds every timed path at once (the fp32 network and its fused step's views, the fp16 and q8_0 copies, the
    # decoder's graphs), so its peak bounds any one path's from above. Each path alone: scripts/bench/memory.py.
    from tasks.training.hardware import peak_rss_bytes

    res["peak_rss_gb"] = round(peak_rss_bytes() / 1e9, 3)
    res["peak_rss_scope"] = (
        "this process: every timed path (" + ", ".join(sorted({k.split("@")[0] for k in paths})) + ")"
    )
    if hf is not None:
        res["hf_peak_rss_gb"] = round(peak_rss_bytes(hf.proc.pid) / 1e9, 3)  # its process's VmHWM, alive
        hf.close()
    t0 = time.perf_counter()
    gen.compile(len(prompt), a.new_tokens, use_cache=False)
    res["uncached_compile_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    tokens["uncached"] = gen.generate(prompt, a.new_tokens, use_cache=False)
    res["uncached_tokens_per_s"] = round(len(tokens["uncached"]) / (time.perf_counter() - t0), 2)

    def best_of(side: str) -> tuple[float, str]:
        return max((max(v), k) for k, v in tps.items() if k.startswith(side + "@"))

    if a.load:  # each side's best thread count, quiet and beside the busy loop
        res["background"] = BUSY_LOOP
        res["load_slowdown"] = {}
        res["load_slowdown_by"] = "median of the rounds"
        res["load_slowdown_best"] = {}
        for side in ["hf", "cached", *STORED]:
            if any(k.startswith(f"load:{side}@") for k in tps):
                (quiet, key), loaded = best_of(side), best_of(f"load:{side}")[0]
                res[f"load_{side}_tokens_per_s"] = round(loaded, 2)
                # each round's loaded run against the same round's quiet one (the side's best thread count), the
                # median over rounds, as the train bench: a best-of-rounds ratio is one noisy round's luck on a VM
                # whose speed moves between rounds
                pairs = zip(tps[key], tps["load:" + key], strict=True)
                res["load_slowdown"][side] = round(statistics.median(1 - w / q for q, w in pairs), 3)
                res["load_slowdown_best"][side] = round(1 - loaded / quiet, 3)
    best = {"cached": best_of("cached")[0]}
    res["tokens_per_s"] = round(best["cached"], 2)
    res["best_threads"] = int(best_of("cached")[1].split("@")[1])
    if hf is not None:
        best["hf"], hf_key = best_of("hf")
        ours = tps[best_of("cached")[1]]
        res.update(
            hf_tokens_per_s=round(best["hf"], 2),
            hf_best_threads=int(hf_key.split("@")[1]),
            speedup_vs_hf=round(best["cached"] / best["hf"], 2),
            speedup_vs_hf_rounds=[round(x / max(tps[f"hf@{t}"][i] for t in counts), 2) for i, x in enumerate(ours)],
            hf_same_tokens_prefix=next(
                (i for i, (x, y) in enumerate(zip(tokens[f"cached@{counts[-1]}"], tokens["hf"])) if x != y),
                len(tokens["hf"]),
            ),
        )
    for fmt in STORED:
        if any(k.startswith(f"{fmt}@") for k in tps):
            best[fmt], key = best_of(fmt)
            res.update(
                {
                    f"{fmt}_tokens_per_s": round(best[fmt], 2),
                    f"{fmt}_best_threads": int(key.split("@")[1]),
                    f"{fmt}_speedup_vs_fp32": round(best[fmt] / best["cached"], 2),
                    f"{fmt}_same_tokens_prefix": next(
                        (i for i, (x, y) in enumerate(zip(tokens[key], tokens["uncached"])) if x != y),
                        len(tokens["uncached"]),
                    ),
                }
            )
    if "decoder" in tps:
        best["decoder"] = max(tps["decoder"])
        res["decoder_tokens_per_s"] = round(best["decoder"], 2)
        if hf is not None:
            res["decoder_speedup_vs_hf"] = round(best["decoder"] / best["hf"], 2)
    res["tokens_per_s_by_threads"] = {name: [round(x, 1) for x in v] for name, v in tps.items()}

    bw = {f"{pre}{impl}": v for pre, rb in benches.items() for impl, v in rb.bytes_per_s().items()}
    limit_by, limit = max(bw.items(), key=lambda kv: kv[1])
    res.update(
        decode_ms_per_token=round(1000 / best["cached"], 2),
        weight_mb_per_token=round(per_token / 1e6, 1),
        l3_mb=round(l3 / 2**20),
        bandwidth_gb_per_s={k: round(v / 1e9, 1) for k, v in bw.items()},
        bandwidth_limit_by=limit_by,
        bandwidth_limit_gb_per_s=round(limit / 1e9, 1),
        bandwidth_limit_tokens_per_s=round(limit / per_token, 1),
    )
    over = []
    sides = [("cached", "", 1.0), *((f, f"{f}_", STORED[f]) for f in STORED), ("decoder", "decoder_", 1.0)]
    for name, key, scale in [*sides, ("hf", "hf_", 1.0)]:
        if name in best:
            frac = best[name] * per_token * scale / limit  # stored formats read `scale` of fp32's bytes
            if frac > 1:
                over.append(f"{name} {best[name]:.1f} tokens/s = {frac:.2f}x")
            res[f"{key}fraction_of_bandwidth_limit"] = round(min(frac, 1.0), 3)
    if over:  # a path faster than the limit: the limit under-measures this machine, so its fractions are not real
        res["bandwidth_note"] = (
            f"LIMIT TOO LOW: {', '.join(over)} the limit {limit / 1e9:.1f} GB/s "
            f"({limit_by}); fractions clipped to 1, read none of them as measured"
        )
        print(f"[generate] WARNING {res['bandwidth_note']}", file=sys.stderr, flush=True)
    res["kv_speedup"] = round(best["cached"] / res["uncached_tokens_per_s"], 2)  # secondary: vs our own uncached path
    # the fp32 paths (fp16's rounded weights may part from them: fp16_same_tokens_prefix)
    res["same_tokens"] = all(
        v == tokens["uncached"] for k, v in tokens.items() if k != "hf" and k.split("@")[0] not in STORED
    )

    if a.requests <= 0:  # decode only
        record(res, a)
        return
    lm = MindSporeLM(net=net, tokenizer=None, eot_token_id=2, batch_size=a.batch_size, progress=False)
    reqs = [
        (
            None,
            [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(20, 101)))],
            [int(t) for t in rng.integers(3, cfg.vocab_size, int(rng.integers(1, 13)))],
        )
        for _ in range(a.requests)
    ]
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)  # warm-up: compiles the scorer's two graphs
    res["eval_compile_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    lm._loglikelihood_tokens(reqs)
    dt = time.perf_counter() - t0
    n_tok = sum(min(len(c) + len(x), lm.max_length + 1) - 1 for _, c, x in reqs)
    res.update(
        eval_requests_per_s=round(a.requests / dt, 2),
        eval_tokens_per_s=round(n_tok / dt, 1),
        eval_batch_size=a.batch_size,
        eval_shapes=sorted(lm.scorer.shapes_run),
    )
    record(res, a)


if __name__ == "__main__":
    main()
