"""The export stage: a model artifact → verified MindIR and ONNX (KV cache, dynamic shapes), runnable by onnxruntime-genai.

    path = run(cfg, store, model_artifact)                          # cached by content, like every stage
    path = run(cfg, store, model_artifact, eval_artifact=ev)        # the card also shows ev's results

    msllm export --pipeline NAME [--from MODEL_ARTIFACT] [--set export.int8=true]

`model_artifact` is a pretrain, convert or merged artifact; a finetune artifact is merged
first (`tasks.stages.finetune.merge`). The work runs in a child process
(`python -m tasks.stages.export --child SPEC`): MindSpore's export keeps process-global state
(exporting one Cell twice in a process fails), so each export gets a fresh process.

What is exported (`export` section of pipelines.yaml):
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

Verification (inside the stage; a failure of the first four fails it and leaves no artifact):
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
    export.json           input/output names and shapes, prompt format, verification
    MODEL_CARD.md         config, lineage summary, eval results (when given), verification, usage
    onnx_generate.py      a copy of tasks/deploy/onnx_generate.py: KV-cache generation with onnxruntime only
manifest: `verification` (as in export.json) and metrics mindir_max_abs_diff, onnx_max_abs_diff,
greedy_tokens_match, genai_greedy_tokens_match, genai_tokenizer_ids_match, onnx_bytes, int8_* (when on),
parameters, export_seconds.
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

from tasks.store.artifacts import ArtifactError, ArtifactStore, atomic_write_json
from tasks.stages import MODEL_KINDS, code_version
from tasks.config import ConfigError, PipelineConfig

STAGE = "export"
MODEL_STAGES = MODEL_KINDS  # artifacts holding model.json + weights (the stage table's)
MINDIR_INPUT, OUTPUT_NAME = "input_ids", "logits"
PROMPT_FORMAT = "[eos_id] + sentencepiece ids (EOS starts a document, as in pretraining and eval)"
STEPS = 8            # single-token steps (present → past) of the ONNX check
CHUNK = 3            # tokens per row of the batched check over a past
MIN_SEQ_LENGTH = 2 + CHUNK + STEPS   # a prompt of 2 tokens, the chunk and the steps
HELDOUT_BLOCKS = 8   # held-out blocks of the int8 perplexity comparison
SPEED_TOKENS = 32    # decode steps timed per model for the int8 speed comparison
GENAI_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json")
# fixed lines for the tokenizer check: contractions, punctuation, digits, newlines, non-ASCII
TOKENIZER_SAMPLES = ["'That I can't, 'tis so; they'll've done it.", "KING HENRY VI:\nWhat, 12 or 345 men?",
                     "Ay, me!  Two  spaces,\ttabs\tand\n\nblank lines.", "naïve café — “quotes” ✓ 日本語"]
_GENERATE_SCRIPT = Path(__file__).resolve().parents[1] / "deploy" / "onnx_generate.py"  # copied into the artifact


class ExportCheckFailed(RuntimeError):
    """An exported model does not reproduce the MindSpore network (logits or greedy tokens)."""

    permanent = True  # deterministic: the same export fails the same way


# ----------------------------------------------------------------------------- keys and inputs


def resolve_model(store: ArtifactStore, path: str | Path) -> Path:
    """The model artifact to export: `path` itself, or for a finetune artifact its merged model."""
    p = store.inside(path)
    stage = store.read_manifest(p)["stage"]
    if stage == "finetune":
        from tasks.stages.finetune import merge

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
                            "(tasks.stages.finetune.merge, or export.run, which merges)")
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
        errs.append(f"{p}.seq_length: {ex.seq_length}; the ONNX checks need at least {MIN_SEQ_LENGTH} positions "
                    f"(a 2-token prompt, a {CHUNK}-token chunk and {STEPS} single-token steps); raise it")
    if not ex.formats:
        errs.append(f"{p}.formats: empty; list mindir and/or onnx")
    if ex.int8 and "onnx" not in ex.formats:
        errs.append(f"{p}.int8: true needs the onnx format; add onnx to {p}.formats or set int8: false")
    if info.get("name", "llama") != "llama":
        errs.append(f"{p}.formats: the model is a {info.get('name')!r} model; the ONNX decoder is written for "
                    "llama models only: export it as mindir")
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
    process) or tasks.runtime.supervise.StageFailed (from the child, message starting with the
    check that failed) when an exported model does not match; no artifact is written then.
    `isolate=False` exports in this process (tests).
    """
    from tasks.store.model_artifact import read_info
    from tasks.runtime.supervise import supervise

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
    from tasks.training.checkpoint import load_weights
    from tasks.store.model_artifact import load_model, load_tokenizer, model_config, read_info
    from tasks.deploy.onnx_generate import encode_prompt

    ex = cfg.export
    t0 = time.perf_counter()
    info = read_info(model)
    sp = load_tokenizer(model)
    prompts = [encode_prompt(sp, p)[-ex.seq_length:] for p in ex.prompts]
    reference = _Reference(load_model(model)[0])
    fixed = _batches(prompts, ex.batch_size, ex.seq_length)  # one of the MindIR check shapes [B, T]
    ver: dict[str, Any] = {"atol": ex.atol, "prompts": list(ex.prompts), "prompt_format": PROMPT_FORMAT,
                           "mindir_max_abs_diff": None, "onnx_max_abs_diff": None, "onnx_checker": None,
                           "greedy_tokens_match": None, "max_new_tokens": ex.max_new_tokens,
                           "window": ex.seq_length, "shapes": {}}
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
            failures += _export_onnx_checked(b.dir, info, load_weights(model), model, store, sp, prompts, reference,
                                             ex, ver, progress)
        if failures:
            raise ExportCheckFailed("export verification failed: " + "; ".join(failures))

        shutil.copy2(model / "tokenizer.model", b.dir / "tokenizer.model")
        shutil.copy2(model / "model.json", b.dir / "model.json")
        shutil.copy2(_GENERATE_SCRIPT, b.dir / "onnx_generate.py")
        mc = model_config(model)
        files = [f for f in ("model.mindir", "model.onnx", "model.int8.onnx", *GENAI_FILES) if (b.dir / f).is_file()]
        atomic_write_json(b.dir / "export.json", {
            "mindir": {"inputs": {MINDIR_INPUT: "int32 [batch, seq] token ids"},
                       "outputs": {OUTPUT_NAME: "float32 [batch, seq, vocab]"}},
            "onnx": onnx_io(mc.to_dict()) if "onnx" in ex.formats else None,
            "files": files, "tokenizer": info.get("tokenizer", {}), "prompt_format": PROMPT_FORMAT,
            "verification": ver})
        evaluation = _read_eval(eval_art) if eval_art is not None else None
        card = model_card(info=info, parameters=mc.num_parameters, model_ref=inputs[0], pipeline=cfg.name,
                          verification=ver, lineage=_lineage(store, model), evaluation=evaluation,
                          artifact_path=b.path)
        (b.dir / "MODEL_CARD.md").write_text(card, encoding="utf-8")
        b.extra["verification"] = ver
        genai, int8 = ver.get("genai") or {}, ver.get("int8") or {}
        b.metrics.update(
            mindir_max_abs_diff=ver["mindir_max_abs_diff"], onnx_max_abs_diff=ver["onnx_max_abs_diff"],
            greedy_tokens_match=ver["greedy_tokens_match"], onnx_kv_steps=ver.get("onnx_kv_steps"),
            onnx_bytes=ver.get("onnx_bytes"), genai_greedy_tokens_match=genai.get("greedy_tokens_match"),
            genai_tokenizer_ids_match=genai.get("tokenizer_ids_match"), atol=ex.atol,
            **{f"int8_{k}": int8.get(k) for k in ("bytes", "size_ratio", "max_abs_diff", "greedy_tokens_match",
                                                   "perplexity", "fp32_perplexity", "perplexity_change_pct",
                                                   "decode_tokens_per_s", "fp32_decode_tokens_per_s", "speedup")},
            parameters=mc.num_parameters, export_seconds=round(time.perf_counter() - t0, 1))
        b.metrics = {k: v for k, v in b.metrics.items() if v is not None}
    _log(progress, f"wrote {b.path}")
    return b.path


