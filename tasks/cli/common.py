"""What every command shares: loading the pipeline, the store, upstream artifacts, the metrics line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tasks.config.loader import resolve_pipeline
from tasks.config.schema import PipelineConfig
from tasks.stages.upstream import upstream as stage_upstream
from tasks.store.artifacts import ArtifactStore


class StageError(RuntimeError):
    """A command failed for a reason the user can fix; the message says how."""


def load(args) -> PipelineConfig:
    cfg = resolve_pipeline(args.config, args.pipeline, args.overrides)
    for note in cfg.notes:  # e.g. which training budget a --set replaced
        print(f"note: {note}", file=sys.stderr)
    return cfg


def store(args) -> ArtifactStore:
    return ArtifactStore(args.artifacts)


def upstream(args, st, stage: str, pipeline: str) -> Path:
    """`--from PATH`, else the pipeline's newest artifact that `stage` reads (the stage table's resolver)."""
    return stage_upstream(st, stage, pipeline, getattr(args, "from_", None))


def print_metrics(path: Path) -> None:
    m = json.loads((Path(path) / "manifest.json").read_text())
    shown = {k: v for k, v in m.get("metrics", {}).items() if not isinstance(v, (dict, list))}
    print(
        f"# {m['stage']} artifact {m['key']}: "
        + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
    )
