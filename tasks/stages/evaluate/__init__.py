"""The eval stage: perplexity, lm-eval tasks and sample generations of a model artifact.

    path = run(cfg, store, model_artifact, data_artifact)    # cached by content, like every stage
    print(compare_table(store, path_a, path_b))               # two eval artifacts side by side

What it measures (`eval` section of pipelines.yaml):
  - perplexity and bits per byte on the held-out (`valid`) split of a data artifact (the
    one the model was trained on, found through its lineage when not given), and on each
    of `eval.perplexity_files` (plain text, or JSON Lines with a "text" field, gzip too;
    each document scored in the harness's rolling windows);
  - `eval.tasks` through lm-evaluation-harness with `tasks.stages.evaluate.lm_adapter.MindSporeLM`:
    local task names (`local_arc_easy` …, or the tag `local` for all eight; see
    tasks/stages/evaluate/lm_tasks/) run offline from tasks/stages/evaluate/benchmarks/ (package data); any other name
    is passed to the harness's own task index (its dataset must be in the HF cache);
  - completions of `eval.prompts` (greedy or sampled, KV cache).

Artifact payload:
    results.json         lm-eval's result dict (results, configs, versions, n-shot, n-samples, …) without the
                         per-request records, plus "perplexity": {set: {tokens, bytes, perplexity, bits_per_byte}}
                         and "base_perplexity": {model, path, chain, "held-out": row} (a model with a base)
    samples/<task>.jsonl the harness's per-document records (arguments, responses, metrics)
    generations.jsonl    {"prompt", "completion", "new_tokens", generation settings}
    report.md            markdown: perplexity table, lm-eval's task table, the generations
manifest metrics: perplexity, bits_per_byte (held-out split), base_perplexity / base_bits_per_byte (the base
model's, on the same held-out blocks; below), "<file>.perplexity" / "<file>.bits_per_byte", "<task>.<metric>" for
each task's main metric (acc where it has one).

The base model: for a model with one (a merged finetune, a continued pretrain: `perplexity.base_chain` follows the model
inputs of the manifests back to a model converted or trained from scratch), that first model's held-out
perplexity on the same blocks, in results.json ("base_perplexity") and beside the evaluated one in report.md.

MindSpore, lm-eval and TensorBoard load inside the functions that use them (lazy): the CLI and the flows import
this module (the stage's `run`, `selection_lines`) before any of them is needed.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.config.schema import PipelineConfig
from tasks.stages import code_version
from tasks.stages.evaluate.perplexity import base_perplexity, documents_perplexity, heldout_perplexity, read_documents
from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.store.errors import STORAGE_ERRNOS, ArtifactError, storage_error
from tasks.tokenizer import files_sha256, tokenizer_files

STAGE = "eval"
LOCAL_TASKS = Path(__file__).resolve().parent / "lm_tasks"
_BOOTSTRAP_ITERS = 1000  # stderr of non-mean aggregates (lambada perplexity); lm-eval's 100000 takes minutes


# ----------------------------------------------------------------------------- inputs


class EvalError(RuntimeError):
    """The model cannot be scored (non-finite logits or scores); rerunning cannot fix it."""

    permanent = True


def check_finite_logits(lm, model_artifact: Path) -> None:
    """One forward pass over a short prompt: non-finite logits make every score meaningless."""
    import mindspore as ms

    ids = np.asarray([[lm.eot_token_id] + lm.tok_encode("The quick brown fox")], np.int32)
    logits = lm.net(ms.Tensor(ids)).asnumpy()
    if not np.isfinite(logits).all():
        raise EvalError(
            f"{model_artifact}: the model's logits are non-finite (NaN/Inf weights?); no eval artifact "
            "is written: retrain it (a stage that published it should have refused; see "
            "docs/RELIABILITY.md) or evaluate another model artifact"
        )


def stage_key(
    cfg: PipelineConfig, store: ArtifactStore, model_artifact: Path, data_artifact: Path | None
) -> tuple[str, list[dict[str, Any]]]:
    inputs = [store.input_ref(model_artifact)] + ([store.input_ref(data_artifact)] if data_artifact else [])
    for f in cfg.eval.perplexity_files:
        p = cfg.resolve_path(f)
        if not p.is_file():
            raise FileNotFoundError(f"eval.perplexity_files: {f} not found (resolved to {p})")
        inputs.append(raw_file_input(p))
    section = cfg.section("eval")
    section.pop("fused_kernels")  # which kernels decode changes the speed, not the tokens
    return store.key(STAGE, section, inputs, code_version(STAGE)), inputs


# ----------------------------------------------------------------------------- lm-eval tasks


class _QuietCustomDatasetNote(logging.Filter):
    """lm-eval logs a note about --metadata for every task with a custom loader (all local tasks)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(tasks: list[str]):
    """A TaskManager over the local tasks, plus lm-eval's own index only when a task needs it (building it takes
    seconds)."""
    from lm_eval.tasks import TaskManager

    local = TaskManager(include_path=str(LOCAL_TASKS), include_defaults=False)
    if all(t in local.all_tasks for t in tasks):
        return local
    tm = TaskManager(include_path=str(LOCAL_TASKS), include_defaults=True)
    unknown = [t for t in tasks if t not in tm.all_tasks]
    if unknown:
        local_names = ", ".join(sorted(local.all_tasks))
        raise ValueError(
            f"eval.tasks: unknown task(s) {unknown}; local tasks: {local_names}; "
            f"or a task name of lm-eval (its dataset must be in the HF cache)"
        )
    return tm


