"""The export stage: a model artifact → a verified MindIR + ONNX pair, with tokenizer and model card.

    path = run(cfg, store, model_artifact)                          # cached by content, like every stage
    path = run(cfg, store, model_artifact, eval_artifact=ev)        # the card also shows ev's results

    msllm export --pipeline NAME [--from MODEL_ARTIFACT]

`model_artifact` is a pretrain, convert or merged artifact; a finetune artifact is merged
first (`tasks.finetune.merge`). The work runs in a child process
(`python -m tasks.export --child SPEC`): MindSpore's export keeps process-global state
(exporting one Cell twice in a process fails), so each export gets a fresh process and
a freshly loaded network per format.

What MindSpore 2.10 allows, and so what is exported (`export` section of pipelines.yaml):
  - MindIR (`ms.export`): input `input_ids` int32 with dynamic shape [None, None] (any
    batch, any length up to the model's max_seq_length) → logits float32 [B, T, V].
    Reload with `ms.load` + `nn.GraphCell`.
  - ONNX (`mindspore.onnx.export`): fixed shape [export.batch_size, export.seq_length].
    Dynamic ONNX axes are accepted by the exporter but its Reshape nodes keep the traced
    sizes, so any other shape fails in onnxruntime. Input `input_ids` int32, output
    renamed to `logits` after export (the exporter's `output_names` yields an invalid
    graph). No positions or attention-mask inputs: positions are 0..T-1 and the mask is
    causal, so a short sequence is right-padded and read at its last real position.

Verification (inside the stage; any failure fails it and leaves no artifact): the ONNX
file passes `onnx.checker` (full check); the reloaded MindIR (at the export shape, at each
prompt's own length, and at all prompts in one batch) and onnxruntime (at the export
shape) match the MindSpore network's logits on `export.prompts` within `export.atol`; and
greedy decoding through onnxruntime (`tasks.onnx_generate`) yields the same tokens as
`model.generate.Generator` for each prompt.

Artifact payload:
    model.mindir        MindIR, dynamic [batch, seq]
    model.onnx          ONNX, fixed [batch_size, seq_length]
    tokenizer.model     the SentencePiece model
    model.json          the source model's architecture and tokenizer ids
    export.json         input/output names, shapes, prompt format, verification
    MODEL_CARD.md       config, lineage summary, eval results (when given), verification, usage
    onnx_generate.py    a copy of tasks/onnx_generate.py: generation with onnxruntime only
manifest: `verification` (as in export.json) and metrics mindir_max_abs_diff, onnx_max_abs_diff,
greedy_tokens_match, parameters, export_seconds.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tasks.artifacts import ArtifactError, ArtifactStore, atomic_write_json, code_version
from tasks.config import ConfigError, PipelineConfig
from tasks.supervise import child_main

STAGE = "export"
MODEL_STAGES = ("merged", "pretrain", "convert")  # artifacts holding model.json + weights
INPUT_NAME, OUTPUT_NAME = "input_ids", "logits"
PROMPT_FORMAT = "[eos_id] + sentencepiece ids (EOS starts a document, as in pretraining and eval)"
_HERE = Path(__file__).resolve().parent


class ExportCheckFailed(RuntimeError):
    """An exported model does not reproduce the MindSpore network (logits or greedy tokens)."""


# ----------------------------------------------------------------------------- keys and inputs


def resolve_model(store: ArtifactStore, path: str | Path) -> Path:
    """The model artifact to export: `path` itself, or for a finetune artifact its merged model."""
    p = store.inside(path)
    stage = store.read_manifest(p)["stage"]
    if stage == "finetune":
        from tasks.finetune import merge

        return merge(store, p)
    if stage not in MODEL_STAGES or not (p / "model.json").is_file():
        raise ArtifactError(f"{p}: a {stage} artifact, not a model; export takes a pretrain, merged, convert or "
                            "finetune artifact")
    return p


def stage_key(cfg: PipelineConfig, store: ArtifactStore, model_artifact: Path,
              eval_artifact: Path | None = None) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(content key, inputs, config section) of exporting `model_artifact` (a model, not a finetune artifact)."""
    inputs = [store.input_ref(model_artifact)]
    if inputs[0]["stage"] == "finetune":
        raise ArtifactError(f"{model_artifact}: a finetune artifact; pass its merged model "
                            "(tasks.finetune.merge, or export.run, which merges)")
    if eval_artifact is not None:
        inputs.append(store.input_ref(eval_artifact))
    section = cfg.section(STAGE)
    return store.key(STAGE, section, inputs, code_version(STAGE)), inputs, section


