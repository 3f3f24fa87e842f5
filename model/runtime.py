"""MindSpore process setup: device, execution mode, quiet logs. Call once, before the first op.

MindSpore loads inside these functions only (lazy): stage modules import `setup_mindspore` at their top and their
parent side stays MindSpore-free, and GLOG_v must be set before MindSpore first loads.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import sys

from model.kernel_build import SPIN_SOURCE, build_kernel

_DONE = False
SPIN_WAIT = "not set up"  # how MindSpore's thread pool waits in this process: spin_waits()
_spin_lib = None


def setup_mindspore(
    device: str = "CPU", graph_mode: bool = False, seed: int | None = None, host_blocking: bool = True
) -> None:
    """Select the device and mode. Idempotent within a process (MindSpore's context is process-global).

    graph_mode=True switches the whole process to GRAPH_MODE; training compiles its step
    with `mindspore.jit` either way, so most callers keep the default PYNATIVE context.

    host_blocking=True (the default; every process of the pipeline, training and inference): each graph call runs on
    the calling thread instead of being queued to MindSpore's host pipeline, whose waits (`asnumpy()` of a queued
    result) busy-loop the caller on a core the kernels need (docs/MINDSPORE_CPU.md, "Threads"): the fused decode
    step's two spinning threads and that caller on 2 cores ran the op at 64-95 tokens/s (SmolLM2-135M, Q8_0, called in
    a loop), blocking at 147-254. MindSpore reads MS_DEV_HOST_BLOCKING_RUN once, at its first queued task: call this
    before any op. An MS_DEV_HOST_BLOCKING_RUN already in the environment wins (0 queues).
    """
    global _DONE
    os.environ.setdefault("GLOG_v", "3")  # MindSpore's C++ logs: errors only
    if host_blocking:
        os.environ.setdefault("MS_DEV_HOST_BLOCKING_RUN", "1")
    import mindspore as ms

    if not _DONE:
        ms.set_device(device)
        global SPIN_WAIT
        SPIN_WAIT = spin_waits()
        _DONE = True
    ms.set_context(mode=ms.GRAPH_MODE if graph_mode else ms.PYNATIVE_MODE)
    if seed is not None:
        ms.set_seed(seed)


# the libraries whose thread pools wait by yielding: MindSpore's, and NumPy's OpenBLAS (its worker threads and the
# caller waiting on them loop on sched_yield too; the one-layer-at-a-time step's host work calls it: np.dot norms)
SPIN_LIBRARIES = ("/mindspore/lib/", "/numpy.libs/")


def spin_waits() -> str:
    """Make MindSpore's thread pool spin while it waits instead of calling sched_yield (model/spin_wait.cc: each
    `sched_yield` import of the libraries under mindspore/lib/, and of NumPy's OpenBLAS under numpy.libs/, is pointed
    at a short run of the CPU's pause hint).
    On Linux's EEVDF scheduler a thread that yields in a loop hands its core to any other runnable task, a
    `nice -n 19` one included, for a whole slice: beside one niced busy loop the train step ran at half speed
    (tiny-llama-bench, AMD EPYC, 2 threads: 0.23 -> 0.47 s; PyTorch's -1.5%), with the patch at its quiet speed
    (docs/MINDSPORE_CPU.md, "Threads"). Returns what runs, for logs and bench lines: "spin (N imports in M
    libraries)" or "yield: <why not>" (MSLLM_SPIN_WAIT=0, no compiler, a slot that could not be written)."""
    global _spin_lib
    if os.environ.get("MSLLM_SPIN_WAIT", "1") == "0":
        return "yield: MSLLM_SPIN_WAIT=0"
    built = build_kernel(SPIN_SOURCE, say=False)
    if built.lib is None:
        return f"yield: {built.reason}"
    lib = ctypes.CDLL(built.lib)
    lib.msllm_patch_yield.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
    slots, n_libs = 0, 0
    for where in SPIN_LIBRARIES:
        libraries = ctypes.c_int()
        got = lib.msllm_patch_yield(where.encode(), ctypes.byref(libraries))
        slots, n_libs = (-1 if got < 0 or slots < 0 else slots + got), n_libs + libraries.value
    _spin_lib = lib  # loaded for the life of the process: the patched slots point into it
    held = _patch_spin_min(lib) if slots >= 0 else ""
    for kernel_lib in _to_lend:  # train kernels built before this patch
        lend_idle_threads(kernel_lib)
    if slots < 0:
        print(
            "[runtime] MindSpore's thread pool keeps yielding in some libraries: a sched_yield import could not be "
            "made writable (mprotect); under a background load its waits hand the core away",
            file=sys.stderr,
            flush=True,
        )
        return "yield: a sched_yield import could not be patched (mprotect failed)"
    return f"spin ({slots} sched_yield imports in {n_libs} libraries{held})" + (LENT_NOTE if _lent else "")


