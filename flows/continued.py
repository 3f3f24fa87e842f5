"""`continued-pretraining`: scan an inbox for new domain corpora, continue pretraining on them, and carry
the pipeline on to its end in the same flow run.

Each corpus file is consumed once: a file whose sha256 already appears among the raw
inputs (via lineage) of any pretrain artifact of the pipeline is skipped. New files go
through data (with the base model's tokenizer) → continued pretraining from the base of the
pipeline's chain (its newest pretrain artifact; `base_model=` overrides) → finetune (when the
pipeline finetunes) → eval → export, as full-pipeline does after its continued stage, and the
lineage is published. Doing eval and export here (not leaving them to a later eval-only) is
what keeps the eval report, the export `msllm serve` runs and the model eval-only chooses the
same model (the rule in tasks/stages/upstream.py).

The inbox: `inbox=`, else `continued.inbox` of the pipeline, else `<artifacts>/inbox/<pipeline>/`
(created; drop corpus files there). Nothing new, or no model to continue from, ends the run
Completed with one line saying so (a schedule firing on an empty inbox is not a failure).

Deployments: `continued-pretraining/scheduled-<pipeline>`, one per pipeline whose
`continued.schedule` sets a cron (scripts/serve.py, prefect.yaml). Parameters: pipeline,
config, artifacts, overrides, inbox, base_model.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows import stages
from tasks.config.loader import resolve_pipeline
from tasks.stages.runner import prepare
from tasks.stages.upstream import ModelChoice, chain_base
from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import sha256_file
from tasks.store.lineage import lineage_tree, raw_inputs

CORPUS_SUFFIXES = (".txt", ".jsonl", ".json", ".jsonl.gz", ".parquet")


def consumed_sha256(store: ArtifactStore, pipeline: str) -> set[str]:
    seen: set[str] = set()
    for path, _ in store.list("pretrain", pipeline):
        seen |= {r["sha256"] for r in raw_inputs(lineage_tree(store, path))}
    return seen


def new_corpora(inbox: Path, consumed: set[str]) -> list[Path]:
    files = sorted(p for p in inbox.rglob("*") if p.is_file() and p.name.endswith(CORPUS_SUFFIXES))
    return [p for p in files if sha256_file(p) not in consumed]


def inbox_of(cfg, pipeline: str, artifacts: str, inbox: str | None) -> Path:
    """`inbox`, else continued.inbox (relative to the pipelines file), else <artifacts>/inbox/<pipeline>/ (created)."""
    if inbox:
        return Path(inbox).resolve()
    if cfg.continued.inbox:
        return cfg.resolve_path(cfg.continued.inbox)
    d = Path(artifacts) / "inbox" / pipeline
    d.mkdir(parents=True, exist_ok=True)
    return d


@flow(name="continued-pretraining", log_prints=True, result_serializer="json")
@stages.cancellable
def continued_pretraining(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    inbox: str | None = None,
    base_model: str | None = None,
) -> dict[str, str]:
    """Continue pretraining on the inbox's new corpora, then finetune, eval and export; returns {stage: artifact path}
    (empty when there was nothing to do)."""
    artifacts = str(Path(artifacts).resolve())
    cfg = resolve_pipeline(str(Path(config).resolve()), pipeline, list(overrides or []))  # once per flow run
    inbox_dir = inbox_of(cfg, pipeline, artifacts, inbox)
    if not inbox_dir.is_dir():
        print(
            f"inbox {inbox_dir} is not a directory; nothing to do (create it, or set "
            f"pipelines.{pipeline}.continued.inbox"
            " or the deployment's inbox parameter)"
        )
        return {}
    store = ArtifactStore(artifacts)
    fresh = new_corpora(inbox_dir, consumed_sha256(store, pipeline))
    if not fresh:
        print(f"no new corpora in {inbox_dir}; nothing to do")
        return {}
    base = base_model or (str(b) if (b := chain_base(store, pipeline)) else None)
    if base is None:
        print(
            f"no pretrain artifact of pipeline '{pipeline}' to continue from; nothing done: run full-pipeline "
            f"(or `msllm train --pipeline {pipeline}`) first, or pass base_model="
        )
        return {}
    srcs = [str(p) for p in fresh]
    print(f"continuing {base} on {len(srcs)} new corpus file(s): {', '.join(Path(s).name for s in srcs)}")
    ccfg = cfg.for_continued(srcs)  # the continued section's data and training settings
    out = {"data": stages.run_stage(stages.data_task, prepare("data", store, ccfg, tokenizer_model=base))}
    out["pretrain"] = stages.run_stage(
        stages.pretrain_task, prepare("pretrain", store, ccfg, data_artifact=out["data"], init_from=base)
    )
    model, why = out["pretrain"], "the model this continued-pretraining run built (no finetune in this pipeline)"
    if cfg.finetune.sources:
        ft = stages.run_stage(stages.finetune_task, prepare("finetune", store, cfg, base_artifact=out["pretrain"]))
        out["finetune"], out["merged"] = ft["finetune"], ft["merged"]
        model, why = ft["merged"], "the finetune (merged) of the model this continued-pretraining run built"
    out["eval"] = stages.run_eval(store, cfg, ModelChoice.of(store, model, "this-run", why), out["data"])
    out["export"] = stages.run_stage(stages.export_task, prepare("export", store, cfg, model_artifact=model))
    print(stages.publish_lineage(store, out["export"]))
    return out
