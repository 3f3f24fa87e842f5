"""Serving throughput and latency of `msllm serve` at 1, 4 and 16 (default) concurrent streaming clients.

A random-init model of `--preset` (default `small`, the demo's shape) is written as a model
artifact (store format, a SentencePiece tokenizer trained on Shakespeare at the preset's
vocabulary size) and, for the onnxruntime backend, as an export-style directory holding the
KV-cache ONNX decoder of the same weights (`tasks.deploy.onnx_decoder`, what the export stage
writes); `--artifact PATH` serves an existing model artifact instead (and, for onnxruntime, the KV-cache ONNX decoder
built from its weights; an export artifact serves on onnxruntime alone). For each backend a real
server process (`python -m tasks.cli serve`) is started on a free loopback port; the
onnxruntime backend runs twice, with batched decoding (one call per round for all active
sequences, the default) and interleaved (`--no-batching`: one call per sequence); the MindSpore backend batched
(`mindspore`: `--parallel` slots, default the largest concurrency level, `--weights`) or interleaved
(`mindspore-interleaved`: `--parallel 1`). For each
concurrency level C, C clients each send `--rounds` streaming completion requests one after
another (a `--prompt-tokens` token-id prompt, `--new-tokens` greedy tokens), after one
warm-up request per client. Clients are raw `httpx` SSE readers in one asyncio loop (the
`openai` client's parsing would cost the 2-core machine more than the server's work).

Per level: requests/s and output tokens/s over the wall time, p50/p95 time to first token
(request sent -> first text chunk) and inter-token latency (the gaps between a stream's
chunks, pooled over all requests), and whether every request's text is the text one request alone got (greedy,
the same prompt: continuous batching must not change a sequence's tokens). Per backend, the server process's peak
resident memory over all its levels (`peak_rss_gb`: its VmHWM, read before it is stopped). One JSON line with the
CPU and ISA (scripts/bench/host.py), appended to docs/bench/results.jsonl (report.py's "serve" table).

    python scripts/bench/serve.py [--preset small] [--backends onnxruntime,mindspore] [--concurrency 1,4,16]
    python scripts/bench/serve.py --artifact artifacts/convert/<key> --weights q8_0      # SmolLM2 after convert
    python scripts/bench/serve.py --preset tiny --new-tokens 8 --concurrency 1,4 --rounds 1 --results ''  # smoke

With `--guidellm BIN --guidellm-tokenizer HF_DIR` (guidellm 0.8.1 installed in its own venv: docs/SERVING.md,
"Load testing with guidellm"), each level is also run by guidellm against the same server (its synthetic prompts of
`--prompt-tokens` tokens by HF_DIR's tokenizer, `--new-tokens` output tokens, C concurrent streams, C × `--rounds`
requests to /v1/completions); its medians go into the line beside ours under `guidellm`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host import describe  # noqa: E402  (scripts/bench/)
from report import add_record_args, record  # noqa: E402

from tasks.training.hardware import peak_rss_bytes  # noqa: E402


def _percentile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_artifacts(preset: str, root: Path, backends: list[str]) -> dict[str, Path]:
    """{backend: artifact dir} for a random-init model of `preset`."""
    import mindspore as ms

    from tests.helpers import tiny_model_artifact  # the store-format model artifact the tests use

    ms.set_device("CPU")
    model = tiny_model_artifact(root, preset=preset)
    out = {"mindspore": model}
    if "onnxruntime" in backends:
        out["onnxruntime"] = onnx_of(model, root / "export" / f"{preset}-kv")
    return out


def onnx_of(model: Path, exp: Path) -> Path:
    """An export-style directory holding the KV-cache ONNX decoder of model artifact `model`'s weights (what the export
    stage writes), its tokenizer files, model.json and prompt style."""
    from tasks.deploy.onnx_decoder import build_decoder, save_model
    from tasks.store.model_artifact import read_info
    from tasks.store.tensors import load_weights
    from tasks.tokenizer import tokenizer_files

    exp.mkdir(parents=True, exist_ok=True)
    info = read_info(model)
    save_model(
        build_decoder(info["model"], load_weights(model), metadata={"eos_id": info["tokenizer"]["eos_id"]}),
        exp / "model.onnx",
    )
    for f in [*tokenizer_files(model), model / "model.json", model / "prompt_style.json"]:
        if Path(f).is_file():
            shutil.copy2(f, exp / Path(f).name)
    return exp


class ServerProcess:
    def __init__(self, artifact: Path, log_path: Path, max_active: int, *extra: str):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tasks.cli",
                "serve",
                str(artifact),
                "--port",
                str(self.port),
                "--max-active",
                str(max_active),
                *extra,
            ],
            cwd=REPO,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        from tasks.serving.health import ServerDied, wait_healthy

        try:
            wait_healthy(self.proc, self.url)
        except ServerDied as exc:
            raise SystemExit(f"{exc}; see {log_path}") from None
        self.startup_s = time.perf_counter() - t0
        self.model = json.loads(urllib.request.urlopen(self.url + "/v1/models").read())["data"][0]["id"]

    def stop(self) -> None:
        from tasks.serving.health import stop_group

        stop_group(self.proc)
        self.log.close()


async def _one(client, url: str, body: dict) -> dict:
    t0 = time.perf_counter()
    stamps, usage, text = [], None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"request failed: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and chunk["choices"][0]["text"]:
                stamps.append(time.perf_counter())
                text.append(chunk["choices"][0]["text"])
            usage = chunk.get("usage") or usage
    tokens = usage["completion_tokens"] if usage else len(stamps)
    return {"t0": t0, "stamps": stamps, "tokens": tokens, "text": "".join(text)}


async def _level(url: str, model: str, concurrency: int, rounds: int, prompt: list[int], new_tokens: int) -> dict:
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(_one(client, url, {**body, "max_tokens": 2}) for _ in range(concurrency)))  # warm-up

        async def worker() -> list[dict]:
            return [await _one(client, url, body) for _ in range(rounds)]

        t0 = time.perf_counter()
        done = [r for rs in await asyncio.gather(*(worker() for _ in range(concurrency))) for r in rs]
        wall = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["t0"] for r in done if r["stamps"]]
    itl = [b - a for r in done for a, b in zip(r["stamps"], r["stamps"][1:])]
    out_tokens = sum(r["tokens"] for r in done)
    ms = lambda x: None if x is None else round(1000 * x, 2)  # noqa: E731
    texts = sorted({r["text"] for r in done})
    return {
        "texts": texts,
        "clients": concurrency,
        "requests": len(done),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(done) / wall, 3),
        "output_tokens_per_s": round(out_tokens / wall, 1),
        "ttft_p50_ms": ms(_percentile(ttft, 0.5)),
        "ttft_p95_ms": ms(_percentile(ttft, 0.95)),
        "itl_p50_ms": ms(_percentile(itl, 0.5)),
        "itl_p95_ms": ms(_percentile(itl, 0.95)),
        "mean_output_tokens": round(out_tokens / len(done), 1),
    }


def guidellm_level(
    bin_: str,
    tokenizer: str,
    url: str,
    model: str,
    concurrency: int,
    requests: int,
    prompt_tokens: int,
    new_tokens: int,
    out: Path,
) -> dict:
    """One guidellm 0.8.1 run (the docs/SERVING.md recipe) at `concurrency` streams; its medians and request count."""
    cmd = [
        bin_,
        "run",
        "--backend",
        f"kind=openai_http,target={url},model={model},request_format=/v1/completions",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={new_tokens}",
        "--profile",
        f"kind=concurrent,streams={concurrency}",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
        return {"error": f"guidellm exited {done.returncode}: {tail[0]}"}
    m = json.loads(out.read_text())["benchmarks"][0]["metrics"]

    def median(key: str) -> float | None:
        return (m.get(key) or {}).get("successful", {}).get("median")

    return {
        "requests": m["request_totals"],
        "requests_per_s": median("requests_per_second"),
        "output_tokens_per_s": median("output_tokens_per_second"),
        "ttft_ms_p50": median("time_to_first_token_ms"),
        "itl_ms_p50": median("inter_token_latency_ms"),
        "request_latency_s_p50": median("request_latency"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--artifact", default=None, help="serve this export or model artifact instead of a random-init one")
    ap.add_argument(
        "--backends",
        default="onnxruntime,mindspore",
        help="onnxruntime (batched decoding), onnxruntime-interleaved (--no-batching), mindspore (batched: "
        "--parallel slots), mindspore-interleaved (--parallel 1)",
    )
    ap.add_argument("--parallel", type=int, default=0, help="mindspore's decode slots (default: the largest level)")
    ap.add_argument("--weights", default="fp32", help="mindspore's weight format: fp32, fp16 or q8_0")
    add_record_args(ap)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="requests each client sends one after another")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--keep", action="store_true", help="keep the temporary artifacts and server logs")
    ap.add_argument("--guidellm", default=None, help="a guidellm 0.8.1 executable: run each level with it too")
    ap.add_argument(
        "--guidellm-tokenizer",
        default=None,
        help="HF tokenizer directory for guidellm's prompts (`msllm convert --to-hf` of the served model)",
    )
    a = ap.parse_args()
    if a.guidellm and not (shutil.which(a.guidellm) and a.guidellm_tokenizer):
        raise SystemExit(
            f"--guidellm {a.guidellm}: not an executable, or no --guidellm-tokenizer; see docs/SERVING.md, "
            '"Load testing with guidellm"'
        )

    import numpy as np

    levels = [int(c) for c in a.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    try:
        if a.artifact:
            from tasks.serving.backends import artifact_kind

            art = Path(a.artifact).resolve()
            if artifact_kind(art) == "export":
                arts = {"onnxruntime": art}
            else:
                arts = {
                    b: art if b.startswith("mindspore") else onnx_of(art, tmp / "export" / "onnx")
                    for b in a.backends.split(",")
                }
        else:
            arts = make_artifacts(a.preset, tmp, [b.split("-")[0] for b in a.backends.split(",")])
            arts = {b: arts[b.split("-")[0]] for b in a.backends.split(",")}
        res: dict = {
            "bench": "serve",
            **describe(None),
            "weights": a.weights,
            "parallel": a.parallel or max(levels),
            "preset": None if a.artifact else a.preset,
            "artifact": a.artifact,
            "prompt_tokens": a.prompt_tokens,
            "new_tokens": a.new_tokens,
            "rounds": a.rounds,
            "cpus": os.cpu_count(),
            "backends": {},
        }
        for backend, art in arts.items():
            extra = ["--no-batching"] if backend == "onnxruntime-interleaved" else []
            if backend.startswith("mindspore"):
                slots = 1 if backend.endswith("-interleaved") else a.parallel or max(levels)
                extra = ["--parallel", str(slots), "--weights", a.weights]
            srv = ServerProcess(art, tmp / f"serve-{backend}.log", max(levels), *extra)
            try:
                info = json.loads(urllib.request.urlopen(srv.url + "/v1/models").read())["data"][0]
                if a.prompt_tokens + a.new_tokens > info["context_length"]:
                    raise SystemExit(
                        f"prompt + new tokens ({a.prompt_tokens} + {a.new_tokens}) exceed the context "
                        f"{info['context_length']}"
                    )
                prompt = [int(t) for t in np.random.default_rng(0).integers(4, 200, a.prompt_tokens)]
                out = {"startup_s": round(srv.startup_s, 1)}
                alone: list[str] = []
                for c in levels:
                    out[f"c{c}"] = asyncio.run(_level(srv.url, srv.model, c, a.rounds, prompt, a.new_tokens))
                    texts = out[f"c{c}"].pop("texts")
                    alone = texts if c == levels[0] else alone
                    out[f"c{c}"]["same_text_as_alone"] = texts == alone
                    if c != levels[0]:
                        first = out[f"c{levels[0]}"]["output_tokens_per_s"]
                        out[f"c{c}"]["x_one_stream"] = round(out[f"c{c}"]["output_tokens_per_s"] / first, 2)
                    if a.guidellm:
                        out[f"c{c}"]["guidellm"] = guidellm_level(
                            a.guidellm,
                            a.guidellm_tokenizer,
                            srv.url,
                            srv.model,
                            c,
                            c * a.rounds,
                            a.prompt_tokens,
                            a.new_tokens,
                            tmp / f"guidellm-{backend}-c{c}.json",
                        )
                out["peak_rss_gb"] = round(peak_rss_bytes(srv.proc.pid) / 1e9, 2)  # the server's, after every level
                res["backends"][backend] = out
            finally:
                srv.stop()
        record(res, a)
    finally:
        if a.keep:
            print(f"# kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
