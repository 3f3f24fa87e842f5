"""Loaders and prompt helpers of the local lm-eval tasks (the YAMLs beside this file).

The benchmark files ship unmodified in `../benchmarks/` (tasks/stages/evaluate/benchmarks/, package data
of the wheel; see its SOURCES.md). Every
local task YAML names `custom_dataset: !function utils.load` with
`dataset_kwargs: {benchmark: NAME, split: SPLIT}`; `load` reads the files, turns them
into the records the harness's own task of that name reads (ARC's `question` /
`choices.text` / `answerKey`, BoolQ's `passage` / `question` / `label`, PIQA's `label`
from the separate labels file, TruthfulQA's `{choices, labels}` targets), and returns
a `datasets.DatasetDict` with that one split. The prompts in the YAMLs are then the
harness's own templates, character for character. WinoGrande keeps MosaicML's form
(the two sentence starts as choices, the shared ending as target), which is what the
harness's `preprocess_winogrande` builds from the original records.

Paths resolve from this file (`../benchmarks`, in a clone and in an installed wheel alike);
`MSLLM_BENCHMARKS` or a `data_dir` metadata key points elsewhere. Nothing is resolved at import: a
copy of this file elsewhere (a user's own task folder) imports fine and needs only MSLLM_BENCHMARKS
or data_dir. The harness imports this file by path (not as `tasks.stages.evaluate.lm_tasks.utils`): keep it free of
project imports."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import datasets
import numpy as np


def shipped_benchmarks() -> Path | None:
    """`tasks/stages/evaluate/benchmarks` beside this file's folder (a clone or an installed wheel), else None."""
    d = Path(__file__).resolve().parent.parent / "benchmarks"
    return d if (d / "SOURCES.md").is_file() else None


def benchmarks_dir(data_dir: str | os.PathLike | None = None) -> Path:
    found = data_dir or os.environ.get("MSLLM_BENCHMARKS") or shipped_benchmarks()
    if found is None:
        raise FileNotFoundError(
            f"{Path(__file__).parent}: no benchmarks directory beside these task files; set "
            f"MSLLM_BENCHMARKS to msllm's tasks/stages/evaluate/benchmarks (or a data_dir metadata key)"
        )
    return Path(found)


def _jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def read_arc(root: Path, name: str) -> list[dict[str, Any]]:
    rows = []
    for r in _jsonl(root / name / f"{name}.jsonl"):
        labels = [chr(ord("A") + i) for i in range(len(r["choices"]))]
        rows.append(
            {
                "question": r["query"].removeprefix("Question: "),
                "choices": {"text": r["choices"], "label": labels},
                "answerKey": labels[r["gold"]],
            }
        )
    return rows


def read_boolq(root: Path) -> list[dict[str, Any]]:
    rows = []
    for r in _jsonl(root / "boolq" / "boolq.jsonl"):
        passage, sep, question = r["query"].removeprefix("Passage: ").rpartition("\nQuestion: ")
        if not sep or not question.endswith("?") or r["choices"] != ["no", "yes"]:
            raise ValueError(f"boolq.jsonl: unexpected record format: {r['query'][:80]!r}")
        rows.append({"passage": passage, "question": question[:-1], "label": r["gold"]})
    return rows


def read_piqa(root: Path) -> list[dict[str, Any]]:
    docs = _jsonl(root / "piqa" / "valid.jsonl")
    labels = (root / "piqa" / "valid-labels.lst").read_text().split()
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} records but {len(labels)} labels")
    return [{"goal": d["goal"], "sol1": d["sol1"], "sol2": d["sol2"], "label": int(y)} for d, y in zip(docs, labels)]


def read_truthfulqa(root: Path) -> list[dict[str, Any]]:
    data = json.loads((root / "truthfulqa_mc" / "mc_task.json").read_text(encoding="utf-8"))

    def targets(d: dict[str, int]) -> dict[str, list]:
        return {"choices": list(d), "labels": [int(v) for v in d.values()]}  # dict order: true answers first

    return [
        {"question": r["question"], "mc1_targets": targets(r["mc1_targets"]), "mc2_targets": targets(r["mc2_targets"])}
        for r in data
    ]


READERS: dict[str, Callable[[Path], list[dict[str, Any]]]] = {
    "arc_easy": lambda root: read_arc(root, "arc_easy"),
    "arc_challenge": lambda root: read_arc(root, "arc_challenge"),
    "boolq": read_boolq,
    "piqa": read_piqa,
    "winogrande": lambda root: _jsonl(root / "winogrande" / "winogrande.jsonl"),
    "lambada_openai": lambda root: _jsonl(root / "lambada_openai" / "lambada_test.jsonl"),
    "truthfulqa_mc": read_truthfulqa,
}


def load(benchmark: str, split: str, data_dir: str | None = None, **_metadata: Any):
    """`custom_dataset` of every local task: {split: the benchmark's records} as a DatasetDict."""
    if benchmark not in READERS:
        raise ValueError(f"unknown local benchmark {benchmark!r}; known: {sorted(READERS)}")
    root = benchmarks_dir(data_dir)
    if not root.is_dir():
        raise FileNotFoundError(
            f"{root}: benchmark files not found (set MSLLM_BENCHMARKS to msllm's tasks/stages/evaluate/benchmarks)"
        )
    return datasets.DatasetDict({split: datasets.Dataset.from_list(READERS[benchmark](root))})


# ----------------------------------------------------------------------------- WinoGrande (partial scoring)
# The choices are the two sentence starts and the target is the shared ending, as in the harness's
# preprocess_winogrande: doc_to_text returns the index of the right start.


def winogrande_doc_to_text(doc: dict[str, Any]) -> int:
    return int(doc["gold"])


def winogrande_doc_to_choice(doc: dict[str, Any]) -> list[str]:
    return list(doc["context_options"])


def winogrande_doc_to_target(doc: dict[str, Any]) -> str:
    return doc["continuation"].strip()


# ----------------------------------------------------------------------------- TruthfulQA MC2


def process_results_mc2(doc: dict[str, Any], results: list[tuple[float, bool]]) -> dict[str, float]:
    """Normalised probability mass on the true answers (the harness's truthfulqa utils, without its imports)."""
    ll = np.array([r[0] for r in results], dtype=np.float64)
    probs = np.exp(ll - ll.max())  # shift: same ratio, no underflow to 0/0 for a poorly trained model
    probs_norm = probs / probs.sum()
    labels = np.array(doc["mc2_targets"]["labels"])
    return {"acc": float(probs_norm[labels == 1].sum())}
