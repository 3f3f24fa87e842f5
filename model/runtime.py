"""MindSpore process setup: device, execution mode, quiet logs. Call once, before the first op."""

from __future__ import annotations

import os

_DONE = False


def setup_mindspore(device: str = "CPU", graph_mode: bool = False, seed: int | None = None) -> None:
    """Select the device and mode. Idempotent within a process (MindSpore's context is process-global).

    graph_mode=True switches the whole process to GRAPH_MODE; training compiles its step
    with `mindspore.jit` either way, so most callers keep the default PYNATIVE context.
    """
    global _DONE
    os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ logs: errors only
    import mindspore as ms

    if not _DONE:
        ms.set_device(device)
        _DONE = True
    ms.set_context(mode=ms.GRAPH_MODE if graph_mode else ms.PYNATIVE_MODE)
    if seed is not None:
        ms.set_seed(seed)
