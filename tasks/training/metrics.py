"""What a run leaves beside its checkpoints: metrics.jsonl (read back on resume; a line torn by a kill is
dropped), the log lines and progress bar, and the loss curve that goes into the artifact."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tasks.runtime.progress import progress_bar
from tasks.store.disk import atomic_write_bytes

if TYPE_CHECKING:
    from tasks.training.outcome import FitResult


def format_record(r: dict[str, Any], max_steps: int) -> str:
    parts = [f"step {r['step']:>5}/{max_steps}", f"loss {r['loss']:.4f}"]
    if "lr" in r:
        parts.append(f"lr {r['lr']:.2e}")
    if "grad_norm" in r:
        parts += [
            f"gnorm {r['grad_norm']:.3f}",
            f"{r['tokens_per_s']:.0f} tok/s",
            f"MFU {100 * r['mfu']:.1f}%",
            f"rss {r['peak_rss_bytes'] / 2**30:.2f} GiB",
            f"eta {r['eta_s']:.0f}s",
        ]
    if "val_loss" in r:
        parts.append(f"val_loss {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
    return "[train] " + " | ".join(parts)


class NoBar:
    def update(self, n):  # noqa: D401
        pass

    def set_postfix(self, **kw):
        pass

    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def close(self):
        pass


def progress(enabled: bool, max_steps: int, initial: int):
    if not enabled:
        return NoBar()
    return progress_bar(total=max_steps, initial=initial, desc="train", unit="step", leave=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics file; a line torn by a kill (-9, power loss) mid-write is dropped, not fatal."""
    if not path.is_file():
        return []
    rows, torn = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            torn += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
    if torn:
        print(f"[train] {path}: dropped {torn} partial line(s) left by an interrupted run", file=sys.stderr)
    return rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    atomic_write_bytes(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def add_run_files(out_dir: Path, run_dir: Path, result: FitResult, title: str) -> None:
    """Put the run's metrics.jsonl and its loss curve into the artifact being built (pretrain and finetune)."""
    shutil.copy2(run_dir / "metrics.jsonl", out_dir / "metrics.jsonl")
    plot_loss_curve(result.history, out_dir / "loss_curve.png", title)


def plot_loss_curve(history: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib  # lazy: ~0.4 s with pyplot, and the backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    tr = [(r["step"], r["loss"]) for r in history if "loss" in r and math.isfinite(r["loss"])]
    va = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="train loss")
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
