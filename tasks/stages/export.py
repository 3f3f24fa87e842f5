"""The export stage: a model artifact → verified MindIR and ONNX (KV cache, dynamic shapes), runnable by
onnxruntime-genai.

    path = run(cfg, store, model_artifact)                          # cached by content, like every stage
    path = run(cfg, store, model_artifact, eval_artifact=ev)        # the card also shows ev's results

    msllm export --pipeline NAME [--from MODEL_ARTIFACT] [--set export.int8=true]

`model_artifact` is a pretrain, convert or merged artifact; a finetune artifact is merged
first (`tasks.stages.finetune.merge`). The work runs in a child process
(`python -m tasks.stages.export --child SPEC`): MindSpore's export keeps process-global state
(exporting one Cell twice in a process fails), so each export gets a fresh process.

What is exported (`export` section of pipelines.yaml; the writers are in tasks/deploy/formats.py):
  - MindIR (`ms.export`, MindSpore's own format): input `input_ids` int32 with dynamic shape
    [None, None] → logits float32 [B, T, V]; a full forward, no cache. Reload with
    `ms.load` + `nn.GraphCell`.
  - ONNX (`tasks/deploy/onnx_decoder.py`): the decoder written node by node from the weights with
    the `onnx` helper API, in the layout of the ONNX Runtime ecosystem's decoders: input_ids,
    attention_mask, position_ids and past_key_values.{i}.key/value → logits and
    present.{i}.key/value, batch / sequence / past axes dynamic. (MindSpore 2.10's own ONNX
    exporter keeps traced sizes in its Reshape nodes, so it cannot give dynamic axes or a
    cache.) Next to it, what onnxruntime-genai reads: genai_config.json ("llama" decoder) and
    tokenizer.json / tokenizer_config.json, a Hugging Face BPE equivalent of tokenizer.model
    (onnxruntime-genai does not read SentencePiece models).
  - with `export.int8: true`, model.int8.onnx: onnxruntime's dynamic quantization (int8
    weights of every weight MatMul, activations quantized per call; embedding fp32).

Verification (inside the stage, with tasks/deploy/checks.py; a failure of the first four fails it and leaves
no artifact; the model card is tasks/deploy/model_card.py):
  1. the ONNX file passes `onnx.checker` (full check, with shape inference);
  2. onnxruntime logits vs the MindSpore network, max |Δ| <= export.atol, at every
     (batch, sequence, past) combination of `onnx_checks`: each prompt alone with no past;
     one prompt as a past plus the rest in one call; all prompts left-padded in one batch
     (batch > 1, padding); that batch continuing with a 3-token chunk over its past; and 8
     single-token steps feeding `present` back as `past`;
  3. greedy tokens of `tasks.deploy.onnx_generate.OnnxGenerator` (KV cache) == those of
     `model.generate.Generator` (MindSpore, KV cache) for each prompt, over the same window
     (export.seq_length);
  4. the reloaded MindIR's logits at several batch sizes and lengths;
  5. onnxruntime-genai: the export directory loads with `onnxruntime_genai.Model`, its greedy
     tokens equal MindSpore's (a mismatch fails the stage), and its tokenizer's ids equal
     SentencePiece's on the prompts, fixed sample lines and held-out text (recorded; a
     mismatch is reported, not fatal: generation from token ids does not depend on it);
  6. int8 (when on): file size, decode tokens/s of fp32 and int8 onnxruntime, perplexity of
     both on a few held-out blocks of the data artifact in the model's lineage (or, when the
     store no longer has it, on the export prompts and their greedy continuations; the
     manifest says which), max |Δlogit| against MindSpore and greedy agreement (recorded).

Artifact payload:
    model.mindir          MindIR, dynamic [batch, seq], full forward
    model.onnx            ONNX decoder with a KV cache, dynamic batch / sequence / past
    model.int8.onnx       (export.int8) the same decoder with int8 weights
    genai_config.json     onnxruntime-genai's model description (decoder "llama", model.onnx)
    tokenizer.json        the SentencePiece model as a Hugging Face tokenizer (for onnxruntime-genai)
    tokenizer_config.json its class and special tokens
    tokenizer.model       the SentencePiece model (onnx_generate.py, MindSpore)
    model.json            the source model's architecture and tokenizer ids
    export.json           input/output names and shapes, prompt format, verification, and `digests`: the sha256 of
                          every model file (the standalone onnx_generate.py checks them before use)
    MODEL_CARD.md         config, lineage summary, eval results (when given), verification, usage
    onnx_generate.py      a copy of tasks/deploy/onnx_generate.py: KV-cache generation with onnxruntime only
    sampling.py           a copy of model/sampling.py (numpy only), which onnx_generate.py imports
manifest: `verification` (as in export.json) and metrics mindir_max_abs_diff, onnx_max_abs_diff,
greedy_tokens_match, genai_greedy_tokens_match, genai_tokenizer_ids_match, onnx_bytes, int8_* (when on),
parameters, export_seconds."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from model.runtime import setup_mindspore
from tasks.config.schema import ConfigError, PipelineConfig
from tasks.deploy.checked import GENAI_FILES, PROMPT_FORMAT, gguf_checked, log, mindir_checked, onnx_checked
from tasks.deploy.checks import (
    CHUNK,
    STEPS,
    ExportCheckFailed,
    Reference,
)
from tasks.deploy.formats import (
    onnx_io,
)
from tasks.deploy.model_card import model_card, read_eval
from tasks.modeling.merge import merge
from tasks.prompts import PROMPT_STYLE_FILE, style_record
from tasks.runtime.supervise import supervise
from tasks.stages import MODEL_KINDS, code_version
from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import atomic_write_json, sha256_file
from tasks.store.errors import ArtifactError
from tasks.store.lineage import lineage_tree, raw_inputs, render
from tasks.store.model_artifact import load_prompt_style, load_tokenizer, model_config, read_info
from tasks.store.tensors import load_weights
from tasks.tokenizer import copy_tokenizer_files, tokenizer_files

STAGE = "export"
MODEL_STAGES = MODEL_KINDS  # artifacts holding model.json + weights (the stage table's)
MINDIR_INPUT, OUTPUT_NAME = "input_ids", "logits"
MIN_SEQ_LENGTH = 2 + CHUNK + STEPS  # a prompt of 2 tokens, the chunk and the steps
_REPO = Path(__file__).resolve().parents[2]
# copied into the artifact (name there: source): the standalone generator and the one sampling rule it imports
_GENERATE_SCRIPTS = {
    "onnx_generate.py": _REPO / "tasks" / "deploy" / "onnx_generate.py",
    "sampling.py": _REPO / "model" / "sampling.py",
}


# ----------------------------------------------------------------------------- keys and inputs


def resolve_model(store: ArtifactStore, path: str | Path) -> Path:
    """The model artifact to export: `path` itself, or for a finetune artifact its merged model."""
    p = store.inside(path)
    stage = store.read_manifest(p)["stage"]
    if stage == "finetune":
        return merge(store, p)
    if stage not in MODEL_STAGES or not (p / "model.json").is_file():
        raise ArtifactError(
            f"{p}: a {stage} artifact, not a model; export takes a pretrain, merged, convert or finetune artifact"
        )
    return p


def stage_key(
    cfg: PipelineConfig, store: ArtifactStore, model_artifact: Path, eval_artifact: Path | None = None
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """(content key, inputs, config section) of exporting `model_artifact` (a model, not a finetune artifact)."""
    inputs = [store.input_ref(model_artifact)]
    if inputs[0]["stage"] == "finetune":
        raise ArtifactError(
            f"{model_artifact}: a finetune artifact; pass its merged model "
            "(tasks.stages.finetune.merge, or export.run, which merges)"
        )
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
    if ex.seq_length < MIN_SEQ_LENGTH:
        errs.append(
            f"{p}.seq_length: {ex.seq_length}; the ONNX checks need at least {MIN_SEQ_LENGTH} positions "
            f"(a 2-token prompt, a {CHUNK}-token chunk and {STEPS} single-token steps); raise it"
        )
    if not ex.formats:
        errs.append(f"{p}.formats: empty; list mindir and/or onnx")
    if ex.int8 and "onnx" not in ex.formats:
        errs.append(f"{p}.int8: true needs the onnx format; add onnx to {p}.formats or set int8: false")
    if info.get("name", "llama") != "llama":
        errs.append(
            f"{p}.formats: the model is a {info.get('name')!r} model; the ONNX decoder is written for "
            "llama models only: export it as mindir"
        )
    if errs:
        raise ConfigError(errs)


def _check_eval(store: ArtifactStore, eval_artifact: Path, model: Path) -> None:
    m = store.read_manifest(eval_artifact)
    if m["stage"] != "eval":
        raise ArtifactError(f"{eval_artifact}: a {m['stage']} artifact, not an eval artifact")
    key = store.read_manifest(model)["key"]
    if not any(i.get("kind") == "artifact" and i.get("key") == key for i in m.get("inputs", [])):
        raise ArtifactError(
            f"{eval_artifact} evaluated another model than {model}; pass the eval artifact of "
            "the model being exported (or none)"
        )


def matching_eval(store: ArtifactStore, model: Path, pipeline: str | None = None) -> Path | None:
    """The newest eval artifact whose inputs include `model` (None when it was never evaluated)."""
    key = store.read_manifest(model)["key"]
    hits = [
        p
        for p, m in store.list("eval", pipeline)
        if any(i.get("kind") == "artifact" and i.get("key") == key for i in m.get("inputs", []))
    ]
    return hits[-1] if hits else None


# ----------------------------------------------------------------------------- supervisor (parent)


def run(
    cfg: PipelineConfig,
    store: ArtifactStore,
    model_artifact: Path,
    *,
    eval_artifact: Path | None = None,
    keyed: tuple,
    progress: bool = True,
    isolate: bool = True,
) -> Path:
    """Return the verified export artifact of this model, exporting it in a child process if needed.

    Raises ConfigError for settings the model cannot take, and ExportCheckFailed (in
    process) or tasks.runtime.supervise.StageFailed (from the child, message starting with the
    check that failed) when an exported model does not match; no artifact is written then.
    `isolate=False` exports in this process (tests). `keyed`: what `stage_key` returned for these arguments,
    from the stage runner (tasks/stages/runner.py), which resolved the inputs, checked the machine and computed it once.
    """

    model = resolve_model(store, model_artifact)
    check(cfg, read_info(model))
    eval_art = store.inside(eval_artifact) if eval_artifact is not None else None
    if eval_art is not None:
        _check_eval(store, eval_art, model)
    key = keyed[0]
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    spec = {
        "config": cfg.model_dump(mode="json"),
        "root": str(store.root),
        "model": str(model),
        "eval": str(eval_art) if eval_art else None,
        "key": key,
        "progress": progress,
    }
    return supervise(STAGE, store, key, spec, export, isolate=isolate)


# ----------------------------------------------------------------------------- the child


def export(spec: dict[str, Any]) -> Path:
    """Export, verify and publish the artifact (in the child process, or in-process with isolate=False)."""

    setup_mindspore()
    cfg = PipelineConfig.model_validate(spec["config"])
    store = ArtifactStore(spec["root"])
    model = Path(spec["model"])
    eval_art = Path(spec["eval"]) if spec.get("eval") else None
    key, inputs, section = stage_key(cfg, store, model, eval_art)
    if key != spec["key"]:
        raise ArtifactError(f"export key changed between parent and child ({spec['key']} → {key}); an input moved")
    return _export(cfg, store, model, eval_art, key, inputs, section, spec.get("progress", True))


def _export(
    cfg: PipelineConfig,
    store: ArtifactStore,
    model: Path,
    eval_art: Path | None,
    key: str,
    inputs: list[dict[str, Any]],
    section: dict[str, Any],
    progress: bool,
) -> Path:
    from tasks.deploy.onnx_generate import encode_prompt
    from tasks.modeling.build import load_network  # lazy: MindSpore and onnxruntime, in the export child only

    ex = cfg.export
    t0 = time.perf_counter()
    info = read_info(model)
    sp = load_tokenizer(model)
    prompts = [encode_prompt(sp, p)[-ex.seq_length :] for p in ex.prompts]
    reference = Reference(load_network(model)[0])
    ver: dict[str, Any] = {
        "atol": ex.atol,
        "prompts": list(ex.prompts),
        "prompt_format": PROMPT_FORMAT,
        "mindir_max_abs_diff": None,
        "onnx_max_abs_diff": None,
        "onnx_checker": None,
        "greedy_tokens_match": None,
        "max_new_tokens": ex.max_new_tokens,
        "window": ex.seq_length,
        "shapes": {},
    }
    failures: list[str] = []
    with store.build(STAGE, key, pipeline=cfg.name, config=section, inputs=inputs, code=code_version(STAGE)) as b:
        if "mindir" in ex.formats:
            failures += mindir_checked(b.dir, model, reference, prompts, ex, ver, progress)
        if "onnx" in ex.formats:
            failures += onnx_checked(
                b.dir, info, load_weights(model), model, store, sp, prompts, reference, ex, ver, progress
            )
        if "gguf" in ex.formats:
            failures += gguf_checked(b.dir, info, load_weights(model), sp, prompts, ex, ver, progress)
        if failures:
            raise ExportCheckFailed("export verification failed: " + "; ".join(failures))

        mc = model_config(model)
        _write_export_files(b.dir, model, info, sp, mc, ex, ver)
        evaluation = read_eval(eval_art) if eval_art is not None else None
        card = model_card(
            info=info,
            parameters=mc.num_parameters,
            model_ref=inputs[0],
            pipeline=cfg.name,
            verification=ver,
            lineage=_lineage(store, model),
            evaluation=evaluation,
            artifact_path=b.path,
        )
        (b.dir / "MODEL_CARD.md").write_text(card, encoding="utf-8")
        b.extra["verification"] = ver
        b.metrics.update(_metrics(ver, ex, mc, time.perf_counter() - t0))
        b.metrics = {k: v for k, v in b.metrics.items() if v is not None}
    log(progress, f"wrote {b.path}")
    return b.path


def _write_export_files(out: Path, model: Path, info: dict[str, Any], sp, mc, ex, ver: dict[str, Any]) -> None:
    """Beside the checked model files: the tokenizer, model.json, the prompt style, the generate scripts, and
    export.json (I/O names, files, their digests, the verification)."""
    copy_tokenizer_files(model, out)
    shutil.copy2(model / "model.json", out / "model.json")
    # how the model is asked (tasks/prompts.py), for the server of this export: the model's own record
    atomic_write_json(out / PROMPT_STYLE_FILE, style_record(load_prompt_style(model, sp)))
    for name, src in _GENERATE_SCRIPTS.items():
        shutil.copy2(src, out / name)
    files = [
        f
        for f in (
            "model.mindir",
            "model.onnx",
            "model.int8.onnx",
            "model.f16.gguf",
            "model.q8_0.gguf",
            *GENAI_FILES,
        )
        if (out / f).is_file()
    ]
    # the export carries its own digests, so the standalone onnx_generate.py checks a copied export too
    digests = {f: sha256_file(out / f) for f in sorted({*files, *(t.name for t in tokenizer_files(out)), "model.json"})}
    atomic_write_json(
        out / "export.json",
        {
            "mindir": {
                "inputs": {MINDIR_INPUT: "int32 [batch, seq] token ids"},
                "outputs": {OUTPUT_NAME: "float32 [batch, seq, vocab]"},
            },
            "onnx": onnx_io(mc.to_dict()) if "onnx" in ex.formats else None,
            "files": files,
            "digests": digests,
            "tokenizer": info.get("tokenizer", {}),
            "prompt_format": PROMPT_FORMAT,
            "verification": ver,
        },
    )


_INT8_METRICS = (
    "bytes",
    "size_ratio",
    "max_abs_diff",
    "greedy_tokens_match",
    "perplexity",
    "fp32_perplexity",
    "perplexity_change_pct",
    "decode_tokens_per_s",
    "fp32_decode_tokens_per_s",
    "speedup",
)


def _metrics(ver: dict[str, Any], ex, mc, seconds: float) -> dict[str, Any]:
    """The manifest's metrics of an export: its checks' figures (None where a format was not exported)."""
    genai, int8 = ver.get("genai") or {}, ver.get("int8") or {}
    return dict(
        mindir_max_abs_diff=ver["mindir_max_abs_diff"],
        onnx_max_abs_diff=ver["onnx_max_abs_diff"],
        greedy_tokens_match=ver["greedy_tokens_match"],
        onnx_kv_steps=ver.get("onnx_kv_steps"),
        onnx_bytes=ver.get("onnx_bytes"),
        genai_greedy_tokens_match=genai.get("greedy_tokens_match"),
        genai_tokenizer_ids_match=genai.get("tokenizer_ids_match"),
        atol=ex.atol,
        **{f"int8_{k}": int8.get(k) for k in _INT8_METRICS},
        parameters=mc.num_parameters,
        export_seconds=round(seconds, 1),
    )


def _lineage(store: ArtifactStore, model: Path) -> dict[str, Any]:

    tree = lineage_tree(store, model)
    return {"text": render(tree, "text"), "raw": raw_inputs(tree)}