def _export_onnx_checked(out: Path, info: dict[str, Any], weights: dict[str, np.ndarray], model: Path,
                         store: ArtifactStore, sp, prompts: list[list[int]], reference: "_Reference", ex,
                         ver: dict[str, Any], progress: bool) -> list[str]:
    """Write and verify model.onnx (+ the genai files, + model.int8.onnx); fill `ver`; return the failures."""
    from tasks.deploy.onnx_generate import OnnxGenerator

    failures: list[str] = []
    meta = {"eos_id": str(sp.eos_id()), "prompt_format": PROMPT_FORMAT}
    _log(progress, f"ONNX decoder (KV cache, dynamic batch/sequence/past) → {out.name}/model.onnx")
    ver.update(export_onnx(info, weights, out / "model.onnx", meta))
    ver["onnx_checker"] = "passed"  # export_onnx raises otherwise
    gen = OnnxGenerator(out / "model.onnx", max_len=ex.seq_length)
    room = ex.seq_length - CHUNK - STEPS  # each checked row (prompt + chunk + steps) fits the window
    ver["onnx_checks"] = onnx_checks(gen, reference, [p[-room:] for p in prompts], info["model"]["vocab_size"])
    ver["onnx_kv_steps"] = STEPS
    diff = max(c["max_abs_diff"] for c in ver["onnx_checks"])
    ver["onnx_max_abs_diff"] = diff
    ver["shapes"]["onnx"] = {"exported": ["batch_size", "sequence_length", "past_sequence_length"],
                             "checked": [[c["batch"], c["sequence"], c["past"]] for c in ver["onnx_checks"]]}
    _log(progress, f"onnxruntime max |Δlogit| {diff:.3g} over {len(ver['onnx_checks'])} (batch, sequence, past) "
                   f"checks incl. {STEPS} single-token steps")
    if not diff <= ex.atol:
        worst = max(ver["onnx_checks"], key=lambda c: c["max_abs_diff"])
        failures.append(f"ONNX max |logit diff| {diff:.3g} > export.atol {ex.atol:g} (worst: {worst['check']})")
    ver["greedy"] = greedy_pairs(gen, reference.net, sp, list(zip(ex.prompts, prompts)), ex.max_new_tokens,
                                 ex.seq_length)
    ver["greedy_tokens_match"] = all(g["mindspore"] == g["onnxruntime"] for g in ver["greedy"])
    failures += [_divergence(g, "onnxruntime") for g in ver["greedy"] if g["mindspore"] != g["onnxruntime"]]
    _log(progress, f"greedy tokens onnxruntime (KV cache) == MindSpore: {ver['greedy_tokens_match']} "
                   f"({len(prompts)} prompts, up to {ex.max_new_tokens} tokens)")

    data = _heldout_data(store, model)
    heldout = _heldout_rows(data) if data is not None else None
    no_tokenizer = write_genai_files(out, info, (model / "tokenizer.model").read_bytes())
    if no_tokenizer:
        _log(progress, f"onnxruntime-genai: no tokenizer files ({no_tokenizer}); genai generates from token ids")
    texts = [*ex.prompts, *TOKENIZER_SAMPLES, *(_decode_rows(sp, heldout[0]) if heldout else [])]
    ver["genai"] = verify_genai(out, sp, texts, ver["greedy"], ex.max_new_tokens, ex.seq_length)
    g = ver["genai"]
    g["tokenizer_files"] = "not written: " + no_tokenizer if no_tokenizer else "tokenizer.json, tokenizer_config.json"
    _log(progress, f"onnxruntime-genai: greedy tokens == MindSpore: {g['greedy_tokens_match']}; tokenizer ids == "
                   f"SentencePiece on {g['tokenizer_texts']} texts ({g['tokenizer_tokens']} tokens): "
                   f"{g['tokenizer_ids_match']}")
    failures += [_divergence(x, "onnxruntime_genai") for x in ver["greedy"] if x["mindspore"] != x["onnxruntime_genai"]]
    if g["tokenizer_ids_match"] is False:
        _log(progress, f"warning: onnxruntime-genai's tokenizer differs from SentencePiece: "
                       f"{g['tokenizer_first_mismatch']}")

    if ex.int8:
        _log(progress, f"int8 (dynamic quantization) → {out.name}/model.int8.onnx")
        export_int8(out / "model.onnx", out / "model.int8.onnx")
        ver["int8"] = int8_report(out, gen, reference, prompts, ver["greedy"], heldout, data, ex)
        q = ver["int8"]
        _log(progress, f"int8: {q['bytes'] / 1e6:.1f} MB ({q['size_ratio']:.2f}× fp32), decode "
                       f"{q['decode_tokens_per_s']} vs fp32 {q['fp32_decode_tokens_per_s']} tokens/s, perplexity "
                       f"{q['perplexity']:.4g} vs fp32 {q['fp32_perplexity']:.4g} "
                       f"({q['perplexity_change_pct']:+.2f}%, {q['perplexity_source']})")
    return failures


