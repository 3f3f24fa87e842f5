"""TensorBoard event files beside each run's metrics.jsonl, so `tensorboard --logdir artifacts/runs` shows every run.

    log = open_run(run_dir, history, meta)    # in fit(): after the resumed history is known (rank 0 only)
    log.write(record)                         # each record as appended to metrics.jsonl
    log.close()
    write_eval(run_dir, scores, step=..., hparams={...})   # the eval stage's task scores, one point per tag

Runs are laid out as `<artifact root>/runs/<stage>/<key>/`, so TensorBoard's run name is
`pretrain/<key>`, `finetune/<key>` or `eval/<key>`: the run key. Continued pretraining
is a pretrain run with its own key, so it shows as its own run.

Tags, from metrics.jsonl's keys (each record is one event at its `step`):

    train/loss  train/lr  train/grad_norm  train/loss_scale  train/skipped_steps  train/overflow_steps
    perf/tokens_per_s  perf/mfu  perf/peak_rss_gib (= peak_rss_bytes / 2**30)  perf/eta_s
    progress/consumed_samples  val/loss  val/ppl          (any other numeric key: train/<key>)

Hyperparameters (the HPARAMS tab) are the run's resolved config sections, read from the
`spec.json` the stage supervisor writes into the run dir (tasks/runtime/supervise.py), plus the
architecture the trainer records (`arch.*`) and the pipeline name.

Resume: the event file is a function of metrics.jsonl. When fit() starts it has already cut
metrics.jsonl back to the resumed step; open_run() writes one fresh event file holding
exactly those records (keeping the wall times of the steps already logged), renames it into
place, and deletes the older event files, so a reader sees every step once. The fresh file
starts with a SessionLog START at step 0, which makes a TensorBoard that is already watching
(the Python loader, `--load_fast=false`) drop what it had read before re-reading the run.

Written with TensorBoard's own record writer and protos (no TensorFlow, no torch).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import socket
import struct
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from google.protobuf.message import DecodeError
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
from tensorboard.compat.proto import event_pb2, summary_pb2
from tensorboard.compat.tensorflow_stub.errors import OpError
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
from tensorboard.plugins.hparams import metadata, plugin_data_pb2

EVENT_GLOB = "events.out.tfevents.*"
_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "loss_scale": "train/loss_scale",
    "skipped_steps": "train/skipped_steps",
    "overflow_steps": "train/overflow_steps",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "peak_rss_bytes": "perf/peak_rss_gib",
    "eta_s": "perf/eta_s",
    "consumed_samples": "progress/consumed_samples",
    "val_loss": "val/loss",
    "val_ppl": "val/ppl",
}
_SCALE = {"peak_rss_bytes": 1 / 2**30}
# the config sections that describe a run of each stage (the HPARAMS columns)
STAGE_SECTIONS = {
    "pretrain": ("model", "data", "pretrain", "parallel", "checkpoint"),
    "finetune": ("finetune", "parallel", "checkpoint"),
    "eval": ("eval",),
}
_uid = itertools.count()


def tag_of(key: str) -> str:
    """The TensorBoard tag of a metrics.jsonl key."""
    return _TAGS.get(key, f"train/{key}")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """{tag: value} of a metrics record: its numeric fields except `step` (bools and strings skipped)."""
    out = {}
    for k, v in record.items():
        if k == "step" or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        out[tag_of(k)] = float(v) * _SCALE.get(k, 1.0)
    return out


def flatten(obj: Any, prefix: str = "") -> dict[str, bool | float | str]:
    """Nested config dict -> {"a.b.c": scalar}; lists as JSON strings, None left out (no hparam type for it)."""
    out: dict[str, bool | float | str] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, (list, tuple)):
        out[prefix] = json.dumps(obj, default=str)
    elif isinstance(obj, (bool, int, float, str)):
        out[prefix] = obj
    elif obj is not None:
        out[prefix] = str(obj)
    return out


def run_hparams(run_dir: Path, meta: dict[str, Any] | None = None) -> dict[str, bool | float | str]:
    """Hyperparameters of a training run: its resolved config (spec.json) sections + the trainer's meta."""
    run_dir = Path(run_dir)
    stage = run_dir.parent.name
    hp: dict[str, bool | float | str] = {"run": f"{stage}/{run_dir.name}"}
    spec_path = run_dir / "spec.json"
    if spec_path.is_file():
        spec = json.loads(spec_path.read_text())
        cfg = spec.get("config", {})
        if cfg.get("name"):
            hp["pipeline"] = cfg["name"]
        for section in STAGE_SECTIONS.get(stage, tuple(k for k, v in cfg.items() if isinstance(v, dict))):
            hp.update(flatten(cfg.get(section, {}), section))
        for k in ("data", "init_from"):  # the inputs (continued pretraining: init_from is set)
            if spec.get(k):
                hp[f"input.{k}"] = str(spec[k])
    for k, v in (meta or {}).items():
        if k == "model" and isinstance(v, dict):
            hp.update(flatten(v, "arch"))
        elif isinstance(v, (bool, int, float, str)):
            hp[f"meta.{k}"] = v
    return hp


# ----------------------------------------------------------------------------- event protos