def run_tasks(lm, tasks: list[str], limit: int | None, seed: int = 0, tm=None) -> dict[str, Any]:
    """lm_eval.simple_evaluate on our model; returns the harness's result dict (with "samples")."""
    # lm-eval bootstraps stderrs in a fork()ed multiprocessing.Pool; forking a process that
    # holds MindSpore's threads deadlocks (seen under Prefect). One process is fast enough.
    os.environ["DISABLE_MULTIPROC"] = "1"
    import lm_eval

    tm = tm or task_manager(tasks)
    note_filter = _QuietCustomDatasetNote()
    task_logger = logging.getLogger("lm_eval.api.task")
    task_logger.addFilter(note_filter)
    try:
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=list(tasks),
            limit=limit,
            task_manager=tm,
            log_samples=True,
            bootstrap_iters=_BOOTSTRAP_ITERS,
            random_seed=seed,
            numpy_random_seed=seed,
            torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    finally:
        task_logger.removeFilter(note_filter)


def main_metrics(results: dict[str, Any]) -> dict[str, float]:
    """{"<task>.<metric>": value} for each task's main metric: acc when it has one, else its first metric."""
    out = {}
    for task, res in results.get("results", {}).items():
        names = [k for k, v in res.items() if "," in k and "_stderr" not in k and isinstance(v, (int, float))]
        if not names:
            continue
        main = next((k for k in names if k.split(",")[0] == "acc"), names[0])
        out[f"{task}.{main.split(',')[0]}"] = float(res[main])
    return out


def _json_default(o: Any) -> Any:
    from lm_eval.utils import handle_non_serializable

    return handle_non_serializable(o)


def _dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=_json_default, ensure_ascii=False) + "\n"


# ----------------------------------------------------------------------------- the stage


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[eval] {msg}", file=sys.stderr, flush=True)


def perplexities(cfg: PipelineConfig, lm, data_artifact: Path | None, progress: bool) -> dict[str, dict[str, Any]]:
    """{"held-out": …, "<file name>": …} rows of tokens, bytes, perplexity, bits_per_byte."""
    out = {}
    if data_artifact is not None:
        out["held-out"] = heldout_perplexity(lm, data_artifact, cfg.eval.batch_size, progress, cfg.eval.heldout_blocks)
    for f in cfg.eval.perplexity_files:
        p = cfg.resolve_path(f)
        out[p.name] = documents_perplexity(lm, read_documents(p), progress)
    for name, r in out.items():
        _log(
            progress,
            f"{name}: perplexity {_fmt(r['perplexity'])}, {_fmt(r['bits_per_byte'])} bits/byte ({r['tokens']} tokens)",
        )
    return out


