"""Prefect tasks: thin wrappers around the stage functions in `tasks/`, cached by content.

Each task's Prefect cache key IS the artifact store's content key (stage + resolved
config section + input digests + code version), so a hit in one is a hit in the
other: when the store holds the artifact the task shows Cached; when the store has
lost it, the key gets a one-off suffix and the task reruns. Results are file paths,
persisted as JSON (never pickle).

Tasks take (config path, pipeline name, overrides) rather than config objects, so
their parameters stay small and readable in the UI; each resolves and validates the
config itself, which costs milliseconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

from tasks.store.artifacts import ArtifactStore
from tasks.config import PipelineConfig, resolve_pipeline


def load_cfg(config: str, pipeline: str, overrides: list[str] | None, continued_sources: list[str] | None = None) -> PipelineConfig:
    cfg = resolve_pipeline(config, pipeline, overrides or [])
    return cfg.for_continued(continued_sources) if continued_sources else cfg


_KEY_FNS: dict[str, Any] = {}


def _store_key_fn(stage: str, key_of):
    """A Prefect cache_key_fn returning the store's content key for this stage's inputs."""

    def fn(context, params: dict[str, Any]) -> str:
        return f"{stage}-{key_of(ArtifactStore(params['artifacts']), params)}"

    _KEY_FNS[stage] = key_of
    return fn


def run_stage(task_obj, **params):
    """Call a stage task so that Prefect's cache agrees with the artifact store.

    When the store lacks the artifact (never built, or deleted), Prefect's cache record for
    the key is refreshed (the task runs); when the store has it, Prefect reports Cached.
    """
    stage = task_obj.name
    store = ArtifactStore(params["artifacts"])
    missing = store.lookup(stage, _KEY_FNS[stage](store, params)) is None
    return task_obj.with_options(refresh_cache=missing)(**params)


def _p(x: str | None) -> Path | None:
    return Path(x) if x else None


# ----------------------------------------------------------------------------- data


def _data_key(store, params):
    from tasks.stages import data

    cfg = load_cfg(params["config"], params["pipeline"], params["overrides"], params.get("continued_sources"))
    return data.stage_key(cfg, store, _p(params.get("tokenizer_model")))[0]


@task(name="data", cache_key_fn=_store_key_fn("data", _data_key), persist_result=True, result_serializer="json")
def data_task(config: str, pipeline: str, overrides: list[str], artifacts: str,
              tokenizer_model: str | None = None, continued_sources: list[str] | None = None) -> str:
    from tasks.stages import data

    cfg = load_cfg(config, pipeline, overrides, continued_sources)
    path = data.run(cfg, ArtifactStore(artifacts), tokenizer_model=_p(tokenizer_model))
    publish_metrics("data", path)
    return str(path)


def _retry_helps(task, task_run, state) -> bool:
    """Prefect retries a training task only when a rerun could succeed (tasks/runtime/supervise.is_permanent):
    a bad config, a corrupt or foreign artifact, or a non-finite run fails the same way every time."""
    from tasks.runtime.supervise import is_permanent

    exc = state.data
    return not (isinstance(exc, BaseException) and is_permanent(exc))


# ----------------------------------------------------------------------------- pretrain


def _pretrain_key(store, params):
    from tasks.stages import pretrain

    cfg = load_cfg(params["config"], params["pipeline"], params["overrides"], params.get("continued_sources"))
    return pretrain.stage_key(cfg, store, Path(params["data_artifact"]), _p(params.get("init_from")))[0]


@task(name="pretrain", cache_key_fn=_store_key_fn("pretrain", _pretrain_key), persist_result=True,
      result_serializer="json", retries=1, retry_delay_seconds=2,
      retry_condition_fn=_retry_helps)
def pretrain_task(config: str, pipeline: str, overrides: list[str], artifacts: str, data_artifact: str,
                  init_from: str | None = None, continued_sources: list[str] | None = None) -> str:
    """Trains in a supervised child process; a Prefect retry resumes from the newest checkpoint."""
    from tasks.stages import pretrain

    cfg = load_cfg(config, pipeline, overrides, continued_sources)
    path = pretrain.run(cfg, ArtifactStore(artifacts), Path(data_artifact), init_from=_p(init_from))
    publish_metrics("pretrain", path)
    return str(path)


# ----------------------------------------------------------------------------- finetune (+ merge)


def _finetune_key(store, params):
    from tasks.stages import finetune

    cfg = load_cfg(params["config"], params["pipeline"], params["overrides"])
    return finetune.stage_key(cfg, store, Path(params["base_artifact"]))[0]


@task(name="finetune", cache_key_fn=_store_key_fn("finetune", _finetune_key), persist_result=True,
      result_serializer="json", retries=1, retry_delay_seconds=2,
      retry_condition_fn=_retry_helps)
def finetune_task(config: str, pipeline: str, overrides: list[str], artifacts: str, base_artifact: str) -> dict[str, str]:
    """LoRA/full fine-tuning in a supervised child, then the merge eval and export consume."""
    from tasks.stages import finetune
    from tasks.store.merge import merge

    cfg = load_cfg(config, pipeline, overrides)
    store = ArtifactStore(artifacts)
    path = finetune.run(cfg, store, Path(base_artifact))
    publish_metrics("finetune", path)
    return {"finetune": str(path), "merged": str(merge(store, path))}


# ----------------------------------------------------------------------------- eval


def _eval_key(store, params):
    from tasks.stages import evaluate

    cfg = load_cfg(params["config"], params["pipeline"], params["overrides"])
    return evaluate.stage_key(cfg, store, Path(params["model_artifact"]), _p(params.get("data_artifact")))[0]


@task(name="eval", cache_key_fn=_store_key_fn("eval", _eval_key), persist_result=True, result_serializer="json")
def eval_task(config: str, pipeline: str, overrides: list[str], artifacts: str, model_artifact: str,
              data_artifact: str | None = None) -> str:
    """Perplexity on the held-out split, lm-eval tasks, sample generations."""
    from tasks.stages import evaluate

    cfg = load_cfg(config, pipeline, overrides)
    path = evaluate.run(cfg, ArtifactStore(artifacts), Path(model_artifact), _p(data_artifact))
    publish_metrics("eval", path)
    report = Path(path) / "report.md"
    if report.is_file():
        create_markdown_artifact(key=_slug(f"eval-report-{pipeline}"), markdown=report.read_text(),
                                 description=f"eval of {model_artifact}")
    return str(path)


# ----------------------------------------------------------------------------- export


def _export_key(store, params):
    from tasks.stages import export

    cfg = load_cfg(params["config"], params["pipeline"], params["overrides"])
    return export.stage_key(cfg, store, Path(params["model_artifact"]), _p(params.get("eval_artifact")))[0]


@task(name="export", cache_key_fn=_store_key_fn("export", _export_key), persist_result=True, result_serializer="json")
def export_task(config: str, pipeline: str, overrides: list[str], artifacts: str, model_artifact: str,
                eval_artifact: str | None = None) -> str:
    """MindIR + ONNX, each verified by reloading and comparing logits (in a child process)."""
    from tasks.stages import export

    cfg = load_cfg(config, pipeline, overrides)
    path = export.run(cfg, ArtifactStore(artifacts), Path(model_artifact), eval_artifact=_p(eval_artifact))
    publish_metrics("export", path)
    return str(path)


# ----------------------------------------------------------------------------- UI artifacts


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")[:60]


def publish_metrics(stage: str, path: str | Path) -> None:
    """The stage's manifest metrics as a Prefect table artifact."""
    m = ArtifactStore.read_manifest(path)
    rows = [{"metric": k, "value": (f"{v:.6g}" if isinstance(v, float) else str(v))}
            for k, v in m.get("metrics", {}).items() if not isinstance(v, (dict, list))]
    create_table_artifact(key=_slug(f"{stage}-metrics"), table=rows,
                          description=f"{stage} artifact {m['key']} ({path})")


def publish_lineage(store: ArtifactStore, path: str | Path) -> str:
    """The lineage tree of an artifact as a Prefect markdown artifact (mermaid + text); returns the text."""
    from tasks.store.lineage import lineage_tree, raw_inputs, render

    tree = lineage_tree(store, path)
    text = render(tree, "text")
    raws = "\n".join(f"| {Path(r['path']).name} | {r['size']} | `{r['sha256']}` |" for r in raw_inputs(tree))
    md = (f"# Lineage of {tree['stage']}/{tree['key']}\n\n```mermaid\n{render(tree, 'mermaid')}\n```\n\n"
          f"```\n{text}\n```\n\n| raw input | bytes | sha256 |\n|---|---|---|\n{raws}\n")
    create_markdown_artifact(key=_slug(f"lineage-{tree['stage']}"), markdown=md, description=f"lineage of {path}")
    return text
