"""The one resolver of a stage's default input: the CLI and the flows share it.

    upstream(store, "export", "demo")            # the model the rule below names for the demo pipeline
    upstream(store, "export", "demo", given=p)   # `--from p`: a path, stage/key or key prefix
    choose_model(store, "demo")                  # the same model, with why (ModelChoice.reason)

Which model eval, export, predict and serve read (the rule; docs/PIPELINE.md#which-model):

1. given (`--from`, a flow's `model_artifact=`): that artifact; a finetune artifact means its merged model.
2. otherwise the tip of the pipeline's own chain. Its base is the pipeline's newest pretrain
   artifact (a continued-pretraining run is a pretrain artifact too), or, when it has none, its
   newest convert artifact. The tip is the newest merged model of the pipeline whose finetune
   was trained on that base; when that base has no finetune, the base itself.

"Newest model of any kind" is never the rule: after a scheduled continued-pretraining run the
newest artifact is the continued base, while the model that was exported and is served is the
finetune of it (or of its predecessor). The rule names the base only when no finetune of it
exists, and says so; callers print and record the reason (eval manifests, eval-report artifacts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tasks.stages import MODEL_KINDS, STAGES, stage


class NoUpstream(RuntimeError):
    """No upstream artifact to read; the message says which command builds one."""

    permanent = True


@dataclass(frozen=True)
class ModelChoice:
    """The model a command or flow reads, and why (one sentence a user can check against the rule)."""

    path: Path
    stage: str
    key: str
    rule: str
    """given | finetune-of-newest-base | newest-base (no finetune of it)"""
    reason: str

    @property
    def ref(self) -> str:
        return f"{self.stage}/{self.key}"

    def record(self) -> dict[str, str]:
        """What eval manifests and eval-report artifacts keep (`model_choice`)."""
        return {"artifact": self.ref, "path": str(self.path), "rule": self.rule, "reason": self.reason}

    @classmethod
    def of(cls, store, path: str | Path, rule: str, reason: str) -> ModelChoice:
        m = store.read_manifest(path)
        return cls(Path(path), m["stage"], m["key"], rule, reason)

    def line(self) -> str:
        return f"model {self.ref}: {self.reason}"


def _input_keys(manifest: dict, stage_: str | None = None) -> set[str]:
    return {
        i.get("key")
        for i in manifest.get("inputs", [])
        if isinstance(i, dict) and i.get("kind") == "artifact" and (stage_ is None or i.get("stage") == stage_)
    }


def chain_base(store, pipeline: str) -> Path | None:
    """The pipeline's newest pretrain artifact (continued runs included), else its newest convert artifact."""
    return store.newest("pretrain", pipeline) or store.newest("convert", pipeline)


def choose_model(store, pipeline: str, given: str | Path | None = None) -> ModelChoice:
    """The model eval/export/predict/serve read for `pipeline` (the rule in the module doc)."""
    if given:
        p = store.find(str(given))
        m = store.read_manifest(p)
        if m["stage"] == "finetune":
            from tasks.modeling.merge import merge  # lazy: NumPy; the CLI imports this module

            merged = merge(store, p)
            mm = store.read_manifest(merged)
            return ModelChoice(merged, "merged", mm["key"], "given", f"given (finetune/{m['key']}): its merged model")
        return ModelChoice(p, m["stage"], m["key"], "given", "given explicitly (--from / model_artifact=)")
    base = chain_base(store, pipeline)
    if base is None:
        raise NoUpstream(
            f"no model (pretrain or convert) artifact for pipeline '{pipeline}' under {store.root}; run "
            f"`msllm {STAGES['pretrain'].command} --pipeline {pipeline}` first or pass --from PATH"
        )
    bm = store.read_manifest(base)
    tunes = {m["key"] for _, m in store.list("finetune", pipeline) if bm["key"] in _input_keys(m)}
    merged = [(p, m) for p, m in store.list("merged", pipeline) if _input_keys(m, "finetune") & tunes]
    if merged:
        p, m = merged[-1]
        return ModelChoice(
            p,
            "merged",
            m["key"],
            "finetune-of-newest-base",
            f"the newest finetune (merged) of the pipeline's newest {bm['stage']} artifact {bm['stage']}/{bm['key']}",
        )
    return ModelChoice(
        base,
        bm["stage"],
        bm["key"],
        "newest-base",
        f"the pipeline's newest {bm['stage']} artifact; no finetune of it exists "
        f"(run `msllm finetune --pipeline {pipeline}` to finetune it)",
    )


def model_of_eval(manifest: dict) -> str | None:
    """`stage/key` of the model an eval artifact evaluated (its first non-data artifact input)."""
    ref = next(
        (
            i
            for i in manifest.get("inputs", [])
            if isinstance(i, dict) and i.get("kind") == "artifact" and i.get("stage") != "data"
        ),
        None,
    )
    return f"{ref['stage']}/{ref['key']}" if ref else None


def previous_eval(store, pipeline: str, exclude: Path | None = None) -> tuple[Path, str | None] | None:
    """The pipeline's newest eval artifact (other than `exclude`) and the model it evaluated."""
    evals = [
        (p, m) for p, m in store.list("eval", pipeline) if exclude is None or p.resolve() != Path(exclude).resolve()
    ]
    if not evals:
        return None
    p, m = evals[-1]
    return p, model_of_eval(m)


def model_change_note(store, pipeline: str, choice: ModelChoice, exclude: Path | None = None) -> str | None:
    """A sentence when `choice` is not the model the pipeline's previous eval report evaluated, else None."""
    prev = previous_eval(store, pipeline, exclude)
    if prev is None or prev[1] is None or prev[1] == choice.ref:
        return None
    return (
        f"the model changed: the previous eval report of pipeline '{pipeline}' (eval/{prev[0].name}) evaluated "
        f"{prev[1]}; this one evaluates {choice.ref} ({choice.reason})"
    )


def eval_selection(store, pipeline: str, choice: ModelChoice) -> dict[str, str]:
    """What an eval of `choice` records about its model (the manifest's `model_choice`, the eval report): the
    choice, with a "note" when it is not the model of the pipeline's previous eval report. The CLI and the flows
    print both."""
    note = model_change_note(store, pipeline, choice)
    return dict(choice.record(), **({"note": note} if note else {}))


def upstream(store, name: str, pipeline: str, given: str | Path | None = None) -> Path:
    """The artifact stage `name` reads by default: `given` (a path, stage/key or key prefix), or the
    pipeline's newest artifact of its upstream kind (for model inputs: the model `choose_model` names).
    The one resolver the CLI and the flows share; NoUpstream names the command to run first."""
    kinds = stage(name).upstream
    if not kinds:
        raise ValueError(f"stage {name!r} reads no upstream artifact")
    if kinds == MODEL_KINDS:
        return choose_model(store, pipeline, given).path
    if given:
        return store.find(str(given))
    if kinds == ("pretrain",):  # finetune: the base of the pipeline's chain
        found = chain_base(store, pipeline)
    else:
        found = store.newest(kinds[0], pipeline)
    if found is None:
        first = STAGES[kinds[0]]
        raise NoUpstream(
            f"no {kinds[0]} artifact for pipeline '{pipeline}' under {store.root}; run "
            f"`msllm {first.command} --pipeline {pipeline}` first or pass --from PATH"
        )
    return found