def check(cfg: PipelineConfig, info: dict[str, Any]) -> None:
    """Settings that depend on the model; ConfigError naming the YAML path."""
    ex, p = cfg.export, f"pipelines.{cfg.name}.export"
    errs = []
    max_len = info["model"]["max_seq_length"]
    if ex.seq_length > max_len:
        errs.append(f"{p}.seq_length: {ex.seq_length} exceeds the model's max_seq_length={max_len}; lower it")
    if ex.seq_length < 2:
        errs.append(f"{p}.seq_length: {ex.seq_length}; the ONNX generation check needs at least 2 positions")
    if not ex.formats:
        errs.append(f"{p}.formats: empty; list mindir and/or onnx")
    if errs:
        raise ConfigError(errs)


def _check_eval(store: ArtifactStore, eval_artifact: Path, model: Path) -> None:
    m = store.read_manifest(eval_artifact)
    if m["stage"] != "eval":
        raise ArtifactError(f"{eval_artifact}: a {m['stage']} artifact, not an eval artifact")
    key = store.read_manifest(model)["key"]
    if not any(i.get("kind") == "artifact" and i.get("key") == key for i in m.get("inputs", [])):
        raise ArtifactError(f"{eval_artifact} evaluated another model than {model}; pass the eval artifact of "
                            "the model being exported (or none)")


def matching_eval(store: ArtifactStore, model: Path, pipeline: str | None = None) -> Path | None:
    """The newest eval artifact whose inputs include `model` (None when it was never evaluated)."""
    key = store.read_manifest(model)["key"]
    hits = [p for p, m in store.list("eval", pipeline)
            if any(i.get("kind") == "artifact" and i.get("key") == key for i in m.get("inputs", []))]
    return hits[-1] if hits else None


# ----------------------------------------------------------------------------- supervisor (parent)


def run(cfg: PipelineConfig, store: ArtifactStore, model_artifact: Path, *, eval_artifact: Path | None = None,
        progress: bool = True, isolate: bool = True) -> Path:
    """Return the verified export artifact of this model, exporting it in a child process if needed.

    Raises ConfigError for settings the model cannot take, and ExportCheckFailed (in
    process) or tasks.supervise.StageFailed (from the child, message starting with the
    check that failed) when an exported model does not match; no artifact is written then.
    `isolate=False` exports in this process (tests).
    """
    from tasks.model_artifact import read_info
    from tasks.supervise import supervise

    model = resolve_model(store, model_artifact)
    check(cfg, read_info(model))
    eval_art = store.inside(eval_artifact) if eval_artifact is not None else None
    if eval_art is not None:
        _check_eval(store, eval_art, model)
    key, _, _ = stage_key(cfg, store, model, eval_art)
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    spec = {"config": cfg.model_dump(mode="json"), "root": str(store.root), "model": str(model),
            "eval": str(eval_art) if eval_art else None, "key": key, "progress": progress}
    return supervise(STAGE, store, key, spec, export, isolate=isolate)


# ----------------------------------------------------------------------------- the child