def sample_generations(lm, ev, progress: bool = False) -> list[dict[str, Any]]:
    """Completions of ev.prompts with the eval section's generation settings."""
    out = []
    for prompt in ev.prompts:
        completion = lm.generate_text(
            prompt,
            until=ev.stop,
            max_gen_toks=ev.max_new_tokens,
            temperature=ev.temperature,
            top_k=ev.top_k,
            top_p=ev.top_p,
            seed=ev.seed,
        )
        out.append(
            {
                "prompt": prompt,
                "completion": completion,
                "max_new_tokens": ev.max_new_tokens,
                "temperature": ev.temperature,
                "top_k": ev.top_k,
                "top_p": ev.top_p,
                "seed": ev.seed,
            }
        )
        _log(progress, f"{prompt!r} -> {completion[:80]!r}")
    return out


def run(
    cfg: PipelineConfig,
    store: ArtifactStore,
    model_artifact: Path,
    data_artifact: Path | None = None,
    progress: bool = True,
    selection: dict[str, str] | None = None,
    *,
    keyed: tuple,
) -> Path:
    """Return the eval artifact of this model (and data artifact), computing it when not cached.

    selection: why this model was evaluated (tasks.stages.upstream.ModelChoice.record(), plus a "note"
    when it differs from the previous report's); kept in the manifest as `model_choice` and at the top of
    report.md. Not part of the key: the same model and settings are the same eval, however chosen.
    `keyed`: what `stage_key` returned for these arguments, from the stage runner (tasks/stages/runner.py), which
    resolved the inputs, checked the machine and computed it once."""
    model_artifact = store.inside(model_artifact)
    data_artifact = store.inside(data_artifact) if data_artifact else None
    key, inputs = keyed
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    with store.lock(STAGE, key):  # one build per key: an identical run waits, then finds the artifact
        hit = store.lookup(STAGE, key)
        if hit is not None:
            print(f"[eval] {hit} is published (built by another process meanwhile); using it", file=sys.stderr)
            return hit
        return _evaluate(cfg, store, model_artifact, data_artifact, key, inputs, progress, selection)


