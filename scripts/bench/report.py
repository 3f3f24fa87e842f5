"""Benchmark results: where the benches store their JSON lines, and docs/BENCHMARKS.md written from them.

Each bench in scripts/bench/ prints one JSON line and appends it, with `tag` (`--tag smoke` for a smoke
run), to docs/bench/results.jsonl (`--results PATH`; `--results ''` appends nowhere). This script turns
that file into docs/BENCHMARKS.md: one table per bench, one row per line, each row with its date, tag,
CPU model, ISA level (emulated level, kernel body) and threads beside the figures, newest first. It also
writes the smollm2 pipeline's stage times (scripts/bench/pipeline.py's newest measurement of the pipeline as
shipped) into docs/REAL_MODELS.md, between its `<!-- pipeline-times:begin -->` and `<!-- pipeline-times:end -->`
lines. So no benchmark figure in the docs is typed by hand: rerun the bench, then this.

    python scripts/bench/report.py [--results docs/bench/results.jsonl] [--out docs/BENCHMARKS.md]
                                   [--real-models docs/REAL_MODELS.md ('' writes no stage-time table)]
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "bench" / "results.jsonl"
OUT = REPO / "docs" / "BENCHMARKS.md"
REAL_MODELS = REPO / "docs" / "REAL_MODELS.md"

LABELS = [
    ("date", "date"),
    ("tag", "tag"),
    ("cpu", "CPU"),
    ("cpu_isa", "ISA"),
    ("emulated_isa", "emulated"),
    ("kernel_isa_setting", "MSLLM_KERNEL_ISA"),
    ("threads", "threads"),
]
# Per bench: (dotted key in the JSON line, column title). A bench not listed gets its scalar fields.
COLUMNS: dict[str, list[tuple[str, str]]] = {
    "train": [
        ("preset", "preset"),
        ("batch", "batch"),
        ("seq", "seq"),
        ("kernel_body", "kernel body"),
        ("default_step", "default step"),
        ("tokens_per_s", "whole-model tokens/s"),
        ("hf.sdpa.tokens_per_s", "HF sdpa"),
        ("ratio", "× sdpa"),
        ("hf.eager.tokens_per_s", "HF eager"),
        ("ratio_vs_eager", "× eager"),
        ("hf.compile.tokens_per_s", "HF compile"),
        ("ratio_vs_compile", "× compile"),
        ("hf.compile.error", "compile error"),
        ("mfu", "MFU"),
        ("hf.sdpa.mfu", "HF sdpa MFU"),
        ("peak_gflops", "MFU denominator GFLOP/s"),
        ("peak_rss_gb", "peak RSS GB"),
        ("hf.sdpa.peak_rss_gb", "HF sdpa RSS GB"),
        ("rss_ratio", "RSS ×"),
        ("ms_layerwise.tokens_per_s", "layer at a time tokens/s"),
        ("ms_layerwise.ratio_vs_compile", "its × compile"),
        ("ms_layerwise.peak_rss_gb", "its RSS GB"),
        ("ms_layerwise.rss_ratio", "its RSS × sdpa"),
        ("load", "load"),
        ("load_slowdown", "our slowdown under load"),
        ("hf.sdpa.load_slowdown", "sdpa's"),
        ("hf.compile.load_slowdown", "compile's"),
        ("ms_layerwise.load_slowdown", "layer at a time's"),
    ],
    "generate": [
        ("preset", "preset"),
        ("new_tokens", "new tokens"),
        ("decode_path", "decode"),
        ("kernel_body", "kernel body"),
        ("tokens_per_s", "tokens/s"),
        ("hf_tokens_per_s", "HF tokens/s"),
        ("speedup_vs_hf", "× HF"),
        ("peak_rss_gb", "peak RSS GB (all paths)"),
        ("hf_peak_rss_gb", "HF peak RSS GB"),
        ("bandwidth_limit_tokens_per_s", "limit tokens/s"),
        ("bandwidth_limit_by", "limit from"),
        ("fraction_of_bandwidth_limit", "of limit"),
        ("hf_fraction_of_bandwidth_limit", "HF of limit"),
        ("fp16_tokens_per_s", "fp16 weights tokens/s"),
        ("fp16_speedup_vs_fp32", "fp16 × fp32"),
        ("q8_0_tokens_per_s", "Q8_0 weights tokens/s"),
        ("q8_0_speedup_vs_fp32", "Q8_0 × fp32"),
        ("decoder_tokens_per_s", "decoder tokens/s"),
        ("eval_requests_per_s", "eval req/s"),
        ("background", "background"),
        ("rounds", "rounds"),
        ("load_slowdown_by", "slowdown: 1 − loaded / quiet, of"),
        ("load_slowdown.hf", "HF slowdown"),
        ("load_slowdown.cached", "fp32 slowdown"),
        ("load_slowdown.fp16", "fp16 slowdown"),
        ("load_slowdown.q8_0", "q8_0 slowdown"),
    ],
    "memory": [
        ("stage", "stage"),
        ("preset", "preset"),
        ("context", "KV slots"),
        ("requests", "requests"),
        ("batch_size", "batch"),
        ("max_bytes", "scorer cap bytes"),
        ("ours.decode_path", "decode"),
        ("ours.path", "scorer"),
        ("weights", "weights"),
        ("weights_gb", "weights GB"),
        ("kv_cache_gb", "KV GB"),
        ("budget_gb", "budget GB (w + KV + 1 GiB)"),
        ("ours.loaded_rss_gb", "loaded RSS GB"),
        ("peak_rss_gb", "peak RSS GB"),
        ("growth_gb", "growth over last 9/10 GB"),
        ("within_budget", "within budget"),
        ("hf.loaded_rss_gb", "HF loaded GB"),
        ("hf.peak_rss_gb", "HF peak GB"),
        ("hf.growth_gb", "HF growth GB"),
        ("rss_vs_hf", "RSS × HF"),
        ("ours.requests_s", "requests s"),
        ("hf.requests_s", "HF requests s"),
        ("ours.s", "eval s"),
        ("hf.s", "HF eval s"),
    ],
    "serve-memory": [
        ("model", "model"),
        ("context", "KV slots"),
        ("longest", "longest prompt"),
        ("requests", "requests"),
        ("request_longest", "longest request"),
        ("weights", "MindSpore weights"),
        ("weights_gb", "weights GB"),
        ("kv_cache_gb", "KV GB"),
        ("budget_gb", "budget GB (w + KV + 1 GiB)"),
        *[
            (f"{b}.{k}", f"{t}: {c}")
            for b, t in (("mindspore", "MindSpore"), ("onnxruntime", "onnxruntime"))
            for k, c in (
                ("loaded_rss_gb", "loaded GB"),
                ("peak_rss_gb", "peak GB"),
                ("growth_gb", "growth over last 9/10 GB"),
                ("within_budget", "within budget"),
                ("rss_vs_hf", "RSS × HF"),
                ("decode_tokens_per_s", "decode tokens/s"),
                ("decode_vs_hf", "× HF"),
                ("same_text", "same greedy text"),
                ("requests_s", "requests s"),
                ("ladder.-1.ttft_s", "TTFT longest s"),
            )
        ],
        ("hf.ladder.-1.ttft_s", "HF TTFT longest s"),
        ("hf.loaded_rss_gb", "HF loaded GB"),
        ("hf.peak_rss_gb", "HF peak GB"),
        ("hf.growth_gb", "HF growth GB"),
        ("hf.requests", "HF requests"),
        ("hf.decode_tokens_per_s", "HF decode tokens/s"),
        ("mindspore.of", "ladder prompts"),
    ],
    "export": [
        ("preset", "preset"),
        ("mindspore.decode_tokens_per_s", "MindSpore"),
        ("onnx_fp32.decode_tokens_per_s", "onnxruntime fp32"),
        ("onnx_int8.decode_tokens_per_s", "int8"),
        ("genai.decode_tokens_per_s", "genai"),
        ("onnx_vs_mindspore_decode", "fp32 × MS"),
        ("int8_vs_fp32_decode", "int8 × fp32"),
        ("genai_vs_mindspore_decode", "genai × MS"),
    ],
    "finetune": [
        ("preset", "preset"),
        ("batch", "batch"),
        ("seq", "seq"),
        ("lora.trainable_params", "LoRA trainable"),
        ("lora.tokens_per_s", "LoRA tokens/s"),
        ("lora.peak_rss_gb", "LoRA peak RSS GB"),
        ("full.tokens_per_s", "full tokens/s"),
        ("full.peak_rss_gb", "full peak RSS GB"),
        ("lora_vs_full.peak_rss", "LoRA RSS × full"),
        ("hf_lora.tokens_per_s", "HF LoRA tokens/s"),
        ("hf_lora.peak_rss_gb", "HF LoRA peak RSS GB"),
        ("lora_vs_hf_lora.speed", "LoRA × HF speed"),
        ("lora_vs_hf_lora.peak_rss", "LoRA RSS × HF"),
        ("lora_layerwise.tokens_per_s", "LoRA layer at a time tokens/s"),
        ("lora_layerwise.peak_rss_gb", "its RSS GB"),
        ("lora_layerwise_vs_hf_lora.speed", "its × HF speed"),
        ("lora_layerwise_vs_hf_lora.peak_rss", "its RSS × HF"),
    ],
    "llamacpp": [
        ("preset", "preset"),
        ("llamacpp", "llama.cpp"),
        ("F16.tokens_per_s", "F16 tokens/s"),
        ("F16.pp_tokens_per_s", "F16 pp128 tokens/s"),
        ("F16.peak_rss_gb", "F16 RSS GB"),
        ("Q8_0.tokens_per_s", "Q8_0 tokens/s"),
        ("Q8_0.pp_tokens_per_s", "Q8_0 pp128 tokens/s"),
        ("Q8_0.peak_rss_gb", "Q8_0 RSS GB"),
        ("ours.decode_path", "ours: decode"),
        ("ours.tokens_per_s", "ours tokens/s (fp32)"),
        ("ours.pp_tokens_per_s", "ours pp128 tokens/s"),
        ("ours.peak_rss_gb", "ours RSS GB"),
        ("ours_by_weights.fp16.tokens_per_s", "ours tokens/s (fp16)"),
        ("ours_by_weights.fp16.pp_tokens_per_s", "ours fp16 pp128 tokens/s"),
        ("ours_by_weights.fp16.peak_rss_gb", "ours fp16 RSS GB"),
        ("ours_by_weights.q8_0.tokens_per_s", "ours tokens/s (q8_0)"),
        ("ours_by_weights.q8_0.pp_tokens_per_s", "ours q8_0 pp128 tokens/s"),
        ("ours_by_weights.q8_0.peak_rss_gb", "ours q8_0 RSS GB"),
        ("ours.runtime_rss_gb", "ours: MindSpore runtime GB"),
        ("F16.ours_beyond_runtime_gb", "ours fp16 beyond runtime GB"),
        ("Q8_0.ours_beyond_runtime_gb", "ours q8_0 beyond runtime GB"),
        ("F16.ours_weights", "ours × F16 in"),
        ("F16.ours_vs_llamacpp", "ours × F16"),
        ("Q8_0.ours_weights", "ours × Q8_0 in"),
        ("Q8_0.ours_vs_llamacpp", "ours × Q8_0"),
        ("F16.same_prefix", "same greedy tokens F16"),
        ("Q8_0.same_prefix", "same greedy tokens Q8_0"),
        ("greedy_tokens", "of"),
    ],
    "serve": [
        ("artifact", "artifact"),
        ("preset", "preset"),
        ("weights", "weights"),
        ("parallel", "slots"),
        ("prompt_tokens", "prompt"),
        ("new_tokens", "new tokens"),
        ("backends.mindspore.c1.output_tokens_per_s", "MindSpore c1 tokens/s"),
        ("backends.mindspore.c1.itl_p50_ms", "ITL p50 ms"),
        ("backends.mindspore.c4.output_tokens_per_s", "MindSpore c4 tokens/s"),
        ("backends.mindspore.c4.x_one_stream", "× one"),
        ("backends.mindspore.c4.itl_p50_ms", "ITL p50 ms"),
        ("backends.mindspore.c4.same_text_as_alone", "same text"),
        ("backends.mindspore.c16.output_tokens_per_s", "MindSpore c16 tokens/s"),
        ("backends.mindspore.c16.x_one_stream", "× one"),
        ("backends.mindspore.c16.itl_p50_ms", "ITL p50 ms"),
        ("backends.mindspore.c16.same_text_as_alone", "same text"),
        ("backends.mindspore.peak_rss_gb", "MindSpore peak RSS GB"),
        ("backends.onnxruntime.c1.output_tokens_per_s", "onnxruntime c1 tokens/s"),
        ("backends.onnxruntime.c1.itl_p50_ms", "ITL p50 ms"),
        ("backends.onnxruntime.c4.output_tokens_per_s", "onnxruntime c4 tokens/s"),
        ("backends.onnxruntime.c4.x_one_stream", "× one"),
        ("backends.onnxruntime.c4.itl_p50_ms", "ITL p50 ms"),
        ("backends.onnxruntime.c4.same_text_as_alone", "same text"),
        ("backends.onnxruntime.c16.output_tokens_per_s", "onnxruntime c16 tokens/s"),
        ("backends.onnxruntime.c16.x_one_stream", "× one"),
        ("backends.onnxruntime.c16.itl_p50_ms", "ITL p50 ms"),
        ("backends.onnxruntime.c16.same_text_as_alone", "same text"),
        ("backends.onnxruntime.peak_rss_gb", "onnxruntime peak RSS GB"),
    ],
    "quality": [
        ("preset", "preset"),
        ("llamacpp", "llama.cpp"),
        ("ctx", "ctx"),
        ("chunks", "chunks"),
        ("ours.fp32.perplexity", "ours fp32 ppl", ".4f"),
        ("ours.fp16.perplexity", "ours fp16 ppl", ".4f"),
        ("ours.fp16.vs_fp32", "fp16 × fp32", ".5f"),
        ("ours.q8_0.perplexity", "ours q8_0 ppl", ".4f"),
        ("ours.q8_0.vs_fp32", "q8_0 × fp32", ".5f"),
        ("ours_q8_0_vs_fp16", "ours q8_0 × fp16", ".5f"),
        ("F16.perplexity", "llama.cpp F16 ppl", ".4f"),
        ("F16.pm", "±"),
        ("Q8_0.perplexity", "llama.cpp Q8_0 ppl", ".4f"),
        ("Q8_0.vs_F16", "llama.cpp Q8_0 × F16", ".5f"),
    ],
    "pipeline": [
        ("pipeline", "pipeline"),
        ("overrides", "overrides"),
        ("init_from", "init_from"),
        ("eval.limit", "eval.limit"),
        ("eval.tasks", "eval.tasks"),
        ("stages.convert", "convert s"),
        ("stages.data", "data s"),
        ("stages.pretrain", "pretrain s"),
        ("stages.data_2", "continued data s"),
        ("stages.pretrain_2", "continued pretrain s"),
        ("stages.finetune", "finetune (+ merge) s"),
        ("stages.eval", "eval s"),
        ("stages.export", "export s"),
        ("outside_tasks_s", "outside tasks s"),
        ("total_s", "total s (flow run)"),
        ("process_s", "process s"),
        ("peak_rss_gb", "peak RSS GB (tree)"),
        ("all_ran", "nothing cached"),
        ("convert_task_run", "convert task run"),
        ("convert_artifact", "convert artifact"),
        ("loadavg_before", "load before"),
        ("prefect", "Prefect server"),
        ("server_cpu_s", "server CPU s"),
        ("slowdown_vs_embedded.total", "total vs embedded %"),
        ("slowdown_vs_embedded.pretrain", "pretrain vs embedded %"),
        ("slowdown_vs_embedded.eval", "eval vs embedded %"),
    ],
}


def add_record_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--results",
        default=str(RESULTS),
        help="append the JSON line to this file ('' appends nowhere); docs/BENCHMARKS.md is made from it",
    )
    ap.add_argument("--tag", default="", help="a label stored with the line, e.g. 'smoke' for a smoke run")


def record(res: dict, a: argparse.Namespace) -> None:
    """Print the bench's JSON line and append it (with `tag`) to `a.results`."""
    line = json.dumps({**res, "tag": a.tag} if a.tag else res)
    print(line, flush=True)
    if a.results:
        path = Path(a.results)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(line + "\n")


