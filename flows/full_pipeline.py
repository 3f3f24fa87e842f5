"""The `full-pipeline` flow: (convert →) data → pretrain (→ continued pretraining) → finetune → eval → export.

    python -m flows.full_pipeline --pipeline demo [--set key=VALUE ...] [--artifacts DIR]

runs it locally on Prefect's embedded server (or the server PREFECT_API_URL names).
Every stage is a cached task (see flows/stages.py): an unchanged rerun finishes in
seconds, editing one section reruns that stage and what depends on it. The flow
validates the pipeline before any compute and ends by publishing the lineage of its
final artifact (a Prefect markdown artifact) and printing it.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from prefect import flow

from flows import stages
from tasks.config.loader import resolve_pipeline
from tasks.config.schema import ConfigError
from tasks.stages.runner import prepare
from tasks.stages.upstream import ModelChoice
from tasks.store.artifacts import ArtifactStore


@flow(name="full-pipeline", log_prints=True, result_serializer="json")
@stages.cancellable
def full_pipeline(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    init_from: str | None = None,
) -> dict[str, str]:
    """Run every stage of a named pipeline; returns {stage: artifact path}.

    init_from: the model to start pretraining from (default: the pipeline's pretrain.init_from): a model artifact,
    or a GGUF file or Hugging Face directory, which the `convert` task turns into one first (cached).
    """
    cfg = resolve_pipeline(str(Path(config).resolve()), pipeline, list(overrides or []))  # once; fails fast
    store = ArtifactStore(artifacts)
    out: dict[str, str] = {}
    if init_from is None and cfg.pretrain.init_from:  # the YAML key, when no parameter overrides it
        init_from = str(cfg.resolve_path(cfg.pretrain.init_from))
    init_from = stages.resolve_init(store, cfg.name, init_from)  # a GGUF file / HF directory: the convert task
    if cfg.data.executor == "dask":  # chunks mapped over a Dask cluster (same bytes as the local pool)
        from flows.data_dask import run_on_dask  # lazy: Dask (prefect-dask, ~0.5 s over Prefect) only when used

        out["data"] = run_on_dask(cfg, str(store.root), init_from)
    else:  # the base artifact's tokenizer files, when continuing one
        out["data"] = stages.run_stage(stages.data_task, prepare("data", store, cfg, tokenizer_model=init_from))
    out["pretrain"] = stages.run_stage(
        stages.pretrain_task, prepare("pretrain", store, cfg, data_artifact=out["data"], init_from=init_from)
    )
    model = out["pretrain"]
    if cfg.continued.sources:
        ccfg = cfg.for_continued([str(cfg.resolve_path(s)) for s in cfg.continued.sources])
        out["continued_data"] = stages.run_stage(stages.data_task, prepare("data", store, ccfg, tokenizer_model=model))
        out["continued_pretrain"] = stages.run_stage(
            stages.pretrain_task, prepare("pretrain", store, ccfg, data_artifact=out["continued_data"], init_from=model)
        )
        model = out["continued_pretrain"]
    if cfg.finetune.sources:
        ft = stages.run_stage(stages.finetune_task, prepare("finetune", store, cfg, base_artifact=model))
        out["finetune"], out["merged"] = ft["finetune"], ft["merged"]
        model = ft["merged"]
    choice = ModelChoice.of(store, model, "this-run", "the model this full-pipeline run built (the end of its chain)")
    out["eval"] = stages.run_eval(store, cfg, choice, out.get("continued_data", out["data"]))
    # export does not take the eval artifact as an input, so editing only `eval:` reruns only eval
    # (`msllm export` / the export-stage flow put the newest matching eval into the model card)
    out["export"] = stages.run_stage(stages.export_task, prepare("export", store, cfg, model_artifact=model))
    print(stages.publish_lineage(store, out["export"]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default=None)
    ap.add_argument("--config", default="pipelines.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--init-from", default=None)
    a = ap.parse_args(argv)
    try:
        cfg = resolve_pipeline(a.config, a.pipeline, a.overrides)
    except ConfigError as exc:
        print("error: invalid pipeline:\n  " + "\n  ".join(exc.errors), file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = full_pipeline(
        pipeline=cfg.name, config=a.config, overrides=a.overrides, artifacts=a.artifacts, init_from=a.init_from
    )
    print(f"\nfull-pipeline '{cfg.name}' finished in {time.perf_counter() - t0:.1f}s")
    for stage, path in out.items():
        print(f"  {stage:<20} {path}")
    print(list(out.values())[-1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
