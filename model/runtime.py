"""MindSpore process setup: device, execution mode, quiet logs. Call once, before the first op.

MindSpore loads inside these functions only (lazy): stage modules import `setup_mindspore` at their top and their
parent side stays MindSpore-free, and GLOG_v must be set before MindSpore first loads.
"""

from __future__ import annotations

import ctypes
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


def dynamic_graph(net, fn, *inputs):
    """`fn(net, *args)` as ONE compiled graph for every shape of `inputs` (Tensors whose `None` dimensions
    vary): a Cell holding `net` (parameter names unchanged) with `set_inputs(*inputs)`, under `mindspore.jit`.
    A static graph compiles again per shape and keeps each shape's buffers for the life of the process
    (docs/MINDSPORE_CPU.md, "Memory"); the eval scorer and the server's echo logits use this instead."""
    import mindspore as ms
    from mindspore import nn

    class Graph(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net = net

        def construct(self, *args):
            return fn(self.net, *args)

    graph = Graph()
    graph.set_inputs(*inputs)
    return ms.jit(graph)


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim(0)`; a no-op where there is none).
    Compiling a MindSpore graph frees its temporaries into malloc's arenas, which keep them resident: trimming
    once after a graph's first run took the SmolLM2 decode path from 1.73 to 1.64 GB (docs/MEMORY.md)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