def _get(row: dict, key: str):
    """row[a][b]... for key "a.b...": a part that is an integer indexes a list (-1: its last item)."""
    for part in key.split("."):
        if isinstance(row, list) and part.lstrip("-").isdigit() and -len(row) <= int(part) < len(row):
            row = row[int(part)]
        elif isinstance(row, dict) and part in row:
            row = row[part]
        else:
            return None
    return row


def _cell(v, spec: str = "") -> str:
    if v is None:
        return ""
    if isinstance(v, float) and spec:  # a column's own format (perplexities compared to their 4th digit)
        return f"{v:{spec}}"
    if isinstance(v, float):  # 3 significant digits for ratios and fractions, one decimal from 100 up
        return f"{v:.3g}" if abs(v) < 100 else f"{v:,.1f}".removesuffix(".0")
    return str(v).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], source: str) -> str:
    out = [
        "# Benchmarks",
        "",
        f"Written by `scripts/bench/report.py` from `{source}` (one JSON line per run, appended by the scripts",
        "in `scripts/bench/`); do not edit by hand. Rows tagged `smoke` are tiny smoke runs that only show the",
        "scripts work: their figures are not measurements. `emulated`: the ISA a run emulated with `--isa`",
        "(scripts/bench/host.py says what that covers). Newest first.",
        "",
    ]
    if not rows:
        out += [
            "No results yet: run a bench (e.g. `python scripts/bench/train.py`), then "
            "`python scripts/bench/report.py`.",
            "",
        ]
    for bench in sorted({r.get("bench", "?") for r in rows}):
        mine = [r for r in rows if r.get("bench") == bench][::-1]
        cols = COLUMNS.get(bench) or [
            (k, k) for k in mine[0] if k not in {"bench", *dict(LABELS)} and not isinstance(mine[0][k], (dict, list))
        ]
        cols = LABELS + [c for c in cols if any(_get(r, c[0]) is not None for r in mine)]
        out += [f"## {bench}", "", "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
        out += ["| " + " | ".join(_cell(_get(r, c[0]), *c[2:]) for c in cols) + " |" for r in mine]
        out.append("")
    return "\n".join(out)


# ----------------------------------------------------------------------------- docs/REAL_MODELS.md's stage times

TIMES_BEGIN, TIMES_END = "<!-- pipeline-times:begin -->", "<!-- pipeline-times:end -->"
TIMES_PIPELINE = "smollm2"
NOT_MEASURED = (
    "Not measured yet: run `.venv/bin/python scripts/bench/pipeline.py`, then "
    "`.venv/bin/python scripts/bench/report.py`."
)
STAGE_TITLES = {
    "finetune": "finetune (LoRA, then the merge)",
    "data_2": "continued data",
    "pretrain_2": "continued pretrain",
}
_TOTAL = re.compile(r"^\|\s*\*\*total[^|]*\|\s*\*\*([0-9]+(?:\.[0-9]+)?)\*\*", re.M)


def pipeline_times_row(rows: list[dict], pipeline: str = TIMES_PIPELINE) -> dict | None:
    """The newest `pipeline` line for `pipeline` as shipped: not a smoke run, no --set overrides, no --init-from."""
    mine = [
        r
        for r in rows
        if r.get("bench") == "pipeline"
        and r.get("pipeline") == pipeline
        and r.get("tag") != "smoke"
        and not r.get("overrides")
        and not r.get("init_from")
        and r.get("prefect", "embedded") == "embedded"  # the README's command; a server beside is its own row
    ]
    return mine[-1] if mine else None


def _minutes(s) -> str:
    return "" if s is None else f"{s / 60:.1f}"


def pipeline_times_per_cpu(rows: list[dict], pipeline: str = TIMES_PIPELINE) -> list[dict]:
    """The newest shipped `pipeline` line (as `pipeline_times_row`) of each CPU and ISA (emulated or not), newest
    first: stated times hold only on the machine they were taken on, so the doc shows every kind measured."""
    seen: dict[tuple, dict] = {}
    for r in rows:
        if pipeline_times_row([r], pipeline) is r:
            seen[(r.get("cpu"), r.get("cpu_isa"), r.get("emulated_isa"))] = r
    return sorted(seen.values(), key=lambda r: str(r.get("date")), reverse=True)


def _cpu_label(r: dict) -> str:
    isa = f"{r.get('emulated_isa')} capped" if r.get("emulated_isa") else r.get("cpu_isa")
    return f"{r.get('cpu')} ({isa}), {r.get('date')}"


def pipeline_times_md(row: dict | list[dict] | None) -> str:
    """What stands between the markers: the stage-time table of `row` (a `pipeline` line, or one per CPU: a column
    each, the first one's total read back by `stated_total_s`), or NOT_MEASURED."""
    head = "<!-- written by scripts/bench/report.py from docs/bench/results.jsonl: do not edit by hand -->"
    cols = [row] if isinstance(row, dict) else list(row or [])
    if not cols:
        return f"{head}\n{NOT_MEASURED}"
    new = cols[0]
    ev = new.get("eval") or {}
    tasks = ", ".join(ev.get("tasks") or [])
    limit = "null" if ev.get("limit") is None else ev["limit"]
    budget = f"`eval.limit: {limit}` documents per task of `eval.tasks: [{tasks}]`"
    if ev.get("heldout_blocks") is not None:
        budget += f", `eval.heldout_blocks: {ev['heldout_blocks']}`"
    lines = [
        head,
        f"Measured by `scripts/bench/pipeline.py`: the `{new.get('pipeline')}` pipeline as shipped, every stage run "
        f"(a fresh artifact root), one column per CPU (its newest run: the CPU, its ISA, the date), "
        f"{new.get('threads')} threads. Eval budget: {budget}. Load average before each run: "
        + ", ".join(f"{r.get('loadavg_before')}" for r in cols)
        + ".",
        "",
        "| stage | " + " | ".join(_cpu_label(r) for r in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    stages = list(dict.fromkeys(k for r in cols for k in (r.get("stages") or {})))
    lines += [
        f"| {STAGE_TITLES.get(k, k)} | " + " | ".join(_minutes((r.get("stages") or {}).get(k)) for r in cols) + " |"
        for k in stages
    ]
    lines += [
        "| outside the tasks (config, stage keys, lineage) | "
        + " | ".join(_minutes(r.get("outside_tasks_s")) for r in cols)
        + " |",
        "| **total (the flow run)** | " + " | ".join(f"**{_minutes(r.get('total_s'))}**" for r in cols) + " |",
        "",
        "Peak RSS of the whole run (the flow process and every child, summed, sampled every 0.5 s): "
        + ", ".join(f"{r.get('peak_rss_gb')} GB" for r in cols)
        + ". The process took "
        + ", ".join(_minutes(r.get("process_s")) for r in cols)
        + " minutes (Prefect's embedded server starting on a fresh database included).",
    ]
    return "\n".join(lines)


def _between(text: str, where: str) -> tuple[int, int]:
    b, e = text.find(TIMES_BEGIN), text.find(TIMES_END)
    if b < 0 or e < b:
        raise ValueError(f"{where}: no `{TIMES_BEGIN}` ... `{TIMES_END}` block")
    return b + len(TIMES_BEGIN), e


def write_pipeline_times(doc: Path, rows: list[dict]) -> dict | None:
    """Rewrite the block between the markers of `doc` from the newest smollm2 `pipeline` line of each CPU; returns the
    newest of all."""
    text = doc.read_text()
    b, e = _between(text, str(doc))
    row = pipeline_times_row(rows)
    doc.write_text(text[:b] + "\n" + pipeline_times_md(pipeline_times_per_cpu(rows)) + "\n" + text[e:])
    return row


def stated_total_s(text: str, where: str = "docs/REAL_MODELS.md") -> float | None:
    """The total the stage-time block states, in seconds; None when it says the pipeline is not measured yet."""
    b, e = _between(text, where)
    block = text[b:e]
    if m := _TOTAL.search(block):
        return float(m.group(1)) * 60
    if "not measured yet" in block.lower():
        return None
    raise ValueError(f"{where}: the stage-time block has no `| **total ...** | **MINUTES** |` row")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--results", default=str(RESULTS))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument(
        "--real-models",
        default=str(REAL_MODELS),
        help="the doc whose pipeline-times block gets the smollm2 stage times ('' writes none)",
    )
    a = ap.parse_args()
    path = Path(a.results)
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    try:
        source = str(path.resolve().relative_to(REPO))
    except ValueError:
        source = str(path)
    Path(a.out).write_text(render(rows, source))
    print(f"{a.out}: {len(rows)} results")
    if a.real_models:
        try:
            row = write_pipeline_times(Path(a.real_models), rows)
        except ValueError as exc:
            raise SystemExit(f"report: {exc}") from None
        print(f"{a.real_models}: {TIMES_PIPELINE} stage times " + (f"of {row['date']}" if row else "not measured yet"))


if __name__ == "__main__":
    main()