def export(spec: dict[str, Any]) -> Path:
    """Export, verify and publish the artifact (in the child process, or in-process with isolate=False)."""
    from model.runtime import setup_mindspore

    setup_mindspore()
    cfg = PipelineConfig.model_validate(spec["config"])
    store = ArtifactStore(spec["root"])
    model = Path(spec["model"])
    eval_art = Path(spec["eval"]) if spec.get("eval") else None
    key, inputs, section = stage_key(cfg, store, model, eval_art)
    if key != spec["key"]:
        raise ArtifactError(f"export key changed between parent and child ({spec['key']} → {key}); an input moved")
    return _export(cfg, store, model, eval_art, key, inputs, section, spec.get("progress", True))


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[export] {msg}", file=sys.stderr, flush=True)


def _export(cfg: PipelineConfig, store: ArtifactStore, model: Path, eval_art: Path | None, key: str,
            inputs: list[dict[str, Any]], section: dict[str, Any], progress: bool) -> Path:
    from tasks.model_artifact import load_model, load_tokenizer, model_config, read_info
    from tasks.onnx_generate import encode_prompt

    ex = cfg.export
    t0 = time.perf_counter()
    info = read_info(model)
    sp = load_tokenizer(model)
    prompts = [encode_prompt(sp, p)[-ex.seq_length:] for p in ex.prompts]
    reference = _Reference(load_model(model)[0])
    fixed = _batches(prompts, ex.batch_size, ex.seq_length)  # the ONNX shape [B, T]
    ver: dict[str, Any] = {"atol": ex.atol, "prompts": list(ex.prompts), "prompt_format": PROMPT_FORMAT,
                           "mindir_max_abs_diff": None, "onnx_max_abs_diff": None, "onnx_checker": None,
                           "greedy_tokens_match": None, "max_new_tokens": ex.max_new_tokens, "shapes": {}}
    failures: list[str] = []
    with store.build(STAGE, key, pipeline=cfg.name, config=section, inputs=inputs, code=code_version(STAGE)) as b:
        if "mindir" in ex.formats:
            _log(progress, f"MindIR (dynamic [batch, seq]) → {b.dir.name}/model.mindir")
            export_mindir(load_model(model)[0], b.dir / "model.mindir")  # a fresh Cell per export
            # the export shape, each prompt at its own length, all prompts in one batch: dynamic both ways
            checks = fixed + [_batches([p], 1, len(p))[0] for p in prompts] + \
                _batches(prompts, len(prompts), max(map(len, prompts)))
            diff = verify_mindir(b.dir / "model.mindir", reference, checks)
            ver["mindir_max_abs_diff"] = diff
            ver["shapes"]["mindir"] = {"exported": [None, None], "checked": sorted({x.shape for x in checks})}
            _log(progress, f"MindIR max |Δlogit| {diff:.3g} at shapes {ver['shapes']['mindir']['checked']}")
            if not diff <= ex.atol:
                failures.append(f"MindIR max |logit diff| {diff:.3g} > export.atol {ex.atol:g}")
        if "onnx" in ex.formats:
            shape = [ex.batch_size, ex.seq_length]
            _log(progress, f"ONNX (fixed {shape}) → {b.dir.name}/model.onnx")
            ver["onnx_opset"] = export_onnx(load_model(model)[0], b.dir / "model.onnx", ex.batch_size, ex.seq_length,
                                            meta={"eos_id": str(sp.eos_id()), "prompt_format": PROMPT_FORMAT})
            ver["onnx_checker"] = "passed"  # export_onnx raises otherwise
            diff = verify_onnx(b.dir / "model.onnx", reference, fixed)
            ver["onnx_max_abs_diff"] = diff
            ver["shapes"]["onnx"] = {"exported": shape, "checked": [shape]}
            _log(progress, f"onnxruntime max |Δlogit| {diff:.3g} at {shape}")
            if not diff <= ex.atol:
                failures.append(f"ONNX max |logit diff| {diff:.3g} > export.atol {ex.atol:g}")
            ver["greedy"] = greedy_pairs(b.dir / "model.onnx", reference.net, sp, list(zip(ex.prompts, prompts)),
                                         ex.max_new_tokens, ex.seq_length)
            ver["greedy_tokens_match"] = all(g["mindspore"] == g["onnxruntime"] for g in ver["greedy"])
            failures += [_divergence(g) for g in ver["greedy"] if g["mindspore"] != g["onnxruntime"]]
            _log(progress, f"greedy tokens onnxruntime == MindSpore: {ver['greedy_tokens_match']} "
                           f"({len(prompts)} prompts, up to {ex.max_new_tokens} tokens)")
        if failures:
            raise ExportCheckFailed("export verification failed: " + "; ".join(failures))

        shutil.copy2(model / "tokenizer.model", b.dir / "tokenizer.model")
        shutil.copy2(model / "model.json", b.dir / "model.json")
        shutil.copy2(_HERE / "onnx_generate.py", b.dir / "onnx_generate.py")
        mc = model_config(model)
        files = {"model.mindir": "mindir" in ex.formats, "model.onnx": "onnx" in ex.formats}
        atomic_write_json(b.dir / "export.json", {
            "inputs": {INPUT_NAME: "int32 [batch, seq] token ids"}, "outputs": {OUTPUT_NAME: "float32 [batch, seq, vocab]"},
            "files": [f for f, on in files.items() if on], "tokenizer": info.get("tokenizer", {}),
            "prompt_format": PROMPT_FORMAT, "verification": ver})
        evaluation = _read_eval(eval_art) if eval_art is not None else None
        card = model_card(info=info, parameters=mc.num_parameters, model_ref=inputs[0], pipeline=cfg.name,
                          verification=ver, lineage=_lineage(store, model), evaluation=evaluation,
                          artifact_path=b.path)
        (b.dir / "MODEL_CARD.md").write_text(card, encoding="utf-8")
        b.extra["verification"] = ver
        b.metrics.update(mindir_max_abs_diff=ver["mindir_max_abs_diff"], onnx_max_abs_diff=ver["onnx_max_abs_diff"],
                         greedy_tokens_match=ver["greedy_tokens_match"], atol=ex.atol, parameters=mc.num_parameters,
                         export_seconds=round(time.perf_counter() - t0, 1))
        b.metrics = {k: v for k, v in b.metrics.items() if v is not None}
    _log(progress, f"wrote {b.path}")
    return b.path