def _evaluate(
    cfg: PipelineConfig,
    store: ArtifactStore,
    model_artifact: Path,
    data_artifact: Path | None,
    key: str,
    inputs: list[dict[str, Any]],
    progress: bool,
    selection: dict[str, str] | None = None,
) -> Path:
    if data_artifact is not None and files_sha256(tokenizer_files(data_artifact)) != files_sha256(
        tokenizer_files(model_artifact)
    ):
        raise ValueError(
            f"{data_artifact} was tokenized with another tokenizer than {model_artifact}; "
            "pass the data artifact the model was trained on (or none)"
        )
    ev = cfg.eval
    tm = task_manager(ev.tasks) if ev.tasks else None  # unknown task names fail here, before any compute
    from tasks.stages.evaluate.lm_adapter import MindSporeLM

    t0 = time.perf_counter()
    lm = MindSporeLM(
        pretrained=model_artifact,
        batch_size=ev.batch_size,
        max_gen_toks=ev.max_new_tokens,
        progress=progress,
        fused_kernels=ev.fused_kernels,
        weights=ev.weights,
    )
    check_finite_logits(lm, model_artifact)  # before any score: NaN logits give NaN ppl but "accuracy 1.0"
    ppl = perplexities(cfg, lm, data_artifact, progress)
    metrics: dict[str, Any] = {}
    if "held-out" in ppl:
        metrics.update(perplexity=ppl["held-out"]["perplexity"], bits_per_byte=ppl["held-out"]["bits_per_byte"])
    for name, row in ppl.items():
        if name != "held-out":
            metrics.update({f"{name}.perplexity": row["perplexity"], f"{name}.bits_per_byte": row["bits_per_byte"]})
    results: dict[str, Any] = {
        "results": {},
        "configs": {},
        "versions": {},
        "n-shot": {},
        "higher_is_better": {},
        "n-samples": {},
    }
    if ev.tasks:
        _log(progress, f"lm-eval tasks {ev.tasks} (limit {ev.limit})")
        results = run_tasks(lm, ev.tasks, ev.limit, ev.seed, tm)
        metrics.update(main_metrics(results))
    bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
    if bad:
        raise EvalError(
            f"{model_artifact}: non-finite scores ({', '.join(f'{k}={metrics[k]}' for k in bad[:4])}); "
            "the model is broken (NaN/Inf weights or logits) and no eval artifact is written; "
            "evaluate another model artifact"
        )
    generations = sample_generations(lm, ev, progress)
    weights = lm.weights  # the format that scored and decoded (eval.weights, or fp32 where the fused steps cannot)
    del lm
    base = base_perplexity(store, model_artifact, data_artifact, ev, progress) if data_artifact is not None else None
    if base and "held-out" in base:
        row = base["held-out"]
        _log(
            progress,
            f"held-out, base model {base['model']}: perplexity {_fmt(row['perplexity'])}, "
            f"{_fmt(row['bits_per_byte'])} bits/byte ({row['tokens']} tokens)",
        )
        metrics.update(base_perplexity=row["perplexity"], base_bits_per_byte=row["bits_per_byte"])
    metrics["eval_seconds"] = round(time.perf_counter() - t0, 1)

    samples = results.pop("samples", {})
    results["perplexity"] = ppl
    results["weights"] = weights
    if base:
        results["base_perplexity"] = base
    # side outputs first: publishing is the last step, so a failure here (a read-only run dir) leaves no
    # artifact whose rerun would be a cache hit that never writes them
    _write_events(cfg, store, key, model_artifact, metrics)
    with store.build(
        STAGE, key, pipeline=cfg.name, config=cfg.section("eval"), inputs=inputs, code=code_version(STAGE)
    ) as b:
        (b.dir / "results.json").write_text(_dump(results), encoding="utf-8")
        for task, recs in samples.items():
            (b.dir / "samples").mkdir(exist_ok=True)
            with open(b.dir / "samples" / f"{task}.jsonl", "w", encoding="utf-8") as f:
                for r in recs:
                    f.write(json.dumps(r, default=_json_default, ensure_ascii=False) + "\n")
        with open(b.dir / "generations.jsonl", "w", encoding="utf-8") as f:
            for g in generations:
                f.write(json.dumps(g, ensure_ascii=False) + "\n")
        (b.dir / "report.md").write_text(
            render_report(model_artifact, data_artifact, results, generations, ev.limit, selection), encoding="utf-8"
        )
        if selection:
            b.extra["model_choice"] = dict(selection)
        b.metrics.update({k: v for k, v in metrics.items() if v is not None})
    return b.path


def _write_events(
    cfg: PipelineConfig, store: ArtifactStore, key: str, model_artifact: Path, metrics: dict[str, Any]
) -> None:
    """The scores as TensorBoard scalars in runs/eval/<key>/ (beside the training runs), at the model's step."""
    from tasks.store.tensorboard import write_eval

    m = store.read_manifest(model_artifact)
    scores = {k: v for k, v in metrics.items() if k != "eval_seconds"}
    run_dir = store.root / "runs" / STAGE / key
    try:
        write_eval(
            run_dir,
            scores,
            step=int(m.get("metrics", {}).get("steps") or 0),
            hparams={"pipeline": cfg.name, "model": f"{m['stage']}/{m['key']}", "eval": cfg.section("eval")},
        )
    except OSError as exc:
        if exc.errno in STORAGE_ERRNOS:
            raise storage_error(exc, exc.filename or run_dir) from None
        raise


# ----------------------------------------------------------------------------- reports


