"""The stage table: every stage of the pipeline, in one place.

    from tasks.stages import STAGES, stage_module, code_version
    from tasks.stages.upstream import upstream
    STAGES["pretrain"].module            # 'tasks.stages.pretrain'
    stage_module("pretrain").stage_key(...)  # the module: stage_key(...) and run(..., keyed=...)
    code_version("eval")                 # hash of every project file the eval stage imports (+ its data files)
    upstream(store, "export", "demo")    # the newest artifact export would read, or a clear error
    from tasks.stages.runner import prepare
    prepare("eval", store, cfg, model_artifact=m).run()   # how the CLI and the flows run a stage (checked, keyed once)

The CLI (`tasks/cli`) and the Prefect flows (`flows/`) run every stage through the stage runner
(`tasks/stages/runner.py`); it, the child-process supervisor and the msrun worker (`tasks/runtime`)
and the cache keys read this table; no stage module is found by building its name from a string
anywhere else. A stage module exposes `stage_key(...)` and `run(..., keyed=...)` (`keyed`: the
runner's `stage_key` result: the key is computed once and the machine checked once, there; tests run stages
through the runner too) and knows nothing about the command
line; one that trains in a child process
exposes the child entry point named by `child` (`python -m tasks.runtime.child --stage NAME --entry MODULE:FUNC`;
the runtime finds it by that dotted name, `Stage.entry`, and never imports this table).

Code versions come from the code (`tasks.store.codeversion`): the sha256 of every project source
file that the stage's module imports, transitively (function-level imports included), plus the
data files the table declares (the lm-eval task YAMLs it loads by path). Editing any of those
files changes the stage's cache key; a declared file that is missing is an error.
"""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from tasks.store.codeversion import stage_code_version

REPO = Path(__file__).resolve().parents[2]
MODEL_KINDS = ("merged", "pretrain", "convert")  # artifacts holding model.json + weights


@dataclass(frozen=True)
class Stage:
    name: str
    """The artifact kind it writes (`<root>/<name>/<key>/`)."""
    module: str
    """The module with `stage_key` and `run`."""
    upstream: tuple[str, ...] = ()
    """Artifact kinds it reads, in order of preference for its default input."""
    child: str | None = None
    """Entry point run in a supervised child process (and on every msrun rank), or None (in-process)."""
    distributed: bool = False
    """Runs its ranks under msrun when parallel.device_num > 1."""
    data_files: tuple[str, ...] = ()
    """Repo-relative files (globs) read at run time, part of the code version."""
    command: str | None = None
    """The `msllm` command that builds it (for "run X first" hints)."""

    @property
    def entry(self) -> str | None:
        """The child entry point's dotted name (`tasks.stages.pretrain:train`), as the child process resolves it."""
        return f"{self.module}:{self.child}" if self.child else None


STAGES: dict[str, Stage] = {
    s.name: s
    for s in (
        Stage("data", "tasks.stages.data", command="data"),
        Stage("pretrain", "tasks.stages.pretrain", ("data",), child="train", distributed=True, command="train"),
        Stage("finetune", "tasks.stages.finetune", ("pretrain",), child="train", distributed=True, command="finetune"),
        Stage("merged", "tasks.modeling.merge", ("finetune",), command="finetune"),  # merge(): below export and serving
        Stage(
            "eval",
            "tasks.stages.evaluate",
            MODEL_KINDS,
            data_files=("tasks/stages/evaluate/lm_tasks/*.yaml", "tasks/stages/evaluate/lm_tasks/utils.py"),
            command="eval",
        ),
        Stage("export", "tasks.stages.export", MODEL_KINDS, child="export", command="export"),
        Stage("convert", "tasks.stages.convert", command="convert --from-hf DIR"),
    )
}


class UnknownStage(ValueError):
    pass


def stage(name: str) -> Stage:
    try:
        return STAGES[name]
    except KeyError:
        raise UnknownStage(f"unknown stage {name!r}; stages: {', '.join(STAGES)}") from None


def stage_module(name: str) -> ModuleType:
    """The stage's module (imported on first use: MindSpore-heavy stages stay unloaded until needed)."""
    return importlib.import_module(stage(name).module)


@functools.cache
def code_version(name: str) -> str:
    """16 hex digits: the stage name + every source file its module imports + its declared data files."""
    s = stage(name)
    return stage_code_version(name, s.module, s.data_files, root=REPO)


__all__ = ["STAGES", "Stage", "stage", "stage_module", "code_version", "MODEL_KINDS"]