class _Reference:
    """Logits of the MindSpore network (eager) for an int32 batch, memoised: the ground truth of every check."""

    def __init__(self, net):
        self.net = net
        self._memo: dict[tuple, np.ndarray] = {}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import mindspore as ms

        k = (x.shape, x.tobytes())
        if k not in self._memo:
            self._memo[k] = self.net(ms.Tensor(x)).asnumpy()
        return self._memo[k]


def verify_mindir(path: Path, reference: _Reference, batches: list[np.ndarray]) -> float:
    """Max |logit difference| of the reloaded MindIR (`ms.load` + `nn.GraphCell`) against the reference."""
    import mindspore as ms

    graph = ms.nn.GraphCell(ms.load(str(path)))
    return max(_max_abs_diff(graph(ms.Tensor(x)).asnumpy(), reference(x)) for x in batches)


def verify_onnx(path: Path, reference: _Reference, batches: list[np.ndarray]) -> float:
    """Max |logit difference| of the ONNX file under onnxruntime against the reference."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return max(_max_abs_diff(sess.run([OUTPUT_NAME], {INPUT_NAME: x})[0], reference(x)) for x in batches)


def greedy_pairs(onnx_path: Path, net, sp, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
                 seq_length: int) -> list[dict[str, Any]]:
    """Greedy tokens per prompt from MindSpore's generator and from onnxruntime, over the same window."""
    from model.generate import Generator
    from tasks.onnx_generate import OnnxGenerator, decode_completion

    ms_gen, ort_gen, eos = Generator(net, max_len=seq_length), OnnxGenerator(onnx_path), sp.eos_id()
    out = []
    for text, ids in prompts:
        want = ms_gen.generate(ids, max_new_tokens, eos_id=eos)
        got = ort_gen.generate(ids, max_new_tokens, eos_id=eos)
        out.append({"prompt": text, "prompt_ids": ids, "mindspore": want, "onnxruntime": got,
                    "completion": decode_completion(sp, ids, got)})
    return out


