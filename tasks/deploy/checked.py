"""The export stage's formats, each written and checked against the reference network: MindIR at several
shapes, the ONNX decoder with its KV cache (onnxruntime, its int8 form, onnxruntime-genai), GGUF read back by
llama.cpp's own reader. Each returns its failures as lines; the export stage (tasks/stages/export.py) publishes none."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig
from tasks.deploy.checks import (
    CHUNK,
    STEPS,
    Reference,
    divergence,
    greedy_pairs,
    int8_report,
    onnx_checks,
    token_batches,
    verify_genai,
    verify_mindir,
)
from tasks.deploy.formats import INT8_OPTIONS, export_int8, export_mindir, export_onnx, int8_method, write_genai_files
from tasks.deploy.model_card import tokenizer_name
from tasks.store.artifacts import ArtifactStore
from tasks.store.data_schema import DataError
from tasks.store.errors import ArtifactError
from tasks.store.lineage import lineage_data_artifact
from tasks.store.reader import block_batches

PROMPT_FORMAT = (
    "[eos_id] + sentencepiece ids for a SentencePiece model (EOS starts a document, as in pretraining "
    "and eval); the tokenizer's own encoding (tokenizer.json with its special tokens) otherwise"
)
HELDOUT_BLOCKS = 8  # held-out blocks of the int8 perplexity comparison
GENAI_FILES = ("genai_config.json", "tokenizer.json", "tokenizer_config.json")
# fixed lines for the tokenizer check: contractions, punctuation, digits, newlines, non-ASCII
TOKENIZER_SAMPLES = [
    "'That I can't, 'tis so; they'll've done it.",
    "KING HENRY VI:\nWhat, 12 or 345 men?",
    "Ay, me!  Two  spaces,\ttabs\tand\n\nblank lines.",
    "naïve café — “quotes” ✓ 日本語",
]


def log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[export] {msg}", file=sys.stderr, flush=True)


def mindir_checked(
    out: Path, model: Path, reference, prompts: list[list[int]], ex, ver: dict[str, Any], progress: bool
) -> list[str]:
    """model.mindir (dynamic [batch, seq]) checked against the reference network at the export shape, each prompt
    at its own length, and all prompts in one batch: dynamic both ways. The failures, as lines."""
    from tasks.modeling.build import load_network

    log(progress, f"MindIR (dynamic [batch, seq]) → {out.name}/model.mindir")
    export_mindir(load_network(model)[0], out / "model.mindir")  # a fresh Cell per export
    checks = (
        token_batches(prompts, ex.batch_size, ex.seq_length)
        + [token_batches([p], 1, len(p))[0] for p in prompts]
        + token_batches(prompts, len(prompts), max(map(len, prompts)))
    )
    diff = verify_mindir(out / "model.mindir", reference, checks)
    ver["mindir_max_abs_diff"] = diff
    ver["shapes"]["mindir"] = {"exported": [None, None], "checked": sorted({x.shape for x in checks})}
    log(progress, f"MindIR max |Δlogit| {diff:.3g} at shapes {ver['shapes']['mindir']['checked']}")
    if not diff <= ex.atol:
        return [f"MindIR max |logit diff| {diff:.3g} > export.atol {ex.atol:g}"]
    return []


def onnx_checked(
    out: Path,
    info: dict[str, Any],
    weights: dict[str, np.ndarray],
    model: Path,
    store: ArtifactStore,
    sp,
    prompts: list[list[int]],
    reference: Reference,
    ex,
    ver: dict[str, Any],
    progress: bool,
) -> list[str]:
    """Write and verify model.onnx (+ the genai files, + model.int8.onnx); fill `ver`; return the failures."""
    from tasks.deploy.onnx_generate import OnnxGenerator  # lazy: onnxruntime

    failures: list[str] = []
    meta = {"eos_id": str(sp.eos_id()), "prompt_format": PROMPT_FORMAT}
    log(progress, f"ONNX decoder (KV cache, dynamic batch/sequence/past) → {out.name}/model.onnx")
    ver.update(export_onnx(info, weights, out / "model.onnx", meta))
    ver["onnx_checker"] = "passed"  # export_onnx raises otherwise
    gen = OnnxGenerator(out / "model.onnx", max_len=ex.seq_length)
    room = ex.seq_length - CHUNK - STEPS  # each checked row (prompt + chunk + steps) fits the window
    ver["onnx_checks"] = onnx_checks(gen, reference, [p[-room:] for p in prompts], info["model"]["vocab_size"])
    ver["onnx_kv_steps"] = STEPS
    diff = max(c["max_abs_diff"] for c in ver["onnx_checks"])
    ver["onnx_max_abs_diff"] = diff
    ver["shapes"]["onnx"] = {
        "exported": ["batch_size", "sequence_length", "past_sequence_length"],
        "checked": [[c["batch"], c["sequence"], c["past"]] for c in ver["onnx_checks"]],
    }
    log(
        progress,
        f"onnxruntime max |Δlogit| {diff:.3g} over {len(ver['onnx_checks'])} (batch, sequence, past) "
        f"checks incl. {STEPS} single-token steps",
    )
    if not diff <= ex.atol:
        worst = max(ver["onnx_checks"], key=lambda c: c["max_abs_diff"])
        failures.append(f"ONNX max |logit diff| {diff:.3g} > export.atol {ex.atol:g} (worst: {worst['check']})")
    ver["greedy"] = greedy_pairs(
        gen, reference.net, sp, list(zip(ex.prompts, prompts)), ex.max_new_tokens, ex.seq_length
    )
    ver["greedy_tokens_match"] = all(g["mindspore"] == g["onnxruntime"] for g in ver["greedy"])
    failures += [divergence(g, "onnxruntime") for g in ver["greedy"] if g["mindspore"] != g["onnxruntime"]]
    log(
        progress,
        f"greedy tokens onnxruntime (KV cache) == MindSpore: {ver['greedy_tokens_match']} "
        f"({len(prompts)} prompts, up to {ex.max_new_tokens} tokens)",
    )

    data = _heldout_data(store, model)
    heldout = _heldout_rows(data) if data is not None else None
    no_tokenizer = write_genai_files(out, info, model)
    if no_tokenizer:
        log(progress, f"onnxruntime-genai: no tokenizer files ({no_tokenizer}); genai generates from token ids")
    texts = [*ex.prompts, *TOKENIZER_SAMPLES, *(_decode_rows(sp, heldout[0]) if heldout else [])]
    ver["genai"] = verify_genai(out, sp, texts, ver["greedy"], ex.max_new_tokens, ex.seq_length)
    g = ver["genai"]
    g["tokenizer_files"] = "not written: " + no_tokenizer if no_tokenizer else "tokenizer.json, tokenizer_config.json"
    name = tokenizer_name(info)
    log(
        progress,
        f"onnxruntime-genai: greedy tokens == MindSpore: {g['greedy_tokens_match']}; tokenizer ids == "
        f"{name} on {g['tokenizer_texts']} texts ({g['tokenizer_tokens']} tokens): "
        f"{g['tokenizer_ids_match']}",
    )
    failures += [divergence(x, "onnxruntime_genai") for x in ver["greedy"] if x["mindspore"] != x["onnxruntime_genai"]]
    if g["tokenizer_ids_match"] is False:
        first = g["tokenizer_first_mismatch"]
        log(
            progress,
            f"warning: onnxruntime-genai's tokenizer differs from {name} on {first['text']!r}: ids "
            f"{first['model']} there, {first['genai']} in genai (its greedy tokens from ids are unaffected)",
        )

    if ex.int8:
        log(progress, f"int8 (dynamic quantization) → {out.name}/model.int8.onnx")
        export_int8(out / "model.onnx", out / "model.int8.onnx")
        ver["int8"] = {
            "method": int8_method(),
            "quantization": INT8_OPTIONS,
            **int8_report(out, gen, reference, prompts, ver["greedy"], heldout, data, ex),
        }
        q = ver["int8"]
        log(
            progress,
            f"int8: {q['bytes'] / 1e6:.1f} MB ({q['size_ratio']:.2f}× fp32), decode "
            f"{q['decode_tokens_per_s']} vs fp32 {q['fp32_decode_tokens_per_s']} tokens/s, perplexity "
            f"{q['perplexity']:.4g} vs fp32 {q['fp32_perplexity']:.4g} "
            f"({q['perplexity_change_pct']:+.2f}%, {q['perplexity_source']})",
        )
    return failures


def gguf_checked(
    out: Path,
    info: dict[str, Any],
    weights: dict[str, np.ndarray],
    tok,
    prompts: list[list[int]],
    ex,
    ver: dict[str, Any],
    progress: bool,
) -> list[str]:
    """Write and verify the GGUF files (tasks/deploy/gguf_export.py); fill ver["gguf"]; return the failures."""
    from tasks.deploy.gguf_export import export_gguf, network_forward  # lazy: gguf and MindSpore
    from tasks.modeling.build import build_network

    log(progress, f"GGUF {', '.join(ex.gguf_types)} → {out.name}/model.*.gguf (llama.cpp-family runtimes)")
    net = build_network(info.get("name", "llama"), ModelConfig.from_dict(info["model"])).net
    net.set_train(False)
    rep = export_gguf(
        out, info, weights, tok, list(ex.gguf_types), network_forward(net), prompts, [*ex.prompts, *TOKENIZER_SAMPLES]
    )
    ver["gguf"] = rep
    for t, e in rep["files"].items():
        log(
            progress,
            f"GGUF {t}: {e['bytes'] / 1e6:.1f} MB, max |Δlogit| {e['max_abs_diff']:.3g} (bound "
            f"{e['bound']:.3g}), tokenizer read back == model's: {e['tokenizer_ids_match']}",
        )
    return rep["failures"]


def _heldout_data(store: ArtifactStore, model: Path) -> Path | None:

    try:
        return lineage_data_artifact(store, model)
    except (ArtifactError, OSError, ValueError, KeyError):
        return None


def _heldout_rows(data: Path) -> tuple[np.ndarray, np.ndarray] | None:
    """(input_ids [B, T], labels [B, T], -100 = not counted) of the first HELDOUT_BLOCKS valid blocks, or None."""

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
