"""The stage runner: the one way the CLI (`tasks/cli`) and the Prefect flows (`flows/`) run a stage.

    call = prepare("pretrain", store, cfg, data_artifact=data, init_from=base)  # checks, then the key: once
    call.key                     # the store's content key (a flow hands `call` to its task: the Prefect cache key)
    call.cached()                # the artifact when the store holds it, else None
    path = call.run(retries=1)   # the stage module's run(..., keyed=call.keyed): the cached artifact, or built
    path = prepare("eval", store, cfg, model_artifact=m, data_artifact=d).run(selection=s)
    base = resolve_init(store, "demo", "model.gguf")  # pretrain.init_from: a GGUF file / HF directory, converted

`prepare` takes the pipeline config its caller resolved once (tasks.config.loader.resolve_pipeline; a continued run's
`cfg.for_continued(...)`) and the stage's inputs under the names the stage module's `run` gives them. It resolves
the input paths inside the store, refuses what this machine cannot hold for the training stages (`check_machine`,
before any compute), and computes the stage key once (the stage module's `stage_key`). `StageCall.run` hands that
result down as `keyed=` (required: a stage never computes its key or checks the machine a second time, and tests
run stages through here as the CLI does: tests/helpers.py `run_stage`). Stage modules are found through the stage table
(`tasks.stages.stage_module`): this module
imports none of them.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.config.schema import ConfigError, PipelineConfig
from tasks.stages import stage, stage_module
from tasks.store.artifacts import ArtifactStore
from tasks.training.memory import machine_fit_errors


@dataclass(frozen=True)
class StageCall:
    """One stage, ready to run: its `run` arguments (config, store, input paths inside the store) and its key."""

    stage: str
    args: dict[str, Any]
    """The stage module's `run` arguments by name: cfg (except convert), store and the resolved inputs."""
    keyed: tuple
    """What the stage module's `stage_key` returned: (key, inputs, ...)."""
    refresh: bool = False
    """A forced rerun: compute and publish under the same key although the store holds it (`ArtifactStore.replacing`:
    the previous artifact is kept and named in the new manifest's "replaces"; a training stage's run directory of
    that key moves aside too, so it starts over instead of resuming its finished run)."""

    @property
    def key(self) -> str:
        return self.keyed[0]

    @property
    def store(self) -> ArtifactStore:
        return self.args["store"]

    def cached(self) -> Path | None:
        """The published artifact of this key, or None (never built, deleted, or a forced rerun)."""
        return None if self.refresh else self.store.lookup(self.stage, self.key)

    def run(self, **options) -> Path:
        """The stage's artifact, the cached one or built: `stage_module(stage).run(**args, keyed=keyed, **options)`;
        with `refresh`, built again in place of the published one (its inputs were checked by `prepare`)."""
        module = stage_module(self.stage)
        if not self.refresh:
            return module.run(**self.args, keyed=self.keyed, **options)
        with self.store.replacing(self.stage, self.key) as previous:
            runs = self.store.root / "runs" / self.stage / self.key
            if runs.is_dir():  # a training stage's checkpoints of this key: start over, keep them beside
                aside = runs.parent / ".replaced" / (previous.name if previous else f"{self.key}-0")
                aside.parent.mkdir(parents=True, exist_ok=True)
                os.rename(runs, aside)
            if previous is not None:
                print(f"[{self.stage}] forced rerun: the previous artifact is kept at {previous}", file=sys.stderr)
            return module.run(**self.args, keyed=self.keyed, **options)


def check_machine(cfg: PipelineConfig) -> None:
    """Refuse settings this machine cannot serve (the memory plan, tasks.training.memory), before any compute:
    a ConfigError naming each YAML key."""
    if errs := machine_fit_errors(cfg, f"pipelines.{cfg.name}"):
        raise ConfigError(errs)


def prepare(
    name: str, store: ArtifactStore, cfg: PipelineConfig | None = None, *, refresh: bool = False, **inputs
) -> StageCall:
    """Stage `name` on these inputs: checked, its input paths resolved inside `store`, its key computed (once).

    cfg: the resolved pipeline config (convert takes none). inputs: as the stage module's `run` names them
    (data: tokenizer_model; pretrain: data_artifact, init_from; finetune: base_artifact; eval: model_artifact,
    data_artifact; export: model_artifact, eval_artifact; convert: source, pipeline, kind). refresh: a forced rerun
    (`StageCall.refresh`)."""
    if name not in _PREPARE:
        stage(name)  # UnknownStage for a name the table lacks
        raise ValueError(f"stage {name!r} is not run by the stage runner (the finetune stage publishes it)")
    args, keyed = _PREPARE[name](store, cfg, **inputs)
    return StageCall(
        name, {"store": store, **args} if name == "convert" else {"cfg": cfg, "store": store, **args}, keyed, refresh
    )


def resolve_init(
    store: ArtifactStore, pipeline: str, init_from: str | Path | None, run: Callable[[StageCall], Any] = StageCall.run
) -> Path | None:
    """The model artifact pretraining starts from (and whose tokenizer a continued run's data stage reuses):
    a GGUF file or a Hugging Face directory through the convert stage (cached like every stage; `run` runs its
    call: a flow passes its Prefect task), anything else looked up in the store (a path, stage/key or key)."""
    if init_from is None:
        return None
    if stage_module("convert").source_kind(init_from) is None:
        return store.find(str(init_from))
    return Path(run(prepare("convert", store, source=Path(init_from).resolve(), pipeline=pipeline)))


# ----------------------------------------------------------------------------- per stage: (run arguments, stage_key)


def _inside(store: ArtifactStore, path) -> Path | None:
    return store.inside(path) if path else None


def _data(store, cfg, tokenizer_model=None):
    tok = Path(tokenizer_model) if tokenizer_model else None
    return {"tokenizer_model": tok}, stage_module("data").stage_key(cfg, store, tok)


def _pretrain(store, cfg, data_artifact, init_from=None):
    check_machine(cfg)
    data, init = store.inside(data_artifact), _inside(store, init_from)
    return {"data_artifact": data, "init_from": init}, stage_module("pretrain").stage_key(cfg, store, data, init)


def _finetune(store, cfg, base_artifact):
    check_machine(cfg)
    base = store.inside(base_artifact)
    return {"base_artifact": base}, stage_module("finetune").stage_key(cfg, store, base)


def _eval(store, cfg, model_artifact, data_artifact=None):
    model, data = store.inside(model_artifact), _inside(store, data_artifact)
    return {"model_artifact": model, "data_artifact": data}, stage_module("eval").stage_key(cfg, store, model, data)


def _export(store, cfg, model_artifact, eval_artifact=None):
    export = stage_module("export")
    model = export.resolve_model(store, model_artifact)  # a finetune artifact: its merged model
    ev = _inside(store, eval_artifact)
    return {"model_artifact": model, "eval_artifact": ev}, export.stage_key(cfg, store, model, ev)


def _convert(store, cfg, source, pipeline=None, kind=None):
    convert = stage_module("convert")
    source = Path(source)
    kind = kind or convert.source_kind(source)
    return {"source": source, "pipeline": pipeline, "kind": kind}, convert.stage_key(store, source, kind)


_PREPARE: dict[str, Callable[..., tuple[dict[str, Any], tuple]]] = {
    "data": _data,
    "pretrain": _pretrain,
    "finetune": _finetune,
    "eval": _eval,
    "export": _export,
    "convert": _convert,
}