def _fmt(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 1e4 else f"{v:.4g}"
    return str(v)


def render_report(
    model_artifact: Path,
    data_artifact: Path | None,
    results: dict[str, Any],
    generations: list[dict[str, Any]],
    limit: int | None,
    selection: dict[str, str] | None = None,
) -> str:
    from lm_eval.utils import make_table

    lines = [f"# Evaluation of `{model_artifact.parent.name}/{model_artifact.name}`", ""]
    lines += selection_lines(selection)
    if data_artifact is not None:
        lines += [f"Held-out split: `{data_artifact.parent.name}/{data_artifact.name}`", ""]
    if results.get("weights", "fp32") != "fp32":
        w = results["weights"]
        lines += [f"Scored with {w} weight matrices (eval.weights), as `msllm serve --weights {w}` serves them.", ""]
    if results.get("perplexity"):
        evaluated, base = f"`{model_artifact.parent.name}/{model_artifact.name}`", results.get("base_perplexity")
        lines += [
            "## Perplexity",
            "",
            "| set | model | tokens | bytes | perplexity | bits/byte |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for name, r in results["perplexity"].items():
            lines.append(
                f"| {name} | evaluated: {evaluated} | {r['tokens']} | {r['bytes']} | {_fmt(r['perplexity'])} "
                f"| {_fmt(r['bits_per_byte'])} |"
            )
            if name == "held-out" and base and "held-out" in base:
                b = base["held-out"]
                lines.append(
                    f"| held-out | base: `{base['model']}` | {b['tokens']} | {b['bytes']} | "
                    f"{_fmt(b['perplexity'])} | {_fmt(b['bits_per_byte'])} |"
                )
        lines.append("")
        if base:
            lines += [
                f"The base model is the one the evaluated model's chain started from ({base['chain']}), "
                + (
                    "scored on the same held-out blocks; lower is better."
                    if "held-out" in base
                    else f"not scored: {base['skipped']}."
                ),
                "",
            ]
    if results.get("results"):
        lines += [
            f"## lm-eval tasks ({f'{limit} examples each' if limit else 'all examples'})",
            "",
            make_table(results).strip(),
            "",
        ]
    if generations:
        lines += ["## Sample generations", ""]
        for g in generations:
            settings = (
                "greedy"
                if not g["temperature"]
                else f"temperature {g['temperature']}, top_k {g['top_k']}, top_p {g['top_p']}, seed {g['seed']}"
            )
            lines += [f"**{g['prompt']}** ({settings})", "", "```", g["prompt"] + g["completion"], "```", ""]
    return "\n".join(lines)


def selection_lines(selection: dict[str, str] | None) -> list[str]:
    """Markdown: which model, why, and (when so) that it is not the model of the previous report."""
    if not selection:
        return []
    out = [f"Model: `{selection['artifact']}`, chosen because: {selection['reason']}.", ""]
    if selection.get("note"):
        out += [f"**Note: {selection['note']}.**", ""]
    return out


def _eval_metrics(path: Path) -> dict[str, Any]:
    m = ArtifactStore.read_manifest(path)
    if m["stage"] != STAGE:
        raise ArtifactError(f"{path}: a {m['stage']} artifact, not an eval artifact")
    out = {k: v for k, v in m.get("metrics", {}).items() if isinstance(v, (int, float)) and k != "eval_seconds"}
    res = json.loads((path / "results.json").read_text(encoding="utf-8"))
    for task, r in res.get("results", {}).items():  # every metric, not only the main one
        for k, v in r.items():
            if "," in k and "_stderr" not in k and isinstance(v, (int, float)):
                out.setdefault(f"{task}.{k.split(',')[0]}", v)
    return out


def compare_table(path_a: Path, path_b: Path) -> str:
    """Markdown table of two eval artifacts' metrics side by side, with B − A."""
    a, b = _eval_metrics(path_a), _eval_metrics(path_b)
    ma, mb = ArtifactStore.read_manifest(path_a), ArtifactStore.read_manifest(path_b)

    def model_of(m: dict[str, Any]) -> str:
        ref = next((i for i in m.get("inputs", []) if i.get("kind") == "artifact" and i.get("stage") != "data"), None)
        return f"{ref['stage']}/{ref['key']}" if ref else "?"

    lines = [
        f"A: eval/{ma['key']} (model {model_of(ma)})",
        f"B: eval/{mb['key']} (model {model_of(mb)})",
        "",
        "| metric | A | B | B − A |",
        "|---|---:|---:|---:|",
    ]
    for k in sorted(set(a) | set(b), key=lambda k: (k.count("."), k)):
        va, vb = a.get(k), b.get(k)
        diff = vb - va if isinstance(va, (int, float)) and isinstance(vb, (int, float)) else None
        lines.append(f"| {k} | {_fmt(va)} | {_fmt(vb)} | {_fmt(diff) if diff is None else f'{diff:+.4f}'} |")
    return "\n".join(lines)
