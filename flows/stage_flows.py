"""One flow per stage, each running that stage alone on given input artifacts.

Inputs default to the stage table's resolver (tasks/stages/upstream.py): data for pretrain is
the pipeline's newest data artifact; the model of eval and export is the one the rule in
`tasks.stages.upstream.choose_model` names (the newest finetune of the pipeline's newest
pretrain, else that pretrain), printed with its reason and recorded in the eval manifest and
the `eval-report-<pipeline>` artifact. `model_artifact=` (a path, stage/key or key prefix)
overrides it.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows import stages
from tasks.config.loader import resolve_pipeline
from tasks.config.schema import PipelineConfig
from tasks.stages.export import matching_eval
from tasks.stages.runner import prepare
from tasks.stages.upstream import choose_model, upstream
from tasks.store.artifacts import ArtifactStore
from tasks.store.lineage import lineage_data_artifact


def _setup(
    pipeline: str, config: str, overrides: list[str] | None, artifacts: str
) -> tuple[PipelineConfig, ArtifactStore]:
    """The pipeline config, resolved once for the flow run (validated before any compute), and the store."""
    return resolve_pipeline(str(Path(config).resolve()), pipeline, list(overrides or [])), ArtifactStore(artifacts)


@flow(name="data-stage", log_prints=True, result_serializer="json")
@stages.cancellable
def data_flow(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    tokenizer_model: str | None = None,
    refresh: bool = False,
) -> str:
    """refresh (every stage flow): a forced rerun, recomputed and published under the same key although the store
    holds it; the previous artifact is kept and named in the new manifest ("replaces")."""
    cfg, store = _setup(pipeline, config, overrides, artifacts)
    call = prepare("data", store, cfg, tokenizer_model=tokenizer_model, refresh=refresh)
    return stages.run_stage(stages.data_task, call)


@flow(name="pretrain-stage", log_prints=True, result_serializer="json")
@stages.cancellable
def pretrain_flow(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    data_artifact: str | None = None,
    init_from: str | None = None,
    refresh: bool = False,
) -> str:
    cfg, store = _setup(pipeline, config, overrides, artifacts)
    data_artifact = upstream(store, "pretrain", cfg.name, data_artifact)  # given, or the stage table's default
    init_from = stages.resolve_init(store, cfg.name, init_from)  # a GGUF file / HF directory: converted
    call = prepare("pretrain", store, cfg, data_artifact=data_artifact, init_from=init_from, refresh=refresh)
    return stages.run_stage(stages.pretrain_task, call)


@flow(name="finetune-stage", log_prints=True, result_serializer="json")
@stages.cancellable
def finetune_flow(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    base_artifact: str | None = None,
    refresh: bool = False,
) -> dict[str, str]:
    cfg, store = _setup(pipeline, config, overrides, artifacts)
    base_artifact = upstream(store, "finetune", cfg.name, base_artifact)
    call = prepare("finetune", store, cfg, base_artifact=base_artifact, refresh=refresh)
    return stages.run_stage(stages.finetune_task, call)


@flow(name="eval-stage", log_prints=True, result_serializer="json")
@stages.cancellable
def eval_flow(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    model_artifact: str | None = None,
    data_artifact: str | None = None,
    refresh: bool = False,
) -> str:
    """Evaluate a model artifact (default: the model tasks.stages.upstream.choose_model names, with its reason);
    refresh: evaluate again although the same eval is stored (a new record; the previous one kept in lineage)."""
    cfg, store = _setup(pipeline, config, overrides, artifacts)
    choice = choose_model(store, cfg.name, model_artifact)
    if data_artifact is None:
        found = lineage_data_artifact(store, choice.path)
        data_artifact = str(found) if found else None
    return stages.run_eval(store, cfg, choice, data_artifact, refresh=refresh)


@flow(name="export-stage", log_prints=True, result_serializer="json")
@stages.cancellable
def export_flow(
    pipeline: str = "demo",
    config: str = "pipelines.yaml",
    overrides: list[str] | None = None,
    artifacts: str = "artifacts",
    model_artifact: str | None = None,
    eval_artifact: str | None = None,
    refresh: bool = False,
) -> str:
    """Export a model artifact (default: the model tasks.stages.upstream.choose_model names) to MindIR + ONNX."""
    cfg, store = _setup(pipeline, config, overrides, artifacts)
    choice = choose_model(store, cfg.name, model_artifact)
    print(f"export: {choice.line()}")
    if eval_artifact is None:
        found = matching_eval(store, choice.path, cfg.name)
        eval_artifact = str(found) if found else None
    call = prepare("export", store, cfg, model_artifact=choice.path, eval_artifact=eval_artifact, refresh=refresh)
    return stages.run_stage(stages.export_task, call)


STAGE_FLOWS = {
    "data": data_flow,
    "pretrain": pretrain_flow,
    "finetune": finetune_flow,
    "eval": eval_flow,
    "export": export_flow,
}