def _divergence(g: dict[str, Any]) -> str:
    want, got = g["mindspore"], g["onnxruntime"]
    at = next((i for i, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
    return f"greedy tokens differ for prompt {g['prompt']!r} from new token {at}: MindSpore {want} vs onnxruntime {got}"


def _batches(rows: list[list[int]], batch: int, length: int) -> list[np.ndarray]:
    """Token rows right-padded with 0 into int32 arrays of [batch, length] (spare rows all padding)."""
    out = []
    for start in range(0, len(rows), batch):
        x = np.zeros((batch, length), np.int32)
        for i, r in enumerate(rows[start:start + batch]):
            x[i, :len(r)] = r[:length]
        out.append(x)
    return out


def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if a.shape != b.shape:
        raise ExportCheckFailed(f"export verification failed: logits of shape {list(a.shape)}, expected {list(b.shape)}")
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))))


# ----------------------------------------------------------------------------- the two formats


def export_mindir(net, path: Path) -> None:
    """MindIR with a dynamic [batch, seq] int32 input; `path` ends in .mindir."""
    import mindspore as ms

    ms.export(net, ms.Tensor(shape=[None, None], dtype=ms.int32), file_name=str(path.with_suffix("")),
              file_format="MINDIR")
    os.chmod(path, 0o644)  # MindSpore writes it owner-read-only


def export_onnx(net, path: Path, batch: int, seq: int, meta: dict[str, str] | None = None) -> int:
    """ONNX at the fixed shape [batch, seq]: input `input_ids`, output renamed to `logits`; checked. Returns the opset."""
    import mindspore as ms
    import onnx

    ms.onnx.export(net, ms.Tensor(np.zeros((batch, seq), np.int32)), file_name=str(path), input_names=[INPUT_NAME])
    m = onnx.load(str(path))
    old = m.graph.output[0].name
    for node in m.graph.node:
        node.output[:] = [OUTPUT_NAME if n == old else n for n in node.output]
        node.input[:] = [OUTPUT_NAME if n == old else n for n in node.input]
    for vi in m.graph.value_info:
        if vi.name == old:
            vi.name = OUTPUT_NAME
    m.graph.output[0].name = OUTPUT_NAME
    m.doc_string = "LLaMA causal LM exported from MindSpore: input_ids int32 [batch, seq] -> logits float32 [batch, seq, vocab]"
    onnx.helper.set_model_props(m, {"input_ids": "int32 token ids, right-padded (causal: padding never reaches "
                                                 "earlier positions)", **(meta or {})})
    try:
        onnx.checker.check_model(m, full_check=True)
    except onnx.checker.ValidationError as exc:
        raise ExportCheckFailed(f"export verification failed: onnx.checker rejects the exported model: {exc}") from None
    onnx.save(m, str(path))
    return int(max((o.version for o in m.opset_import if o.domain in ("", "ai.onnx")), default=0))


# ----------------------------------------------------------------------------- model card


def _lineage(store: ArtifactStore, model: Path) -> dict[str, Any]:
    from tasks.lineage import lineage_tree, raw_inputs, render

    tree = lineage_tree(store, model)
    return {"text": render(tree, "text"), "raw": raw_inputs(tree)}