_lent: list = []  # the kernel libraries whose MsllmHelp the waits call (kept loaded: the hook points into them)
_to_lend: list = []  # kernel libraries built before the waits were patched
LENT_NOTE = "; waiting threads run pieces of the train kernels"  # in SPIN_WAIT (bench lines) where they do


def lend_idle_threads(kernel_lib: str) -> bool:
    """Let MindSpore's waiting pool threads run pieces of the fused train kernels (model/train_kernels.cc
    `MsllmHelp`, called from every patched wait, `spin_waits`). Inside the trainer the kernels have one thread
    (MindSpore sets OMP_NUM_THREADS=1 on 2 cores) while the pool's other thread spins beside them; with the hook
    that spinning thread takes pieces of the running kernel, so the kernel gets the second core the pool already
    holds and no thread is added (a thread of our own beside the pool lost 7-21% beside a background load:
    docs/KERNELS.md, "Threads"). False where the waits are not patched or MSLLM_KERNEL_HELPERS=0."""
    global SPIN_WAIT
    if os.environ.get("MSLLM_KERNEL_HELPERS", "1") == "0":
        return False
    if _spin_lib is None:  # not patched (yet): `spin_waits` hooks it once it patches
        if kernel_lib not in _to_lend:
            _to_lend.append(kernel_lib)
        return False
    lib = ctypes.CDLL(kernel_lib)  # the library MindSpore's custom ops loaded (dlopen hands back the same one)
    _spin_lib.msllm_set_idle_hook.argtypes = [ctypes.c_void_p]
    _spin_lib.msllm_set_idle_hook(ctypes.cast(lib.MsllmHelp, ctypes.c_void_p))
    lib.MsllmLendIdleThreads(1)
    if all(held._name != lib._name for held in _lent):
        _lent.append(lib)
    if SPIN_WAIT.startswith("spin (") and LENT_NOTE not in SPIN_WAIT:
        SPIN_WAIT += LENT_NOTE
    return True


SPIN_MIN = "_ZN9mindspore10ThreadPool20SetSpinCountMinValueEv"  # mindspore::ThreadPool::SetSpinCountMinValue()
_spin_held = False  # whether `graphs_back_to_back` holds the pool's spin-count drop (the patch is in place)


def _patch_spin_min(lib) -> str:
    """Route MindSpore's after-graph spin-count drop through model/spin_wait.cc so `graphs_back_to_back` can hold it;
    returns the bench-line note ('' where it is off or not possible: the calls then go to MindSpore's directly)."""
    global _spin_held
    if os.environ.get("MSLLM_SPIN_BETWEEN_GRAPHS", "1") == "0":
        return "; MSLLM_SPIN_BETWEEN_GRAPHS=0"
    import mindspore

    core = os.path.join(os.path.dirname(mindspore.__file__), "lib", "libmindspore_core.so")
    try:
        real = ctypes.cast(getattr(ctypes.CDLL(core), SPIN_MIN), ctypes.c_void_p).value
    except (OSError, AttributeError):  # another MindSpore build: nothing patched, its pool drops as it always did
        return ""
    lib.msllm_patch_spin_min.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p]
    slots = lib.msllm_patch_spin_min(b"/mindspore/lib/", SPIN_MIN.encode(), real)
    _spin_held = slots > 0
    return f"; held between back-to-back graphs: {slots} SetSpinCountMinValue import" if _spin_held else ""


