"""Merging a finetune artifact into its base: a model artifact (stage `merged`) that eval, export and serve load.

    merged = merge(store, finetune_artifact)      # cached by content, like every stage
    base = base_of(store, finetune_artifact)      # the model artifact adapter.json names, digest checked

The finetune stage writes the adapter (adapter.safetensors + adapter.json); the finetune command, the export
stage (given a finetune artifact), the flows and the server's `--adapter` all merge through this one function,
so it lives below them. Its code version is the stage table's `code_version("merged")` (the table names this
module), computed by `tasks.store.codeversion.stage_code_version`.
"""

from __future__ import annotations

import json
from pathlib import Path

from model.config import ModelConfig
from tasks.store.artifacts import ArtifactStore
from tasks.store.codeversion import stage_code_version
from tasks.store.errors import ArtifactError
from tasks.store.model_artifact import read_info, write_model
from tasks.store.published import verify_published
from tasks.store.tensors import load_weights, read_tensors

MERGED = "merged"


def code_version() -> str:
    """The merged stage's code version (the stage table's entry names this module)."""
    return stage_code_version(MERGED, __name__)


def base_of(store: ArtifactStore, finetune_artifact: Path) -> Path:
    """The base artifact a finetune artifact names, checked against the digest it recorded."""
    ref = json.loads((Path(finetune_artifact) / "adapter.json").read_text())["base"]
    candidates = [store.root / ref["stage"] / ref["key"], Path(ref["path"])]  # the root may have moved
    for c in candidates:
        try:
            c = store.inside(c)  # a recorded path is data, not trust: never followed outside the root
        except ArtifactError:
            continue
        if c.is_dir() and store.is_complete(c):
            if store.read_manifest(c)["digest"] != ref["digest"]:
                raise ArtifactError(
                    f"{c}: the base of {finetune_artifact} has changed (digest differs from "
                    f"adapter.json); rerun the finetune stage on it"
                )
            return store.inside(c)
    raise ArtifactError(
        f"base artifact {ref['stage']}/{ref['key']} of {finetune_artifact} is gone "
        f"(looked in {candidates[0]} and {ref['path']}); rebuild it, then rerun merge"
    )


def merge(store: ArtifactStore, finetune_artifact: Path) -> Path:
    """A model artifact (stage `merged`) with the adapter folded into the base weights; cached by content.

    LoRA: W + (alpha / rank) · B A per adapted module (`model.lora.merge_adapter`); full
    fine-tuning: the trained weights. Tokenizer and model.json come from the base, so
    `tasks.modeling.build.load_network` loads it like any pretrain artifact.
    """
    ft = store.inside(finetune_artifact)
    m = store.read_manifest(ft)
    if m["stage"] != "finetune":
        raise ArtifactError(f"{ft}: a {m['stage']} artifact; merge takes a finetune artifact")
    adapter_cfg = json.loads(verify_published(ft / "adapter.json").read_text())
    base = base_of(store, ft)
    inputs = [store.input_ref(ft), store.input_ref(base)]
    key = store.key(MERGED, {}, inputs, code_version())
    hit = store.lookup(MERGED, key)
    if hit is not None:
        return hit
    with store.claim(MERGED, key) as hit:  # one merge per key: an identical run waits, then uses what it published
        if hit is not None:
            return hit
        return _merge(store, key, m, adapter_cfg, ft, base, inputs)


def _merge(store: ArtifactStore, key: str, m: dict, adapter_cfg: dict, ft: Path, base: Path, inputs: list) -> Path:
    """Fold the adapter of `ft` into `base` and publish the merged artifact `key` (under its build lock: `merge`)."""
    info = read_info(base)
    base_w = load_weights(base)
    trained = read_tensors(verify_published(ft / "adapter.safetensors"), f"rerun the finetune stage ({ft} is damaged)")
    if adapter_cfg["method"] == "lora":
        from model.lora import merge_adapter  # lazy: MindSpore; the CLI and the stage table import this module

        weights = merge_adapter(base_w, trained, adapter_cfg["scaling"])
    else:
        if set(trained) != set(base_w) or any(trained[k].shape != base_w[k].shape for k in base_w):
            raise ArtifactError(f"{ft}: its weights do not match the base model's names and shapes")
        weights = trained
    with store.build(
        MERGED,
        key,
        pipeline=m.get("pipeline"),
        config={"finetune": m["key"], "method": adapter_cfg["method"]},
        inputs=inputs,
        code=code_version(),
    ) as b:
        write_model(
            b.dir,
            name=info.get("name", "llama"),
            config=ModelConfig.from_dict(info["model"]),
            weights=weights,
            tokenizer_model=base,
            tokenizer_info=info["tokenizer"],
            seq_length=info.get("seq_length"),
            extra={"merged_from": {"finetune": m["key"], "base": adapter_cfg["base"]["key"]}},
        )
        b.metrics.update(
            method=adapter_cfg["method"],
            merged_modules=len(adapter_cfg.get("modules", [])),
            finetune_val_loss=m["metrics"].get("val_loss"),
        )
    return b.path