class _Reference:
    """Logits of the MindSpore network (eager) for an int32 batch, memoised: the ground truth of every check."""

    def __init__(self, net):
        self.net = net
        self._memo: dict[tuple, np.ndarray] = {}

    def __call__(self, x: np.ndarray) -> np.ndarray:
        import mindspore as ms

        x = np.asarray(x, np.int32)
        k = (x.shape, x.tobytes())
        if k not in self._memo:
            self._memo[k] = self.net(ms.Tensor(x)).asnumpy()
        return self._memo[k]


def verify_mindir(path: Path, reference: _Reference, batches: list[np.ndarray]) -> float:
    """Max |logit difference| of the reloaded MindIR (`ms.load` + `nn.GraphCell`) against the reference."""
    import mindspore as ms

    graph = ms.nn.GraphCell(ms.load(str(path)))
    return max(_max_abs_diff(graph(ms.Tensor(x)).asnumpy(), reference(x)) for x in batches)


def onnx_checks(gen, reference: _Reference, prompts: list[list[int]], vocab_size: int) -> list[dict[str, Any]]:
    """onnxruntime's logits against MindSpore's at several (batch, sequence, past) combinations.

    Each prompt is extended by CHUNK + STEPS fixed pseudo-random tokens; MindSpore runs the
    extended rows once (right-padded: causal attention keeps every real position exact) and
    every ONNX call is compared with the positions it computes. Returns one record per
    combination: check, batch, sequence, past (for a left-padded batch: its padded lengths),
    max_abs_diff.
    """
    rng = np.random.default_rng(0)
    batch = prompts if len(prompts) > 1 else [prompts[0], prompts[0][len(prompts[0]) // 2:]]  # batch > 1, padded
    ext = [[int(t) for t in rng.integers(0, vocab_size, CHUNK + STEPS)] for _ in batch]
    rows = [p + e for p, e in zip(batch, ext)]
    ref = reference(_batches(rows, len(rows), max(map(len, rows)))[0])        # [n, L, V]
    out: list[dict[str, Any]] = []

    def record(check: str, b: int, t: int, past: int, d: float) -> None:
        out.append({"check": check, "batch": b, "sequence": t, "past": past, "max_abs_diff": d})

    def ones(b: int, n: int) -> np.ndarray:
        return np.ones((b, n), np.int64)

    # each prompt alone, no past
    for i, p in enumerate(batch[:len(prompts)]):
        logits, _ = gen.forward(np.array([p]), ones(1, len(p)), np.arange(len(p))[None], gen.empty_past(1))
        record("one prompt, no past", 1, len(p), 0, _max_abs_diff(logits[0], ref[i, :len(p)]))
    # one row as a past (its prompt) plus everything after it in one call
    p0, r0 = batch[0], rows[0]
    _, past = gen.forward(np.array([p0]), ones(1, len(p0)), np.arange(len(p0))[None], gen.empty_past(1))
    rest = r0[len(p0):]
    logits, _ = gen.forward(np.array([rest]), ones(1, len(r0)), np.arange(len(p0), len(r0))[None], past)
    record("one prompt as the past, the rest in one call", 1, len(rest), len(p0),
           _max_abs_diff(logits[0], ref[0, len(p0):len(r0)]))
    # all prompts left-padded in one batch, no past
    n, t = len(batch), max(map(len, batch))
    ids, mask = np.zeros((n, t), np.int64), np.zeros((n, t), np.int64)
    for i, p in enumerate(batch):
        ids[i, t - len(p):], mask[i, t - len(p):] = p, 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    logits, past = gen.forward(ids, mask, pos, gen.empty_past(n))
    record("batch, left-padded, no past", n, t, 0,
           max(_max_abs_diff(logits[i, t - len(p):], ref[i, :len(p)]) for i, p in enumerate(batch)))
    # the batch continues with a chunk of CHUNK tokens per row over its past
    lens = np.array([len(p) for p in batch])
    chunk = np.array([e[:CHUNK] for e in ext], np.int64)
    mask = np.concatenate([mask, ones(n, CHUNK)], axis=1)
    logits, past = gen.forward(chunk, mask, lens[:, None] + np.arange(CHUNK)[None], past)
    record("batch, left-padded, a chunk over the past", n, CHUNK, t,
           max(_max_abs_diff(logits[i], ref[i, lens[i]:lens[i] + CHUNK]) for i in range(n)))
    # STEPS single-token steps, present fed back as past
    d = 0.0
    for s in range(STEPS):
        tok = np.array([[e[CHUNK + s]] for e in ext], np.int64)
        mask = np.concatenate([mask, ones(n, 1)], axis=1)
        logits, past = gen.forward(tok, mask, (lens + CHUNK + s)[:, None], past)
        d = max(d, max(_max_abs_diff(logits[i, 0], ref[i, lens[i] + CHUNK + s]) for i in range(n)))
    record(f"batch, {STEPS} single-token steps (present → past)", n, 1, t + CHUNK, d)
    out[-1]["past_last"] = t + CHUNK + STEPS - 1
    return out


def greedy_pairs(gen, net, sp, prompts: list[tuple[str, list[int]]], max_new_tokens: int,
                 seq_length: int) -> list[dict[str, Any]]:
    """Greedy tokens per prompt from MindSpore's generator and from onnxruntime's (`gen`), over the same window."""
    from model.generate import Generator
    from tasks.deploy.onnx_generate import decode_completion

    ms_gen, eos = Generator(net, max_len=seq_length), sp.eos_id()
    out = []
    for text, ids in prompts:
        want = ms_gen.generate(ids, max_new_tokens, eos_id=eos)
        got = gen.generate(ids, max_new_tokens, eos_id=eos)
        out.append({"prompt": text, "prompt_ids": ids, "mindspore": want, "onnxruntime": got,
                    "completion": decode_completion(sp, ids, got)})
    return out


def _divergence(g: dict[str, Any], runtime: str) -> str:
    want, got = g["mindspore"], g[runtime]
    at = next((i for i, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
    return f"greedy tokens differ for prompt {g['prompt']!r} from new token {at}: MindSpore {want} vs {runtime} {got}"


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


# ----------------------------------------------------------------------------- onnxruntime-genai


def write_genai_files(out: Path, info: dict[str, Any], tokenizer_model: bytes) -> str | None:
    """genai_config.json, tokenizer.json and tokenizer_config.json next to model.onnx.

    Returns None, or why the tokenizer files were not written (a SentencePiece model that is
    not BPE): genai then still generates from token ids.
    """
    from tasks.deploy.onnx_decoder import genai_config, hf_tokenizer_files

    tok = info.get("tokenizer", {})
    eos = tok.get("eos_id", 2)
    pad = tok.get("pad_id", -1)
    atomic_write_json(out / "genai_config.json", genai_config(info["model"], eos_id=eos, bos_id=tok.get("bos_id", 1),
                                                              pad_id=pad if pad is not None and pad >= 0 else eos))
    try:
        tok_json, tok_cfg = hf_tokenizer_files(tokenizer_model)
    except ValueError as exc:
        return str(exc)
    atomic_write_json(out / "tokenizer.json", tok_json)
    atomic_write_json(out / "tokenizer_config.json", tok_cfg)
    return None


def genai_generate(model, ids: list[int], max_new_tokens: int, hold_eos: bool = False) -> list[int]:
    """Greedy new tokens of onnxruntime-genai after `ids` (stops at the config's EOS, included, unless hold_eos)."""
    import onnxruntime_genai as og

    if max_new_tokens <= 0:
        return []
    params = og.GeneratorParams(model)
    opts = {"max_length": len(ids) + max_new_tokens, "do_sample": False}
    params.set_search_options(**opts, **({"min_length": opts["max_length"]} if hold_eos else {}))
    gen = og.Generator(model, params)
    gen.append_tokens(ids)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(ids):]]


def verify_genai(out: Path, sp, texts: list[str], greedy: list[dict[str, Any]], max_new_tokens: int,
                 seq_length: int) -> dict[str, Any]:
    """onnxruntime-genai on the export directory: greedy tokens per prompt (added to `greedy` rows) and tokenizer ids."""
    import onnxruntime_genai as og

    model = og.Model(str(out))
    for g in greedy:  # the window of model.generate.Generator(max_len=seq_length)
        ids = g["prompt_ids"][-(seq_length - 1):]
        g["onnxruntime_genai"] = genai_generate(model, ids, min(max_new_tokens, seq_length - len(ids)))
    res = {"greedy_tokens_match": all(g["mindspore"] == g["onnxruntime_genai"] for g in greedy),
           "version": og.__version__}
    if not (out / "tokenizer.json").is_file():
        return {**res, "tokenizer_ids_match": None, "tokenizer_texts": 0, "tokenizer_tokens": 0,
                "tokenizer_first_mismatch": None, "text_prefix": "", "decode_matches": None}
    tok = og.Tokenizer(model)
    # onnxruntime-genai 0.18 does not add SentencePiece's dummy prefix ("▁" before the text) with this
    # tokenizer.json: for a model that has one, the equivalent of sp.encode(text) is tok.encode(" " + text)
    prefix = " " if json.loads((out / "tokenizer_config.json").read_text())["add_prefix_space"] else ""
    first, tokens = None, 0
    for text in texts:
        want, got = sp.encode(text), [int(t) for t in tok.encode(prefix + text)]
        tokens += len(want)
        if want != got and first is None:
            at = next((i for i, (a, c) in enumerate(zip(want, got)) if a != c), min(len(want), len(got)))
            first = {"text": text[max(0, at - 40):at + 80], "sentencepiece": want[at:at + 8], "genai": got[at:at + 8]}
    decoded = all(tok.decode(g["mindspore"]) in (sp.decode(g["mindspore"]), prefix + sp.decode(g["mindspore"]))
                  for g in greedy)
    return {**res, "tokenizer_ids_match": first is None, "tokenizer_texts": len(texts), "tokenizer_tokens": tokens,
            "tokenizer_first_mismatch": first, "text_prefix": prefix, "decode_matches": decoded}


# ----------------------------------------------------------------------------- int8


def export_int8(src: Path, dst: Path) -> None:
    """Dynamic int8 quantization of every MatMul with a constant (weight) input; attention MatMuls stay fp32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"],
                     extra_options={"MatMulConstBOnly": True})


def _heldout_data(store: ArtifactStore, model: Path) -> Path | None:
    from tasks.stages.evaluate import lineage_data_artifact

    try:
        return lineage_data_artifact(store, model)
    except (ArtifactError, OSError, ValueError, KeyError):
        return None


def _heldout_rows(data: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(input_ids [B, T], labels [B, T], -100 = not counted) of the first HELDOUT_BLOCKS valid blocks, or None."""
    from tasks.stages.pretrain import block_batches

    from tasks.stages.data import DataError

    try:
        for ids, labels in block_batches(data, "valid", HELDOUT_BLOCKS, 10**9, seed=0, repeat=False):
            return ids, labels
    except (DataError, ArtifactError, OSError, ValueError, RuntimeError):  # unreadable or empty: the prompts instead
        return None
    return None


def _decode_rows(sp, ids: np.ndarray) -> list[str]:
    """The documents in token rows (split at EOS, padding dropped) as text."""
    skip = {sp.eos_id(), sp.pad_id(), sp.bos_id()}
    out = []
    for row in ids:
        doc: list[int] = []
        for t in [*row.tolist(), sp.eos_id()]:
            if t == sp.eos_id():
                if doc:
                    out.append(sp.decode(doc))
                doc = []
            elif t not in skip:
                doc.append(int(t))
    return out


def perplexity(gen, ids: np.ndarray, labels: np.ndarray) -> float:
    """exp(mean NLL) of `labels` (aligned with `ids`; -100 skipped) under an OnnxGenerator's full forward."""
    logits = gen.logits([list(r) for r in ids]).astype(np.float64)          # [B, T, V]
    keep = labels != -100
    z = logits - logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=-1))                                      # [B, T]
    target = np.take_along_axis(z, np.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    return float(np.exp(((lse - target) * keep).sum() / max(int(keep.sum()), 1)))


def decode_speeds(gens: list, prompt: list[int], n: int, rounds: int = 3) -> list[float]:
    """Decode tokens/s of each OnnxGenerator (greedy, no EOS stop; the steps after the first token).

    After a warm-up, the generators take turns for `rounds` rounds and each keeps its best: on a
    shared machine the others' load then hits both alike. A rough figure, not a benchmark
    (scripts/bench/export.py is).
    """
    best = [0.0] * len(gens)
    for g in gens:
        g.generate(prompt, 2)
    for _ in range(rounds):
        for i, g in enumerate(gens):
            it = g.stream(prompt, n)
            next(it)
            t0 = time.perf_counter()
            steps = sum(1 for _ in it)
            best[i] = max(best[i], steps / max(time.perf_counter() - t0, 1e-9))
    return [round(b, 1) for b in best]


def int8_report(out: Path, fp32, reference: _Reference, prompts: list[list[int]], greedy: list[dict[str, Any]],
                heldout: tuple[np.ndarray, np.ndarray] | None, data: Path | None, ex) -> dict[str, Any]:
    """Size, decode speed, perplexity change, logit difference and greedy agreement of model.int8.onnx vs fp32."""
    from tasks.deploy.onnx_generate import OnnxGenerator

    q = OnnxGenerator(out / "model.int8.onnx", max_len=ex.seq_length)
    fp32_bytes, q_bytes = (out / "model.onnx").stat().st_size, (out / "model.int8.onnx").stat().st_size
    x = _batches(prompts, len(prompts), max(map(len, prompts)))[0]
    ref = reference(x)
    got = q.logits([list(p) for p in prompts])
    diff = max(_max_abs_diff(got[i, :len(p)], ref[i, :len(p)]) for i, p in enumerate(prompts))
    q_greedy = [q.generate(g["prompt_ids"], ex.max_new_tokens, eos_id=fp32.eos_id) for g in greedy]
    if heldout is not None:
        ids, labels = heldout
        source = f"held-out: {len(ids)} valid blocks × {ids.shape[1]} tokens of {data.parent.name}/{data.name}"
    else:  # the prompts and MindSpore's greedy continuations, scored after the first token
        rows = [list(g["prompt_ids"]) + list(g["mindspore"]) for g in greedy]
        rows = [r for r in rows if len(r) > 1] or [list(prompts[0])]
        t = max(map(len, rows)) - 1
        ids = np.zeros((len(rows), t), np.int64)
        labels = np.full((len(rows), t), -100, np.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r) - 1], labels[i, :len(r) - 1] = r[:-1], r[1:]
        source = "the export prompts and MindSpore's greedy continuations (no data artifact in the store)"
    p32, p8 = perplexity(fp32, ids, labels), perplexity(q, ids, labels)
    n = max(2, min(SPEED_TOKENS, ex.seq_length - len(prompts[0])))
    s32, s8 = decode_speeds([fp32, q], prompts[0], n)
    return {"file": "model.int8.onnx", "method": "onnxruntime.quantization.quantize_dynamic, QInt8 weights, "
                                                 "MatMul with constant B only",
            "bytes": q_bytes, "fp32_bytes": fp32_bytes, "size_ratio": round(q_bytes / fp32_bytes, 4),
            "max_abs_diff": diff, "greedy_tokens_match": all(a == g["mindspore"] for a, g in zip(q_greedy, greedy)),
            "greedy": q_greedy, "perplexity": p8, "fp32_perplexity": p32,
            "perplexity_change_pct": round(100.0 * (p8 - p32) / p32, 4), "perplexity_source": source,
            "decode_tokens_per_s": s8, "fp32_decode_tokens_per_s": s32, "speed_tokens": n,
            "speedup": round(s8 / s32, 3) if s32 else None}


