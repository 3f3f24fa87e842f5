"""Progress bars on stderr that stay readable in a log file.

    with progress_bar(total=300, desc="train", unit="step", enabled=True) as bar: bar.update(1)

On a terminal: tqdm as usual. Where stderr is not a terminal (`demo.sh > log`, Prefect's
log capture, a worker's output) tqdm cannot redraw in place and writes every refresh as a new
`\\r` line, so there it refreshes at most every 30 s: a few lines per stage, not one per batch.
"""

from __future__ import annotations

import sys

NON_TTY_INTERVAL_S = 30.0


def progress_bar(
    iterable=None,
    *,
    total: int | None = None,
    desc: str,
    enabled: bool = True,
    unit: str = "it",
    initial: int = 0,
    unit_scale: bool = False,
    leave: bool = False,
):
    from tqdm import tqdm  # lazy: ~40 ms; stage modules import this (via the data plan, training/metrics.py)

    interactive = sys.stderr.isatty()
    return tqdm(
        iterable,
        total=total,
        desc=desc,
        unit=unit,
        unit_scale=unit_scale,
        initial=initial,
        disable=not enabled,
        file=sys.stderr,
        leave=leave,
        dynamic_ncols=interactive,
        mininterval=0.5 if interactive else NON_TTY_INTERVAL_S,
        maxinterval=10.0 if interactive else 10 * NON_TTY_INTERVAL_S,
    )
