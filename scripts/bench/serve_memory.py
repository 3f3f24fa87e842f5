"""`msllm serve`'s memory over prompt lengths and many requests, both backends, beside HF `generate`, in one run.

What a served model should need (docs/MEMORY.md): weights + KV cache + 1 GiB at most (`budget_gb`), flat
over prompt lengths and over requests. scripts/bench/memory.py measures the decode path inside one
process; this bench measures the real server: a `python -m tasks.cli serve` process per backend on the
same model (SmolLM2-135M-Instruct: scripts/fetch_smollm2.sh's GGUF converted by `msllm convert`, or
`--model DIR`, any model artifact), over HTTP, one request after another:

1. `ladder`: prompts of 16, 64, 256, 1024 and `--longest` tokens (random ids, seeded), `--new-tokens`
   greedy tokens each: the text, decode tokens/s (each prompt also asked for 1 token: the difference
   of the two requests' times is the other tokens' decode, measured the same way on the HF side;
   `decode_tokens_per_s` is the shortest prompt's, whose prefill varies least), and the server's RSS
   after each; 2. `requests`: `--requests` prompts of random lengths (log-uniform over 1..`--longest`, so short and
   long ones both come often; seeded; `--request-longest` caps them below `--longest`), `--request-tokens` greedy
   tokens each: the server's RSS after the first tenth and at the end (`growth_gb`: what the last nine tenths
   added) and its peak (VmHWM).

`--weights fp16|q8_0`: the MindSpore backend serves in that format (`msllm serve --weights`), and the budget counts
the weights in it (`weights_bytes`). `--preset NAME`: a random-weight model of that shape instead, written once into
the artifact store (stage pretrain, pipeline "bench") with SmolLM2's tokenizer, padded to the shape's vocabulary
where it is larger (`padded_tokenizer`: Llama-3.2-1B's 128256 tokens).

Backends: `mindspore` (the model artifact: the Generator's fused prefill and decode ops) and
`onnxruntime` (an export-style directory of the same weights written here: the KV-cache ONNX decoder of
`tasks.deploy.onnx_decoder`, the tokenizer, model.json and prompt_style.json, as the export stage writes
them). The reference runs in its own process: HF transformers `LlamaForCausalLM` (sdpa) with the same
fp32 weights, loaded as its users load a model (`from_pretrained` of `msllm convert --to-hf`'s directory, written
before it starts), `generate` greedy on the same prompts (ladder and the first
`--hf-requests` requests). `same_text`: how many ladder prompts each backend answered with the text
HF's greedy tokens decode to (the tokenizer's own decode). The KV cache in the budget is the
MindSpore backend's (context_length slots; onnxruntime's grows with the sequence, so it is at most that).

    python scripts/bench/serve_memory.py                      # SmolLM2-135M, both backends, 1000 requests
    python scripts/bench/serve_memory.py --model DIR --requests 20 --longest 100 --tag smoke
    python scripts/bench/serve_memory.py --preset llama-3.2-1b --weights q8_0 --backends mindspore \
        --request-longest 256 --hf-requests 50       # Llama-3.2-1B's shape, 1000 requests
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

GIB = 1024**3


def proc_gb(pid: int | str, field: str) -> float:
    """`field` (VmRSS, VmHWM) of process `pid` from /proc, in GB (10^9 bytes)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def lengths(a, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ladder prompts, request prompts): random token ids in 3..vocab, seeded."""
    import numpy as np

    rng = np.random.default_rng(0)
    ladder = [n for n in (16, 64, 256, 1024) if n < a.longest] + [a.longest]
    top = a.request_longest or a.longest
    sizes = np.exp(rng.uniform(0, math.log(top), a.requests)).astype(int).clip(1, top)
    draw = lambda n: [int(t) for t in rng.integers(3, vocab, int(n))]  # noqa: E731
    return [draw(n) for n in ladder], [draw(n) for n in sizes]


def fetch_model(a) -> Path:
    """The convert artifact of scripts/fetch_smollm2.sh's GGUF (converted once into `a.artifacts`)."""
    r = subprocess.run(["bash", "scripts/fetch_smollm2.sh"], cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(
            f"scripts/fetch_smollm2.sh failed (exit {r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1]}"
        )
    from tasks.stages.runner import prepare
    from tasks.store.artifacts import ArtifactStore

    gguf = REPO / r.stdout.strip().splitlines()[-1]
    return prepare("convert", ArtifactStore(a.artifacts), source=gguf).run(progress=False)


def padded_tokenizer(src: Path, dst: Path, vocab: int) -> Path:
    """`src`'s tokenizer files (an HF tokenizer.json, byte-level BPE) in `dst`, its vocabulary grown to `vocab` ids
    with entries `benchpad<i>` that no merge reaches (plain ASCII: they decode to their own text), so a random-weight
    model of a larger vocabulary (Llama-3.2-1B's 128256) samples ids the tokenizer can decode. A bench's stand-in."""
    from tasks.tokenizer import copy_tokenizer_files

    dst.mkdir(parents=True, exist_ok=True)
    copy_tokenizer_files(src, dst)
    f = dst / "tokenizer.json"
    if not f.is_file():
        raise SystemExit(f"{src}: no tokenizer.json to pad to {vocab} tokens")
    tj = json.loads(f.read_text())
    table = tj["model"]["vocab"]
    n = max(max(table.values()), *(t["id"] for t in tj.get("added_tokens", []))) + 1
    table.update({f"benchpad{i}": i for i in range(n, vocab)})
    f.write_text(json.dumps(tj, ensure_ascii=False))
    return dst


def random_model(preset: str, tokenizer_of: Path, artifacts: Path) -> Path:
    """A model artifact of `preset`'s shape with random weights (memory and speed do not depend on the values) and
    the tokenizer of `tokenizer_of` (padded to the preset's vocabulary where it is larger: `padded_tokenizer`),
    kept in the store `artifacts` (stage pretrain, pipeline "bench"; reused while the preset is unchanged)."""
    from model.config import PRESETS, ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import read_info, write_model
    from tasks.tokenizer import load_tokenizer

    cfg = ModelConfig.from_name(preset)
    vocab = read_info(tokenizer_of)["model"]["vocab_size"]
    if vocab > cfg.vocab_size:
        raise SystemExit(f"--preset {preset}: vocabulary {cfg.vocab_size}, but {tokenizer_of}'s tokenizer has {vocab}")
    store = ArtifactStore(artifacts)
    key = store.key("pretrain", {"preset": PRESETS[preset], "seed": 0, "tokenizer": str(tokenizer_of)}, [], "bench")
    if (done := store.lookup("pretrain", key)) is not None:
        return done
    with tempfile.TemporaryDirectory(prefix="bench-tokenizer-") as td:
        tok_dir = padded_tokenizer(tokenizer_of, Path(td), cfg.vocab_size) if vocab < cfg.vocab_size else tokenizer_of
        weights = {p.name: p.asnumpy() for p in LlamaForCausalLM(cfg, seed=0).trainable_params()}
        with store.build("pretrain", key, pipeline="bench", config={"preset": preset}, inputs=[], code="bench") as b:
            write_model(
                b.dir,
                name="llama",
                config=cfg,
                weights=weights,
                tokenizer_model=tok_dir,
                tokenizer_info=load_tokenizer(tok_dir).info(),
                seq_length=cfg.max_seq_length,
            )
    return b.path


def weights_bytes(cfg, weights: str) -> int:
    """Bytes of `cfg`'s weights as the MindSpore backend holds them in format `weights`: the matrices (embedding /
    LM head included) at 4 (fp32), 2 (fp16) or 34/32 (q8_0: 32 int8 weights and one fp16 scale a block) bytes a
    weight, the norms in float32 (model/fused_decode.py `stored_matrix`)."""
    norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
    per = {"fp32": 4.0, "fp16": 2.0, "q8_0": 34 / 32}[weights]
    return int((cfg.num_parameters - norms) * per + norms * 4)


def write_export(model: Path, out: Path) -> Path:
    """An export-style directory of `model` for the onnxruntime backend (what the export stage serves)."""
    from tasks.deploy.onnx_decoder import build_decoder, save_model
    from tasks.prompts import PROMPT_STYLE_FILE, style_record
    from tasks.store.model_artifact import load_prompt_style, load_tokenizer, read_info
    from tasks.store.tensors import load_weights
    from tasks.tokenizer import copy_tokenizer_files

    out.mkdir(parents=True, exist_ok=True)
    info, tok = read_info(model), load_tokenizer(model)
    save_model(
        build_decoder(info["model"], load_weights(model), metadata={"eos_id": int(tok.eos_id())}), out / "model.onnx"
    )
    copy_tokenizer_files(model, out)
    shutil.copy2(model / "model.json", out / "model.json")
    (out / PROMPT_STYLE_FILE).write_text(json.dumps(style_record(load_prompt_style(model, tok))))
    return out


def _complete(client, url: str, body: dict) -> tuple[str, int, float]:
    """One completion (not streamed): its text, completion tokens and seconds."""
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        raise SystemExit(f"request of {len(body['prompt'])} tokens failed: {r.status_code} {r.text[:300]}")
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["completion_tokens"], time.perf_counter() - t0


def decode_rate(n: int, total_s: float, first_s: float) -> float | None:
    """Decode tokens/s of a request of `n` tokens that took `total_s`, from one of 1 token that took `first_s` (the
    same prompt: prefill and overheads cancel); measured the same way on both sides."""
    return round((n - 1) / (total_s - first_s), 2) if n > 1 and total_s > first_s else None


def serve_side(a, backend: str, artifact: Path, ladder, requests, log: Path) -> dict:
    """A server process on `artifact`; the ladder and the requests; its RSS after each phase."""
    import httpx
    from serve import ServerProcess

    srv = ServerProcess(artifact, log, 1, *(["--weights", a.weights] if backend == "mindspore" else []))
    pid = srv.proc.pid
    try:
        info = json.loads(urllib.request.urlopen(srv.url + "/v1/models").read())["data"][0]
        res = {
            "backend": backend,
            "startup_s": round(srv.startup_s, 1),
            "context_length": info["context_length"],
            "loaded_rss_gb": round(proc_gb(pid, "VmRSS"), 3),
            "ladder": [],
        }
        body = {"model": srv.model, "temperature": 0}
        with httpx.Client(timeout=1800) as c:
            for p in ladder:
                _, _, first_s = _complete(c, srv.url, {**body, "prompt": p, "max_tokens": 1})
                text, n, total_s = _complete(c, srv.url, {**body, "prompt": p, "max_tokens": a.new_tokens})
                res["ladder"].append(
                    {
                        "prompt_tokens": len(p),
                        "text": text,
                        "tokens": n,
                        "ttft_s": round(first_s, 3),
                        "decode_tokens_per_s": decode_rate(n, total_s, first_s),
                        "rss_gb": round(proc_gb(pid, "VmRSS"), 3),
                    }
                )
            first = max(1, len(requests) // 10)
            t0 = time.perf_counter()
            for i, p in enumerate(requests):
                _complete(c, srv.url, {**body, "prompt": p, "max_tokens": a.request_tokens})
                if i + 1 == first:
                    res["rss_after_first_tenth_gb"] = round(proc_gb(pid, "VmRSS"), 3)
        res["requests"] = len(requests)
        res["requests_s"] = round(time.perf_counter() - t0, 1)
        res["rss_end_gb"] = round(proc_gb(pid, "VmRSS"), 3)
        res["growth_gb"] = round(res["rss_end_gb"] - res.get("rss_after_first_tenth_gb", res["rss_end_gb"]), 3)
        res["peak_rss_gb"] = round(proc_gb(pid, "VmHWM"), 3)
        res["decode_tokens_per_s"] = res["ladder"][0]["decode_tokens_per_s"]  # the shortest prompt: least prefill noise
        return res
    finally:
        srv.stop()


def hf_side(a) -> dict:
    """HF transformers (sdpa) with the artifact's fp32 weights, in this process: the same prompts, greedy."""
    import torch
    from transformers import LlamaForCausalLM

    from model.config import ModelConfig
    from tasks.serving.parsing import completion_prompt, document_prefix
    from tasks.store.model_artifact import load_tokenizer, read_info

    torch.set_num_threads(a.threads)
    art = Path(a.model)
    cfg = ModelConfig.from_dict(read_info(art)["model"])
    tok = load_tokenizer(art)
    eos = int(tok.eos_id())
    # as a transformers user loads a model: from_pretrained of its directory (safetensors, no random init first)
    hf = LlamaForCausalLM.from_pretrained(a.hf_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    ladder, requests = lengths(a, cfg.vocab_size)
    prefix = document_prefix(tok)  # what the server puts before token-id prompts (tasks.serving.parsing)

    def gen(p: list[int], n: int) -> tuple[list[int], float]:
        p = completion_prompt(tok, prefix, p)[0]
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos)
        ids = out[0, len(p) :].tolist()
        return (ids[: ids.index(eos)] if eos in ids else ids), time.perf_counter() - t0

    res = {"side": "hf sdpa", "loaded_rss_gb": round(proc_gb("self", "VmRSS"), 3), "ladder": []}
    gen(ladder[0], 2)  # warm-up (the server warms up before it reports healthy)
    for p in ladder:
        _, first_s = gen(p, 1)
        ids, total_s = gen(p, a.new_tokens)
        res["ladder"].append(
            {
                "prompt_tokens": len(p),
                "text": tok.decode(ids),
                "tokens": len(ids),
                "ttft_s": round(first_s, 3),
                "decode_tokens_per_s": decode_rate(len(ids), total_s, first_s),
                "rss_gb": round(proc_gb("self", "VmRSS"), 3),
            }
        )
    reqs = requests[: a.hf_requests]
    first = max(1, len(reqs) // 10)
    t0 = time.perf_counter()
    for i, p in enumerate(reqs):
        gen(p, a.request_tokens)
        if i + 1 == first:
            res["rss_after_first_tenth_gb"] = round(proc_gb("self", "VmRSS"), 3)
    res["requests"] = len(reqs)
    res["requests_s"] = round(time.perf_counter() - t0, 1)
    res["rss_end_gb"] = round(proc_gb("self", "VmRSS"), 3)
    res["growth_gb"] = round(res["rss_end_gb"] - res.get("rss_after_first_tenth_gb", res["rss_end_gb"]), 3)
    res["peak_rss_gb"] = round(proc_gb("self", "VmHWM"), 3)
    res["decode_tokens_per_s"] = res["ladder"][0]["decode_tokens_per_s"]  # the shortest prompt: least prefill noise
    return res


def main() -> None:
    from host import add_isa_arg, apply_isa, describe
    from report import add_record_args, record

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--model", default=None, help="a model artifact (default: SmolLM2-135M-Instruct, fetched and converted)"
    )
    ap.add_argument(
        "--preset",
        default=None,
        help="serve a random-weight model of this shape instead (e.g. "
        "smollm2-360m), with the tokenizer of --model / SmolLM2-135M",
    )
    ap.add_argument(
        "--artifacts",
        default=os.environ.get("MSLLM_ARTIFACTS", str(REPO / "artifacts")),
        help="artifact store for the convert artifact (msllm's default)",
    )
    ap.add_argument("--backends", default="mindspore,onnxruntime")
    ap.add_argument("--longest", type=int, default=2000, help="the longest prompt, tokens")
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per ladder prompt")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument(
        "--request-longest",
        type=int,
        default=None,
        help="the longest request prompt, tokens (default: --longest); the ladder still reaches --longest",
    )
    ap.add_argument(
        "--weights",
        choices=["fp32", "fp16", "q8_0"],
        default="fp32",
        help="the MindSpore backend's weight format (msllm serve --weights); the budget counts the weights in it",
    )
    ap.add_argument("--request-tokens", type=int, default=4, help="greedy tokens per request")
    ap.add_argument("--hf-requests", type=int, default=None, help="requests the HF side runs (default: all)")
    ap.add_argument("--threads", type=int, default=2, help="PyTorch threads on the HF side")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the export directory and the server logs")
    ap.add_argument("--side", choices=["hf"], help=argparse.SUPPRESS)  # the reference's own process
    ap.add_argument("--hf-dir", help=argparse.SUPPRESS)  # its transformers directory (convert --to-hf of --model)
    add_isa_arg(ap)
    add_record_args(ap)
    a = ap.parse_args()
    if a.hf_requests is None:
        a.hf_requests = a.requests
    if a.side:
        print(json.dumps(hf_side(a)))
        return
    apply_isa(a.isa)
    backends = [b for b in a.backends.split(",") if b]
    if unknown := set(backends) - {"mindspore", "onnxruntime"}:
        ap.error(f"--backends: unknown {sorted(unknown)}; choose from mindspore, onnxruntime")
    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from tasks.store.model_artifact import read_info

    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-memory-"))
    try:
        model = Path(a.model).resolve() if a.model else fetch_model(a)
        model_label = a.model or "SmolLM2-135M-Instruct (Q4_1 GGUF -> msllm convert, fp32)"
        if a.preset:
            model = random_model(a.preset, model, Path(a.artifacts))
            model_label = f"{a.preset} (random weights, the tokenizer of {model_label})"
        a.model = str(model)
        cfg = ModelConfig.from_dict(read_info(model)["model"])
        if a.longest + a.new_tokens > cfg.max_seq_length:
            ap.error(
                f"--longest {a.longest} + --new-tokens {a.new_tokens} exceed the model's context {cfg.max_seq_length}"
            )
        ladder, requests = lengths(a, cfg.vocab_size)
        weights_gb = weights_bytes(cfg, a.weights) / 1e9
        res: dict = {
            "bench": "serve-memory",
            **describe(threads=a.threads),
            "model": model_label,
            "preset": a.preset,
            "longest": a.longest,
            "new_tokens": a.new_tokens,
            "requests": a.requests,
            "request_longest": a.request_longest or a.longest,
            "request_tokens": a.request_tokens,
            "weights": a.weights,
            "weights_gb": round(weights_gb, 3),
        }
        arts = {"mindspore": model}
        if "onnxruntime" in backends:
            arts["onnxruntime"] = write_export(model, tmp / "export")
        for b in backends:
            res[b] = serve_side(a, b, arts[b], ladder, requests, tmp / f"serve-{b}.log")
            print(f"# {b}: peak {res[b]['peak_rss_gb']} GB, {res[b]['requests_s']} s", file=sys.stderr, flush=True)
        if not a.no_hf:
            from tasks.stages.convert import to_hf

            to_hf(model, tmp / "hf", dtype="float32")
            args = [
                sys.executable,
                __file__,
                "--side",
                "hf",
                "--model",
                a.model,
                "--longest",
                str(a.longest),
                "--new-tokens",
                str(a.new_tokens),
                "--requests",
                str(a.requests),
                "--request-tokens",
                str(a.request_tokens),
                "--hf-requests",
                str(a.hf_requests),
                "--hf-dir",
                str(tmp / "hf"),
                "--request-longest",
                str(a.request_longest or a.longest),
                "--threads",
                str(a.threads),
            ]
            out = subprocess.run(args, capture_output=True, text=True, env=os.environ)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                res["hf"] = {"error": (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1]}
            else:
                res["hf"] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if a.keep:
            print(f"# kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    summarize(res, cfg, backends)
    record(res, a)


def summarize(res: dict, cfg, backends: list[str]) -> None:
    """Budget (weights + the MindSpore backend's KV cache + 1 GiB), within it, flat, and the ratios to HF."""
    ctx = max((res[b].get("context_length", 0) for b in backends), default=0)
    kv_gb = 2 * cfg.num_layers * cfg.num_kv_heads * ctx * cfg.head_dim * 4 / 1e9
    res.update(context=ctx, kv_cache_gb=round(kv_gb, 3), budget_gb=round(res["weights_gb"] + kv_gb + GIB / 1e9, 3))
    hf = res.get("hf", {})
    for b in backends:
        side = res[b]
        side["within_budget"] = side["peak_rss_gb"] <= res["budget_gb"]
        if "peak_rss_gb" in hf:
            side["rss_vs_hf"] = round(side["peak_rss_gb"] / hf["peak_rss_gb"], 2)
        if hf.get("decode_tokens_per_s") and side.get("decode_tokens_per_s"):
            side["decode_vs_hf"] = round(side["decode_tokens_per_s"] / hf["decode_tokens_per_s"], 2)
        if hf.get("ladder"):
            side["same_text"] = sum(x["text"] == y["text"] for x, y in zip(side["ladder"], hf["ladder"]))
            side["of"] = len(hf["ladder"])


if __name__ == "__main__":
    main()