# ----------------------------------------------------------------------------- the formats


def export_mindir(net, path: Path) -> None:
    """MindIR with a dynamic [batch, seq] int32 input; `path` ends in .mindir."""
    import mindspore as ms

    ms.export(net, ms.Tensor(shape=[None, None], dtype=ms.int32), file_name=str(path.with_suffix("")),
              file_format="MINDIR")
    os.chmod(path, 0o644)  # MindSpore writes it owner-read-only


def export_onnx(info: dict[str, Any], weights: dict[str, np.ndarray], path: Path,
                meta: dict[str, str] | None = None) -> dict[str, Any]:
    """The KV-cache decoder (tasks/deploy/onnx_decoder.py) from `weights`, saved at `path` and checked.

    Returns {"onnx_opset", "onnx_bytes"}; ExportCheckFailed when onnx.checker rejects the file.
    """
    from tasks.deploy.onnx_decoder import OPSET, build_decoder, check_model, save_model

    files = save_model(build_decoder(info["model"], weights, metadata=meta), path)
    try:
        check_model(path)
    except ValueError as exc:
        raise ExportCheckFailed(f"export verification failed: {exc}") from None
    return {"onnx_opset": OPSET, "onnx_bytes": sum(f.stat().st_size for f in files)}


def onnx_io(model_config: dict[str, Any]) -> dict[str, Any]:
    """Names, types and shapes of model.onnx's inputs and outputs (export.json)."""
    L, nkv = model_config["num_layers"], model_config["num_kv_heads"]
    hd = model_config["hidden_size"] // model_config["num_heads"]
    kv = f"float32 [batch, {nkv}, {{}}, {hd}]"
    return {
        "inputs": {"input_ids": "int64 [batch, sequence]", "attention_mask": "int64 [batch, past + sequence] "
                   "(1 = token, 0 = padding)", "position_ids": "int64 [batch, sequence]",
                   **{f"past_key_values.{i}.{n}": kv.format("past") for i in range(L) for n in ("key", "value")}},
        "outputs": {"logits": f"float32 [batch, sequence, {model_config['vocab_size']}]",
                    **{f"present.{i}.{n}": kv.format("past + sequence") for i in range(L) for n in ("key", "value")}},
        "cache": "feed present.{i}.key/value back as past_key_values.{i}.key/value; a first call takes past of "
                 "length 0; batches are left-padded with position_ids counting real tokens",
    }


