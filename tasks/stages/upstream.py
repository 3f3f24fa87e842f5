"""The one resolver of a stage's default input: the CLI and the flows share it.

    upstream(store, "export", "demo")            # the newest model artifact of the demo pipeline
    upstream(store, "export", "demo", given=p)   # `--from p`: a path, stage/key or key prefix
"""

from __future__ import annotations

from pathlib import Path

from tasks.stages import MODEL_KINDS, STAGES, stage


class NoUpstream(RuntimeError):
    """No upstream artifact to read; the message says which command builds one."""

    permanent = True


def upstream(store, name: str, pipeline: str, given: str | Path | None = None) -> Path:
    """The artifact stage `name` reads by default: `given` (a path, stage/key or key prefix), or the
    pipeline's newest artifact of its upstream kind (for model inputs: the newest merged or pretrain model).
    The one resolver the CLI and the flows share; NoUpstream names the command to run first."""
    from tasks.store.model_artifact import newest_model

    if given:
        return store.find(str(given))
    kinds = stage(name).upstream
    if not kinds:
        raise ValueError(f"stage {name!r} reads no upstream artifact")
    found = newest_model(store, pipeline) if kinds == MODEL_KINDS else store.newest(kinds[0], pipeline)
    if found is None:
        first = STAGES["pretrain" if kinds == MODEL_KINDS else kinds[0]]
        what = "model (merged or pretrain)" if kinds == MODEL_KINDS else kinds[0]
        raise NoUpstream(f"no {what} artifact for pipeline '{pipeline}' under {store.root}; run "
                         f"`msllm {first.command} --pipeline {pipeline}` first or pass --from PATH")
    return found
