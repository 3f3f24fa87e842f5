"""`continued-pretraining`: scan an inbox for new domain corpora and continue pretraining on them.

Each corpus file is consumed once: a file whose sha256 already appears among the raw
inputs (via lineage) of any pretrain artifact of the pipeline is skipped. New files go
through data (with the base model's tokenizer) → continued pretraining from the newest
pretrain artifact (→ eval when the pipeline lists eval tasks), and the lineage is published.
Scheduled by `scripts/serve.py` as `continued-pretraining/scheduled` (cron).
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows import stages
from tasks.store.artifacts import ArtifactStore, sha256_file
from tasks.config import resolve_pipeline
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


@flow(name="continued-pretraining", log_prints=True)
def continued_pretraining(pipeline: str = "demo", config: str = "pipelines.yaml", overrides: list[str] | None = None,
                          artifacts: str = "artifacts", inbox: str | None = None, base_model: str | None = None) -> dict[str, str]:
    config = str(Path(config).resolve())
    artifacts = str(Path(artifacts).resolve())
    overrides = list(overrides or [])
    cfg = resolve_pipeline(config, pipeline, overrides)
    inbox_dir = Path(inbox) if inbox else (cfg.resolve_path(cfg.continued.inbox) if cfg.continued.inbox else None)
    if inbox_dir is None or not inbox_dir.is_dir():
        raise ValueError(f"continued-pretraining: inbox {inbox_dir} is not a directory; set pipelines.{pipeline}.continued.inbox "
                         "or pass inbox=")
    store = ArtifactStore(artifacts)
    fresh = new_corpora(inbox_dir, consumed_sha256(store, pipeline))
    if not fresh:
        print(f"no new corpora in {inbox_dir}; nothing to do")
        return {}
    base = base_model or (str(store.newest("pretrain", pipeline)) if store.newest("pretrain", pipeline) else None)
    if base is None:
        raise ValueError(f"no pretrain artifact for pipeline '{pipeline}' to continue from; run full-pipeline first or pass base_model=")
    srcs = [str(p) for p in fresh]
    print(f"continuing {base} on {len(srcs)} new corpus file(s): {', '.join(Path(s).name for s in srcs)}")
    common = dict(config=config, pipeline=pipeline, overrides=overrides, artifacts=artifacts)
    out = {"data": stages.run_stage(stages.data_task, **common, tokenizer_model=str(base), continued_sources=srcs)}
    out["pretrain"] = stages.run_stage(stages.pretrain_task, **common, data_artifact=out["data"], init_from=base, continued_sources=srcs)
    print(stages.publish_lineage(store, out["pretrain"]))
    return out