def _read_eval(eval_art: Path) -> dict[str, Any]:
    """What an eval artifact reports, read defensively (missing or odd pieces are skipped)."""
    out: dict[str, Any] = {"ref": f"{eval_art.parent.name}/{eval_art.name}", "perplexity": {}, "tasks": []}
    try:
        res = json.loads((eval_art / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        out["error"] = f"results.json unreadable ({exc})"
        return out
    ppl = res.get("perplexity") if isinstance(res, dict) else None
    for name, row in (ppl.items() if isinstance(ppl, dict) else []):
        if isinstance(row, dict):
            out["perplexity"][str(name)] = {k: row.get(k) for k in ("tokens", "perplexity", "bits_per_byte")}
    results = res.get("results") if isinstance(res, dict) else None
    for task, r in (results.items() if isinstance(results, dict) else []):
        for metric, v in (r.items() if isinstance(r, dict) else []):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in metric:
                err = r.get(metric.replace(",", "_stderr,", 1)) if "," in metric else None
                out["tasks"].append({"task": str(task), "metric": metric.split(",")[0], "value": float(v),
                                     "stderr": float(err) if isinstance(err, (int, float)) else None})
    return out


def _cell(text: str) -> str:
    """Text as a markdown table cell: quoted, pipes escaped, on one line."""
    return repr(text).replace("|", "\\|")


def _num(v: Any) -> str:
    if v is None:
        return "–"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def model_card(*, info: dict[str, Any], parameters: int, model_ref: dict[str, Any], pipeline: str,
               verification: dict[str, Any], lineage: dict[str, Any], evaluation: dict[str, Any] | None,
               artifact_path: Path) -> str:
    """MODEL_CARD.md: what the model is, where it came from, how it scores, how it was checked, how to run it."""
    from tasks.onnx_generate import SNIPPET

    v = verification
    mc, tok = info.get("model", {}), info.get("tokenizer", {})
    lines = [f"# Model card: {info.get('name', 'llama')} from {model_ref['stage']}/{model_ref['key']}", "",
             f"Exported by the `export` stage of pipeline `{pipeline}` on "
             f"{_dt.datetime.now(_dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.", "",
             "## Model", "", "| | |", "|---|---|",
             f"| parameters | {parameters / 1e6:.2f}M ({parameters:,}) |",
             f"| trained sequence length | {_num(info.get('seq_length'))} |"]
    lines += [f"| {k} | {_num(val)} |" for k, val in mc.items()]
    lines += [f"| tokenizer | SentencePiece, {_num(tok.get('vocab_size'))} pieces; bos {_num(tok.get('bos_id'))}, "
              f"eos {_num(tok.get('eos_id'))}, pad {_num(tok.get('pad_id'))} |", ""]

    shapes = v.get("shapes", {})
    lines += ["## Files", "", "| file | contents |", "|---|---|"]
    if "mindir" in shapes:
        lines.append("| model.mindir | MindIR: `input_ids` int32 [batch, seq] (dynamic) → logits float32 "
                     "[batch, seq, vocab]; `mindspore.load` + `nn.GraphCell` |")
    if "onnx" in shapes:
        b, t = shapes["onnx"]["exported"]
        lines.append(f"| model.onnx | ONNX (opset {v.get('onnx_opset')}): `input_ids` int32 [{b}, {t}] (fixed) → "
                     f"`logits` float32 [{b}, {t}, vocab] |")
    lines += ["| tokenizer.model | SentencePiece model |", "| model.json | architecture and tokenizer ids |",
              "| export.json | names, shapes, prompt format, verification |",
              "| onnx_generate.py | greedy generation with onnxruntime only: `python onnx_generate.py . \"ROMEO:\"` |", ""]

    lines += ["## Verification", "", f"Against the MindSpore network on {len(v['prompts'])} fixed prompts "
              f"({', '.join(repr(p) for p in v['prompts'])}), encoded as {v['prompt_format']}.", "",
              "| check | result |", "|---|---|"]
    if "mindir" in shapes:
        lines.append(f"| MindIR max abs logit diff | {_num(v['mindir_max_abs_diff'])} at shapes "
                     f"{', '.join(str(list(s)) for s in shapes['mindir']['checked'])} |")
    if "onnx" in shapes:
        n_ok = sum(g["mindspore"] == g["onnxruntime"] for g in v.get("greedy", []))
        lines += [f"| ONNX max abs logit diff (onnxruntime) | {_num(v['onnx_max_abs_diff'])} at "
                  f"{shapes['onnx']['exported']} |", f"| onnx.checker (full check) | {v.get('onnx_checker')} |",
                  f"| greedy tokens, onnxruntime == MindSpore | {n_ok}/{len(v.get('greedy', []))} prompts, "
                  f"up to {v['max_new_tokens']} new tokens |"]
    lines += [f"| tolerance (export.atol) | {v['atol']:g} |", ""]
    if v.get("greedy"):
        lines += ["| prompt | greedy completion (onnxruntime) |", "|---|---|"]
        lines += [f"| {_cell(g['prompt'])} | {_cell(g['completion'])} |" for g in v["greedy"]]
        lines.append("")

    if evaluation is not None:
        lines += ["## Evaluation", "", f"From `{evaluation['ref']}`.", ""]
        if evaluation.get("error"):
            lines += [evaluation["error"], ""]
        if evaluation.get("perplexity"):
            lines += ["| set | tokens | perplexity | bits/byte |", "|---|---:|---:|---:|"]
            lines += [f"| {n} | {_num(r['tokens'])} | {_num(r['perplexity'])} | {_num(r['bits_per_byte'])} |"
                      for n, r in evaluation["perplexity"].items()]
            lines.append("")
        if evaluation.get("tasks"):
            lines += ["| task | metric | value | ± |", "|---|---|---:|---:|"]
            lines += [f"| {r['task']} | {r['metric']} | {_num(r['value'])} | {_num(r['stderr'])} |"
                      for r in evaluation["tasks"]]
            lines.append("")
        if not evaluation.get("perplexity") and not evaluation.get("tasks") and not evaluation.get("error"):
            lines += ["(no perplexity or task results in this eval artifact)", ""]

    lines += ["## Lineage", "", "```text", lineage["text"], "```", ""]
    if lineage.get("raw"):
        lines += ["| raw input | bytes | sha256 |", "|---|---:|---|"]
        lines += [f"| {r.get('path')} | {_num(r.get('size'))} | `{r.get('sha256')}` |" for r in lineage["raw"]]
        lines.append("")

    if "onnx" in shapes:
        lines += ["## Generate with onnxruntime only", "",
                  "numpy, onnxruntime and sentencepiece; no MindSpore. The ONNX input has a fixed shape, so a "
                  "shorter sequence is right-padded and the next token read at its last real position (causal "
                  "attention: padding never changes earlier logits). No KV cache: each token is one full forward.",
                  "", "```python", f'ART = "{artifact_path}"', SNIPPET.rstrip(), "```", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- command line


def cli_export(args) -> int:
    """`msllm export [--from MODEL]`: default model = the pipeline's newest merged, else newest pretrain artifact.

    The newest eval artifact of that model (when there is one) goes into the model card.
    """
    from tasks.cli import StageError, _load, _print_metrics, _store

    cfg = _load(args)
    store = _store(args)
    if args.from_:
        model = store.find(args.from_)
    else:
        from tasks.model_artifact import newest_model

        model = newest_model(store, cfg.name)
        if model is None:
            raise StageError(f"no merged or pretrain artifact for pipeline '{cfg.name}' under {store.root}; run "
                             f"`msllm train --pipeline {cfg.name}` first or pass --from PATH")
    model = resolve_model(store, model)
    ev = matching_eval(store, model, cfg.name)
    print(f"[export] model {model}" + (f", eval {ev}" if ev else " (no eval artifact: card without results)"),
          file=sys.stderr)
    path = run(cfg, store, model, eval_artifact=ev)
    _print_metrics(path)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(export))