# ----------------------------------------------------------------------------- model card


def _lineage(store: ArtifactStore, model: Path) -> dict[str, Any]:
    from tasks.store.lineage import lineage_tree, raw_inputs, render

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
    from tasks.deploy.onnx_generate import GENAI_SNIPPET, SNIPPET

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
    onnx, int8, genai = "onnx" in shapes, v.get("int8"), v.get("genai") or {}
    lines += ["## Files", "", "| file | what it is for |", "|---|---|"]
    if "mindir" in shapes:
        lines.append("| model.mindir | MindSpore's own format: `input_ids` int32 [batch, seq] (dynamic) → logits float32 "
                     "[batch, seq, vocab], a full forward; `mindspore.load` + `nn.GraphCell` |")
    if onnx:
        lines += [f"| model.onnx | ONNX decoder with a KV cache (opset {v.get('onnx_opset')}): `input_ids`, "
                  "`attention_mask`, `position_ids`, `past_key_values.{i}.key/value` → `logits`, "
                  "`present.{i}.key/value`; batch, sequence and past dynamic. onnxruntime, onnxruntime-genai |"]
        if int8:
            lines.append(f"| model.int8.onnx | the same decoder with int8 weights (dynamic quantization): "
                         f"{int8['size_ratio']:.2f}× the size |")
        lines += ["| genai_config.json | onnxruntime-genai's description of model.onnx (decoder type llama) |",
                  "| tokenizer.json, tokenizer_config.json | tokenizer.model as a Hugging Face BPE tokenizer, for "
                  "onnxruntime-genai (which does not read SentencePiece models) |"]
    lines += ["| tokenizer.model | the SentencePiece model |", "| model.json | architecture and tokenizer ids |",
              "| export.json | names, shapes, prompt format, verification |"]
    if onnx:
        lines.append("| onnx_generate.py | KV-cache generation with onnxruntime only: "
                     "`python onnx_generate.py . \"ROMEO:\"` |")
    lines.append("")

    lines += ["## Verification", "", f"Against the MindSpore network on {len(v['prompts'])} fixed prompts "
              f"({', '.join(repr(p) for p in v['prompts'])}), encoded as {v['prompt_format']}.", "",
              "| check | result |", "|---|---|"]
    if "mindir" in shapes:
        lines.append(f"| MindIR max abs logit diff | {_num(v['mindir_max_abs_diff'])} at shapes "
                     f"{', '.join(str(list(s)) for s in shapes['mindir']['checked'])} |")
    if onnx:
        lines += [f"| onnxruntime: {c['check']} (batch {c['batch']}, sequence {c['sequence']}, past {c['past']}) | "
                  f"max abs logit diff {_num(c['max_abs_diff'])} |" for c in v.get("onnx_checks", [])]
        n_ok = sum(g["mindspore"] == g["onnxruntime"] for g in v.get("greedy", []))
        lines += [f"| onnx.checker (full check) | {v.get('onnx_checker')} |",
                  f"| greedy tokens, onnxruntime (KV cache) == MindSpore | {n_ok}/{len(v.get('greedy', []))} prompts, "
                  f"up to {v['max_new_tokens']} new tokens |"]
        if genai:
            n_ok = sum(g["mindspore"] == g.get("onnxruntime_genai") for g in v.get("greedy", []))
            lines += [f"| greedy tokens, onnxruntime-genai {genai.get('version')} == MindSpore | "
                      f"{n_ok}/{len(v.get('greedy', []))} prompts |",
                      f"| tokenizer.json ids == SentencePiece (onnxruntime-genai's tokenizer) | "
                      + (f"{genai['tokenizer_ids_match']} on {genai['tokenizer_texts']} texts, "
                         f"{genai['tokenizer_tokens']} tokens |" if genai.get("tokenizer_ids_match") is not None
                         else f"{genai.get('tokenizer_files')} |")]
        if int8:
            lines += [f"| int8: max abs logit diff vs MindSpore | {_num(int8['max_abs_diff'])} |",
                      f"| int8: greedy tokens == MindSpore | {int8['greedy_tokens_match']} |",
                      f"| int8: perplexity vs fp32 | {_num(int8['perplexity'])} vs {_num(int8['fp32_perplexity'])} "
                      f"({int8['perplexity_change_pct']:+.2f}%) on {int8['perplexity_source']} |",
                      f"| int8: decode tokens/s vs fp32 (onnxruntime, this machine, at export) | "
                      f"{_num(int8['decode_tokens_per_s'])} vs {_num(int8['fp32_decode_tokens_per_s'])} |",
                      f"| int8: size | {int8['bytes'] / 1e6:.1f} MB vs {int8['fp32_bytes'] / 1e6:.1f} MB |"]
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

    if onnx:
        lines += ["## Generate with onnxruntime only", "",
                  "numpy, onnxruntime and sentencepiece; no MindSpore. The prompt is run once (prefill), then each "
                  "new token is one call that feeds the previous call's `present` back as `past`.",
                  "", "```python", f'ART = "{artifact_path}"', SNIPPET.rstrip(), "```", "",
                  "## Generate with onnxruntime-genai", "", "```python", f'ART = "{artifact_path}"',
                  GENAI_SNIPPET.rstrip(), "```", ""]
        if genai.get("text_prefix"):
            lines += ["This tokenizer adds SentencePiece's dummy prefix (a space before the text), which "
                      "onnxruntime-genai's tokenizer does not: encode `\" \" + text` to get the same ids.", ""]
    return "\n".join(lines)
