"""MODEL_CARD.md of an export artifact: what the model is, where it came from, how it scores, how it was checked.

card = model_card(info=..., parameters=..., model_ref=..., pipeline=..., verification=...,
                  lineage=..., evaluation=read_eval(eval_artifact) or None, artifact_path=...)
"""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path
from typing import Any


def read_eval(eval_art: Path) -> dict[str, Any]:
    """What an eval artifact reports, read defensively (missing or odd pieces are skipped)."""
    out: dict[str, Any] = {"ref": f"{eval_art.parent.name}/{eval_art.name}", "perplexity": {}, "tasks": []}
    try:
        res = json.loads((eval_art / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        out["error"] = f"results.json unreadable ({exc})"
        return out
    ppl = res.get("perplexity") if isinstance(res, dict) else None
    for name, row in ppl.items() if isinstance(ppl, dict) else []:
        if isinstance(row, dict):
            out["perplexity"][str(name)] = {k: row.get(k) for k in ("tokens", "perplexity", "bits_per_byte")}
    results = res.get("results") if isinstance(res, dict) else None
    for task, r in results.items() if isinstance(results, dict) else []:
        for metric, v in r.items() if isinstance(r, dict) else []:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and "_stderr" not in metric:
                err = r.get(metric.replace(",", "_stderr,", 1)) if "," in metric else None
                out["tasks"].append(
                    {
                        "task": str(task),
                        "metric": metric.split(",")[0],
                        "value": float(v),
                        "stderr": float(err) if isinstance(err, (int, float)) else None,
                    }
                )
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


def tokenizer_name(info: dict[str, Any]) -> str:
    """The model's tokenizer as the export's messages name it: its Hugging Face tokenizer.json, or its SentencePiece
    tokenizer.model (which the export turns into the tokenizer.json onnxruntime-genai reads)."""
    if info.get("tokenizer", {}).get("type") == "hf":
        return "the model's tokenizer.json (Hugging Face tokenizers)"
    return "the model's SentencePiece tokenizer.model"


def model_card(
    *,
    info: dict[str, Any],
    parameters: int,
    model_ref: dict[str, Any],
    pipeline: str,
    verification: dict[str, Any],
    lineage: dict[str, Any],
    evaluation: dict[str, Any] | None,
    artifact_path: Path,
) -> str:
    """MODEL_CARD.md: what the model is, where it came from, how it scores, how it was checked, how to run it."""
    v = verification
    lines = _model_section(info, parameters, model_ref, pipeline) + _files_section(info, v)
    lines += _verification_section(info, v)
    if evaluation is not None:
        lines += _evaluation_section(evaluation)
    lines += _lineage_section(lineage)
    if "onnx" in v.get("shapes", {}):
        lines += _generate_section(v, artifact_path)
    return "\n".join(lines)


def _model_section(info: dict[str, Any], parameters: int, model_ref: dict[str, Any], pipeline: str) -> list[str]:
    """The title and "## Model": size, sequence length, the architecture's fields, the tokenizer."""
    mc, tok = info.get("model", {}), info.get("tokenizer", {})
    lines = [
        f"# Model card: {info.get('name', 'llama')} from {model_ref['stage']}/{model_ref['key']}",
        "",
        f"Exported by the `export` stage of pipeline `{pipeline}` on "
        f"{_dt.datetime.now(_dt.UTC).strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        "## Model",
        "",
        "| | |",
        "|---|---|",
        f"| parameters | {parameters / 1e6:.2f}M ({parameters:,}) |",
        f"| trained sequence length | {_num(info.get('seq_length'))} |",
    ]
    lines += [f"| {k} | {_num(val)} |" for k, val in mc.items()]
    kind = "Hugging Face tokenizer.json" if tok.get("type") == "hf" else "SentencePiece"
    lines += [
        f"| tokenizer | {kind}, {_num(tok.get('vocab_size'))} tokens; bos {_num(tok.get('bos_id'))}, "
        f"eos {_num(tok.get('eos_id'))}, pad {_num(tok.get('pad_id'))}"
        f"{'; chat template' if tok.get('chat_template') else ''} |",
        "",
    ]
    return lines


def _files_section(info: dict[str, Any], v: dict[str, Any]) -> list[str]:
    """The "## Files" section: each file of the export and what it is for."""
    tok, shapes = info.get("tokenizer", {}), v.get("shapes", {})
    onnx, int8 = "onnx" in shapes, v.get("int8")
    lines = ["## Files", "", "| file | what it is for |", "|---|---|"]
    if "mindir" in shapes:
        lines.append(
            "| model.mindir | MindSpore's own format: `input_ids` int32 [batch, seq] (dynamic) → logits float32 "
            "[batch, seq, vocab], a full forward; `mindspore.load` + `nn.GraphCell` |"
        )
    if onnx:
        lines += [
            f"| model.onnx | ONNX decoder with a KV cache (opset {v.get('onnx_opset')}): `input_ids`, "
            "`attention_mask`, `position_ids`, `past_key_values.{i}.key/value` → `logits`, "
            "`present.{i}.key/value`; batch, sequence and past dynamic. onnxruntime, onnxruntime-genai |"
        ]
        if int8:
            lines.append(
                f"| model.int8.onnx | the same decoder with int8 weights (dynamic quantization): "
                f"{int8['size_ratio']:.2f}× the size |"
            )
        lines.append("| genai_config.json | onnxruntime-genai's description of model.onnx (decoder type llama) |")
        if tok.get("type") != "hf":
            lines.append(
                "| tokenizer.json, tokenizer_config.json | tokenizer.model as a Hugging Face BPE tokenizer, "
                "for onnxruntime-genai (which does not read SentencePiece models) |"
            )
    for t, e in ((v.get("gguf") or {}).get("files") or {}).items():
        lines.append(
            f"| {e['file']} | GGUF ({t}) for {v['gguf']['runtimes']}: weights, llama.* metadata, tokenizer "
            f"and chat template in one file; read back and checked (max \u0394logit {e['max_abs_diff']:.3g}"
            f" vs fp32) |"
        )
    lines += (
        [
            "| tokenizer.json, tokenizer_config.json | the model's own Hugging Face tokenizer (MindSpore, "
            "onnxruntime-genai, transformers) |"
        ]
        if tok.get("type") == "hf"
        else ["| tokenizer.model | the SentencePiece model |"]
    )
    lines += [
        "| model.json | architecture and tokenizer ids |",
        "| export.json | names, shapes, prompt format, verification |",
    ]
    if onnx:
        lines.append(
            '| onnx_generate.py | KV-cache generation with onnxruntime only: `python onnx_generate.py . "ROMEO:"` |'
        )
    lines.append("")
    return lines


def _verification_section(info: dict[str, Any], v: dict[str, Any]) -> list[str]:
    """The "## Verification" section: each check against the MindSpore network, and the greedy completions."""
    shapes = v.get("shapes", {})
    lines = [
        "## Verification",
        "",
        f"Against the MindSpore network on {len(v['prompts'])} fixed prompts "
        f"({', '.join(repr(p) for p in v['prompts'])}), encoded as {v['prompt_format']}.",
        "",
        "| check | result |",
        "|---|---|",
    ]
    if "mindir" in shapes:
        lines.append(
            f"| MindIR max abs logit diff | {_num(v['mindir_max_abs_diff'])} at shapes "
            f"{', '.join(str(list(s)) for s in shapes['mindir']['checked'])} |"
        )
    if "onnx" in shapes:
        lines += _onnx_checks(info, v)
    lines += [f"| tolerance (export.atol) | {v['atol']:g} |", ""]
    if v.get("greedy"):
        lines += ["| prompt | greedy completion (onnxruntime) |", "|---|---|"]
        lines += [f"| {_cell(g['prompt'])} | {_cell(g['completion'])} |" for g in v["greedy"]]
        lines.append("")
    return lines


def _onnx_checks(info: dict[str, Any], v: dict[str, Any]) -> list[str]:
    """The verification rows of the ONNX decoder: onnxruntime, onnxruntime-genai and int8 against MindSpore."""
    genai, int8 = v.get("genai") or {}, v.get("int8")
    lines = [
        f"| onnxruntime: {c['check']} (batch {c['batch']}, sequence {c['sequence']}, past {c['past']}) | "
        f"max abs logit diff {_num(c['max_abs_diff'])} |"
        for c in v.get("onnx_checks", [])
    ]
    n_ok = sum(g["mindspore"] == g["onnxruntime"] for g in v.get("greedy", []))
    lines += [
        f"| onnx.checker (full check) | {v.get('onnx_checker')} |",
        f"| greedy tokens, onnxruntime (KV cache) == MindSpore | {n_ok}/{len(v.get('greedy', []))} prompts, "
        f"up to {v['max_new_tokens']} new tokens |",
    ]
    if genai:
        n_ok = sum(g["mindspore"] == g.get("onnxruntime_genai") for g in v.get("greedy", []))
        lines += [
            f"| greedy tokens, onnxruntime-genai {genai.get('version')} == MindSpore | "
            f"{n_ok}/{len(v.get('greedy', []))} prompts |",
            f"| onnxruntime-genai's tokenizer ids == {tokenizer_name(info)} | "
            + (
                f"{genai['tokenizer_ids_match']} on {genai['tokenizer_texts']} texts, "
                f"{genai['tokenizer_tokens']} tokens |"
                if genai.get("tokenizer_ids_match") is not None
                else f"{genai.get('tokenizer_files')} |"
            ),
        ]
    if int8:
        lines += [
            f"| int8: max abs logit diff vs MindSpore | {_num(int8['max_abs_diff'])} |",
            f"| int8: greedy tokens == MindSpore | {int8['greedy_tokens_match']} |",
            f"| int8: perplexity vs fp32 | {_num(int8['perplexity'])} vs {_num(int8['fp32_perplexity'])} "
            f"({int8['perplexity_change_pct']:+.2f}%) on {int8['perplexity_source']} |",
            f"| int8: decode tokens/s vs fp32 (onnxruntime, this machine, at export) | "
            f"{_num(int8['decode_tokens_per_s'])} vs {_num(int8['fp32_decode_tokens_per_s'])} |",
            f"| int8: size | {int8['bytes'] / 1e6:.1f} MB vs {int8['fp32_bytes'] / 1e6:.1f} MB |",
        ]
    return lines


def _evaluation_section(evaluation: dict[str, Any]) -> list[str]:
    """The "## Evaluation" section: the eval artifact's perplexities and task scores (`read_eval`)."""
    lines = ["## Evaluation", "", f"From `{evaluation['ref']}`.", ""]
    if evaluation.get("error"):
        lines += [evaluation["error"], ""]
    if evaluation.get("perplexity"):
        lines += ["| set | tokens | perplexity | bits/byte |", "|---|---:|---:|---:|"]
        lines += [
            f"| {n} | {_num(r['tokens'])} | {_num(r['perplexity'])} | {_num(r['bits_per_byte'])} |"
            for n, r in evaluation["perplexity"].items()
        ]
        lines.append("")
    if evaluation.get("tasks"):
        lines += ["| task | metric | value | ± |", "|---|---|---:|---:|"]
        lines += [
            f"| {r['task']} | {r['metric']} | {_num(r['value'])} | {_num(r['stderr'])} |" for r in evaluation["tasks"]
        ]
        lines.append("")
    if not evaluation.get("perplexity") and not evaluation.get("tasks") and not evaluation.get("error"):
        lines += ["(no perplexity or task results in this eval artifact)", ""]
    return lines


def _lineage_section(lineage: dict[str, Any]) -> list[str]:
    """The "## Lineage" section: the chain of artifacts, and the raw inputs with their sha256."""
    lines = ["## Lineage", "", "```text", lineage["text"], "```", ""]
    if lineage.get("raw"):
        lines += ["| raw input | bytes | sha256 |", "|---|---:|---|"]
        lines += [f"| {r.get('path')} | {_num(r.get('size'))} | `{r.get('sha256')}` |" for r in lineage["raw"]]
        lines.append("")
    return lines


def _generate_section(v: dict[str, Any], artifact_path: Path) -> list[str]:
    """How to generate from the ONNX decoder: onnxruntime alone, and onnxruntime-genai."""
    from tasks.deploy.onnx_generate import GENAI_SNIPPET, SNIPPET  # lazy: onnxruntime; the export stage imports this

    genai = v.get("genai") or {}
    lines = [
        "## Generate with onnxruntime only",
        "",
        "numpy, onnxruntime and sentencepiece; no MindSpore. The prompt is run once (prefill), then each "
        "new token is one call that feeds the previous call's `present` back as `past`.",
        "",
        "```python",
        f'ART = "{artifact_path}"',
        SNIPPET.rstrip(),
        "```",
        "",
        "## Generate with onnxruntime-genai",
        "",
        "```python",
        f'ART = "{artifact_path}"',
        GENAI_SNIPPET.rstrip(),
        "```",
        "",
    ]
    if genai.get("text_prefix"):
        lines += [
            "This tokenizer adds SentencePiece's dummy prefix (a space before the text), which "
            'onnxruntime-genai\'s tokenizer does not: encode `" " + text` to get the same ids.',
            "",
        ]
    return lines