@contextlib.contextmanager
def graphs_back_to_back():
    """Within it, MindSpore's thread pool keeps spinning between graph calls; on leaving, it drops its spin count as
    after any graph. MindSpore drops the pool's spin count to the minimum after every graph run
    (`GraphScheduler::Run` -> `ThreadPool::SetSpinCountMinValue`), so the pool's threads sleep when a graph ends and
    the next call has to wake them: the layer-at-a-time train step runs ~2L + 3 graphs a step and paid those wake-ups
    (docs/MINDSPORE_CPU.md, "Threads"). A no-op where the patch is not in place (`spin_waits`)."""
    if not _spin_held:
        yield
        return
    _spin_lib.msllm_hold_spin(1)
    try:
        yield
    finally:
        _spin_lib.msllm_hold_spin(0)


def actor_thread_branch(flag):
    """Graph code: a branch on a graph input, never taken (`flag` is a 0-d int32 0), returned as an extra output. It
    gives the graph control-flow actors, and MindSpore then runs it on its actor thread, not on the calling thread:
    a graph of at most 100 kernels without control flow runs on the caller, which hands every task of a
    multi-threaded kernel (MatMul) to the two-thread pool and spins beside it (docs/MINDSPORE_CPU.md, "Threads").
    A chain of 30 [256, 576] x [576, 576] MatMuls, 2 cores (AMD EPYC, AVX-512): 2.0 ms per MatMul without, 1.3 with.
    Plain graph code (no MindSpore import here)."""
    if flag > 0:
        flag = flag + 1
    return flag


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


def copy_cell(cell):
    """A deep copy of `cell` with Parameters of its own and its primitives shared: ops are stateless, and a custom
    kernel op (model/fused_cells.py) cannot be copied (its constructor takes other arguments than it keeps)."""
    from mindspore import ops

    memo = {}
    for _, c in cell.cells_and_names():
        for v in [*vars(c).values(), *getattr(c, "_primitives", {}).values()]:
            if isinstance(v, ops.Primitive):
                memo[id(v)] = v
    return copy.deepcopy(cell, memo)


def weight_slot(layer):
    """(template, targets, load): a copy of `layer`, or of a list of layers as a CellList (copy_cell; its Parameters
    renamed `layerwise.*`, so a graph may
    hold them beside the net's), its Parameters in order, and `load(x, ws)` for graph code: x, ordered after `ws`
    (any same-shaped layer's weights, graph inputs, in `targets`' order) are assigned into the template's
    Parameters. The assignment has to happen inside the graph that runs the template: a compiled graph does not
    see `set_data`, nor an `assign` made by another graph (docs/MINDSPORE_CPU.md, "Memory")."""
    from mindspore import nn, ops

    template = copy_cell(layer) if isinstance(layer, nn.Cell) else nn.CellList([copy_cell(c) for c in layer])
    for n, p in template.parameters_and_names():
        p.name = f"layerwise.{n}"
    targets = tuple(p for _, p in template.parameters_and_names())

    def load(x, ws):
        loaded = ()
        for target, w in zip(targets, ws):
            loaded = loaded + (ops.assign(target, w),)
        return ops.depend(x, loaded)

    return template, targets, load