def _scalar_event(step: int, wall_time: float, values: dict[str, float]):
    summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=t, simple_value=v) for t, v in values.items()])
    return event_pb2.Event(step=int(step), wall_time=wall_time, summary=summary)


def _hparams_event(hparams: dict[str, bool | float | str], wall_time: float):
    """The hparams plugin's session_start_info summary (what tensorboard.plugins.hparams.summary builds, without TF)."""
    info = plugin_data_pb2.SessionStartInfo(start_time_secs=wall_time)
    for name, v in hparams.items():
        if isinstance(v, bool):
            info.hparams[name].bool_value = v
        elif isinstance(v, (int, float)):
            info.hparams[name].number_value = v
        else:
            info.hparams[name].string_value = str(v)
    content = metadata.create_summary_metadata(plugin_data_pb2.HParamsPluginData(session_start_info=info))
    summary = summary_pb2.Summary(
        value=[
            summary_pb2.Summary.Value(
                tag=metadata.SESSION_START_INFO_TAG, metadata=content, tensor=metadata.NULL_TENSOR
            )
        ]
    )
    return event_pb2.Event(step=0, wall_time=wall_time, summary=summary)


def _header_events(wall_time: float):
    return [
        event_pb2.Event(
            wall_time=wall_time,
            file_version="brain.Event:2",
            source_metadata=event_pb2.SourceMetadata(writer="msllm.tasks.tensorboard"),
        ),
        # a TensorBoard already watching this run drops what it read from the replaced files
        event_pb2.Event(
            wall_time=wall_time, step=0, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        ),
    ]


def _frame(data: bytes) -> bytes:
    """One TFRecord: length, masked crc of the length, data, masked crc of the data."""
    header = struct.pack("<Q", len(data))
    return header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))


def event_files(run_dir: Path) -> list[Path]:
    return sorted(p for p in Path(run_dir).glob(EVENT_GLOB) if p.is_file())


def _old_wall_times(run_dir: Path) -> dict[int, float]:
    """step -> wall time of the scalar events already in the run's event files (kept across a resume)."""
    out: dict[int, float] = {}
    for f in event_files(run_dir):
        try:
            for ev in EventFileLoader(str(f)).Load():
                if ev.HasField("summary") and ev.step not in out:
                    out[ev.step] = ev.wall_time
        except (OSError, OpError, DecodeError):  # a damaged file: only its wall times (cosmetic) are lost
            continue
    return out


def _replace_events(run_dir: Path, events) -> Path:
    """Write `events` as the run's only event file (temp name, fsync, rename, then delete the older files)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    old = event_files(run_dir)
    while True:
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_uid)}"
        final = run_dir / name
        if not final.exists():
            break
    tmp = run_dir / f".tmp-{name.replace('tfevents', 'tb')}"  # no "tfevents" in the name: TensorBoard skips it
    with open(tmp, "wb") as f:
        for ev in events:
            f.write(_frame(ev.SerializeToString()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    for p in old:
        p.unlink(missing_ok=True)
    return final


# ----------------------------------------------------------------------------- writers


class RunLog:
    """The event file of one training run; `write(record)` appends a metrics record as scalars."""

    def __init__(self, run_dir: Path, history: Iterable[dict[str, Any]], hparams: dict[str, Any]):
        self.run_dir = Path(run_dir)
        kept = _old_wall_times(self.run_dir)
        now = time.time()
        events = _header_events(now) + [_hparams_event(hparams, now)]
        for r in history:
            values = scalars(r)
            if values:
                events.append(_scalar_event(r.get("step", 0), kept.get(int(r.get("step", 0)), now), values))
        self.path = _replace_events(self.run_dir, events)
        self._f = open(self.path, "ab")

    def write(self, record: dict[str, Any]) -> None:
        values = scalars(record)
        if values and self._f is not None:
            self._f.write(_frame(_scalar_event(record.get("step", 0), time.time(), values).SerializeToString()))
            self._f.flush()  # a watching TensorBoard sees each logged step as it comes

    def close(self) -> None:
        if self._f is not None:
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            self._f = None


class _Off:
    """Ranks other than 0 under msrun write nothing."""

    def write(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


def open_run(
    run_dir: Path, history: Iterable[dict[str, Any]], meta: dict[str, Any] | None = None, *, enabled: bool = True
) -> RunLog | _Off:
    """The run's event file, rewritten to hold exactly `history` (the records metrics.jsonl kept)."""
    if not enabled:
        return _Off()
    return RunLog(Path(run_dir), list(history), run_hparams(Path(run_dir), meta))


def write_eval(run_dir: Path, scores: dict[str, Any], *, step: int = 0, hparams: dict[str, Any] | None = None) -> Path:
    """One event file of eval scores: tag `eval/<name>` for each finite number in `scores`, at `step`."""
    now = time.time()
    values = {
        f"eval/{k}": float(v)
        for k, v in scores.items()
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))
    }
    hp = {"run": f"{Path(run_dir).parent.name}/{Path(run_dir).name}", **flatten(hparams or {})}
    return _replace_events(
        Path(run_dir), _header_events(now) + [_hparams_event(hp, now), _scalar_event(step, now, values)]
    )


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard's EventAccumulator reads the run dir (tests, reports)."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


__all__ = ["open_run", "write_eval", "read_scalars", "RunLog", "scalars", "tag_of", "run_hparams", "event_files"]
