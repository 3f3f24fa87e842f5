"""Sizes as people write them: `parse_bytes("32GiB")`, `"80GB"`, `"512MiB"`, `"8MiB"`, or plain bytes.

    parse_bytes("1.5GiB")  -> 1610612736
    parse_bytes("512MB")   -> 512000000

Here, below the CLI, because the command line's argparse types (`plan --device-memory`, `serve --max-body-size`)
parse sizes without importing the training room (tasks/cli imports neither tasks.training nor model).
"""

from __future__ import annotations

GiB = 2**30
MiB = 2**20
_UNITS = (("gib", GiB), ("gb", 10**9), ("mib", MiB), ("mb", 10**6), ("g", GiB), ("m", MiB))


def parse_bytes(text: str) -> int:
    """Bytes in `text`: a number with an optional unit (GiB, GB, MiB, MB; g and m are GiB and MiB), case and
    spaces ignored. ValueError for what is no number; OverflowError for an infinite one."""
    t = text.strip().lower().replace(" ", "")
    for suffix, factor in _UNITS:
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * factor)
    return int(float(t))