def layerwise_hidden_states(net):
    """`net.hidden_states` as a callable [B, T] int32 ids -> [B, T, H] that runs the decoder ONE layer at a time
    through ONE compiled layer graph (dynamic B and T), or None where the layers differ in their parameters (an
    adapter on some layers only). The layer graph belongs to a copy of the first layer (`weight_slot`); each call
    first assigns the layer's weights (graph inputs: plain Tensors over its Parameters' memory) into the copy's,
    then runs it. A graph keeps the buffers of every kernel in it (docs/MINDSPORE_CPU.md, "Memory"), so the
    whole-model graph held all layers' activations at once (SmolLM2-135M, 2 rows of 250 tokens: +1.4 GB and 16 s to
    compile); one layer's graph holds 1/num_layers of that (+0.14 GB, 3 s; docs/MEMORY.md). The same kernels in the
    same order: the outputs equal `hidden_states`' (tests/test_eval.py). For the plain cells (load_network): the
    training build's fused cells fail in a dynamic-shape graph in MindSpore 2.10, the whole-decoder one as well."""
    import mindspore as ms

    params = [tuple(p for _, p in layer.parameters_and_names()) for layer in net.layers]
    if any(
        [(p.name.split(".", 2)[-1], p.shape, p.dtype) for p in ps]
        != [(p.name.split(".", 2)[-1], p.shape, p.dtype) for p in params[0]]
        for ps in params[1:]
    ):
        return None
    template, targets, load = weight_slot(net.layers[0])

    def prologue(net, ids):
        return net.layer_inputs(ids)

    def layer_step(layer, x, cos, sin, mask, *ws):
        return layer(load(x, ws), cos, sin, mask)

    first = dynamic_graph(net, prologue, ms.Tensor(shape=[None, None], dtype=ms.int32))
    masks = net.layers[0].self_attn.softmax.applies_mask
    hd = net.config.head_dim
    table = net.rope_cos.dtype
    step = dynamic_graph(
        template,
        layer_step,
        ms.Tensor(shape=[None, None, net.config.hidden_size], dtype=net.compute_dtype),
        ms.Tensor(shape=[None, hd], dtype=table),
        ms.Tensor(shape=[None, hd], dtype=table),
        ms.Tensor(shape=[] if masks else [None, None, None], dtype=ms.float32),
        *[ms.Tensor(shape=p.shape, dtype=p.dtype) for p in targets],
    )

    def run(ids):
        x, cos, sin, mask = first(ids)
        for ps in params:
            # plain Tensors over the Parameters' memory (asnumpy and from_numpy share it: no copy): a Parameter as
            # a graph input is keyed by its name, so each layer's would compile (and keep) a graph of its own
            x = step(x, cos, sin, mask, *(ms.Tensor.from_numpy(p.asnumpy()) for p in ps))
        return x

    return run


def hidden_states_graph(net):
    """(run, layers_held): `net.hidden_states` compiled once for every [B, T] (the eval scorer's and the server's echo
    decoder pass): one layer at a time where the layers are alike (`layerwise_hidden_states`, layers_held 1), else
    the whole decoder as one dynamic-shape graph (layers_held num_layers: every layer's activations at once)."""
    import mindspore as ms

    layerwise = layerwise_hidden_states(net)
    if layerwise is not None:
        return layerwise, 1

    def hidden(net, ids):
        return net.hidden_states(ids)

    return dynamic_graph(net, hidden, ms.Tensor(shape=[None, None], dtype=ms.int32)), net.config.num_layers


def trim_heap() -> None:
    """Hand the C heap's free pages back to the OS (glibc's `malloc_trim(0)`; a no-op where there is none).
    Compiling a MindSpore graph frees its temporaries into malloc's arenas, which keep them resident: trimming
    once after a graph's first run took the SmolLM2 decode path from 1.73 to 1.64 GB (docs/MEMORY.md)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def trim_after_first_call(fn):
    """`fn` (a `jit` function: its first call compiles the graph, then runs it) with `trim_heap` once, after that
    first call returns. The compilation's temporaries are freed into malloc's arenas, which keep them resident; a
    graph compiled later (the trainer's validation after a resume) then stacks on them. SmolLM2-135M's whole-model
    train step: 0.64 GB returned (docs/MEMORY.md "Train"). Only the first compilation: a call with new shapes compiles
    again, untrimmed."""
    done = False

    def call(*args, **kwargs):
        nonlocal done
        out = fn(*args, **kwargs)
        if not done:
            done = True
            trim_heap()
        return out

    return call
