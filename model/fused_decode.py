"""The fused decode kernels (model/decode_kernel.cc) for model/generate.py's Generator: the whole-model steps called
through ctypes on the calling thread, and the prefill graph's per-layer attention as a MindSpore custom op:

    lib = build_decode_kernel(fused=True)       # the compiled library, or None (decision, no g++, failed build)
    step = FusedDecodeStep(decoder, lib, decode_threads())                 # one token through the whole model
    chunk = FusedDecodeStep(decoder, lib, threads, prefill=True)          # a prompt chunk through the whole model
    logits = step(np.array([[token]], np.int32), np.array([pos], np.int32))   # [1, V], numpy
    attn = chunk_attention_op(lib)              # RoPE + cache write + attention of one layer (CachedDecoder's chunk
    graph) decode_kernel_path() # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>"

Whether they run is model.kernels.off_reason(..., kind="decode"): eval.fused_kernels, MSLLM_FUSED_DECODE and
MSLLM_FUSED_KERNELS. The steps read the net's own Parameters and write the caches in place.
"""

from __future__ import annotations

import ctypes
import os
import threading

import mindspore as ms
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from mindspore import nn, ops
from mindspore.ops import signature as sig

from model.kernel_build import DECODE_SOURCE, build, kernel_path
from model.kernel_ops import KernelShapeError, dtype_of
from model.kernels import off_reason
from model.layers import parameter_over, untouched_zeros


class DecodeError(RuntimeError):
    """The decode path chosen when the Generator was built failed in the middle of a sequence. Never answered by a
    silent switch to a slower path (the speed measured would not be the speed served): the message names the path,
    the position and the way to choose another path (MSLLM_FUSED_DECODE=0 decodes on MindSpore's kernels)."""


def build_decode_kernel(fused: bool = True) -> str | None:
    """Path of the compiled fused decode step (model/decode_kernel.cc, OpenMP where the compiler has it),
    built once per source, compiler and ISA level by `model.kernel_build.build`; None where it cannot be used:
    the decision `model.kernels.enabled(fused, kind="decode")` says no (eval.fused_kernels false,
    MSLLM_FUSED_DECODE=0 or MSLLM_FUSED_KERNELS=0), no g++, or a failed build. Callers then decode with
    `CachedDecoder` (MindSpore kernels): the same tokens, slower. `decode_kernel_path()` says which."""
    if decode_disabled_reason(fused):
        return None
    return build(DECODE_SOURCE, openmp=True)


def decode_disabled_reason(fused: bool = True) -> str:
    """Why the fused decode step is off ('' when asked for): `model.kernels.off_reason(..., kind="decode")`."""
    return off_reason(fused, kind="decode")


def decode_kernel_path(fused: bool = True) -> str:
    """Which body of the fused decode step runs: "avx512", "avx2", "neon", "scalar", or "off: <why>"."""
    if off := decode_disabled_reason(fused):
        return f"off: {off}"
    return kernel_path(DECODE_SOURCE, openmp=True)


def decode_threads() -> int:
    """Threads of the fused decode step: $MSLLM_DECODE_THREADS, else the cores this process may use (at most 8)."""
    env = os.environ.get("MSLLM_DECODE_THREADS")
    if env:
        return max(1, int(env))
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:
        n = os.cpu_count() or 1
    return max(1, min(n, 8))


def is_matrix(i: int, n_layers: int) -> bool:
    """Whether whole-model operand `i` is a weight matrix (embedding, LM head, a layer's q k v o gate up down): the
    operands `DecodeWeights` may hold in float16 (model/decode_kernel.cc `is_matrix`)."""
    if i in (3, 5):
        return True
    return 8 <= i < 8 + 9 * n_layers and (i - 8) % 9 not in (0, 5)


def _decode_dtypes(*dtypes):
    """The whole-model steps' dtype check, by operand (the kernel checks again): token and position int32, the weight
    matrices all float32, all float16 or all Q8_0 blocks (uint8), the rest float32."""
    n_layers = (len(dtypes) - 8) // 11
    matrices = dtype_of(dtypes[3]) if dtype_of(dtypes[3]) in (ms.float16, ms.uint8) else ms.float32
    for i, t in enumerate(dtypes):
        want = ms.int32 if i < 2 else matrices if is_matrix(i, n_layers) else ms.float32
        if dtype_of(t) != want:
            raise KernelShapeError(
                f"fused kernel DecodeStep: operand {i} must be {want}, got {dtype_of(t)} "
                f"(fp32, fp16 or Q8_0 (uint8) weight matrices, fp32 norms and caches, int32 token/position)"
            )
    return ms.float32


def _logit_rows(name: str, shapes) -> int:
    """Rows of a whole-model op's logits: one per token (ScoreStep's chunk, BatchDecodeStep's sequences), one per
    prompt of PackedPrefillStep's table, else one."""
    if name in ("ScoreStep", "BatchDecodeStep"):
        return shapes[0][-1]
    return shapes[1][0] if name == "PackedPrefillStep" else 1


def chunk_attention_op(lib: str):
    """The ChunkAttention custom op (model/decode_kernel.cc): (q [T, nh*hd], k, v [T, n_kv*hd] before RoPE, start
    int32, cos, sin [S_rope, hd], k cache, v cache [n_kv, S, hd], consts [scale, threads]) -> [T, nh*hd]. It writes
    the chunk's RoPE'd k and its v into the caches at slots start.. (declared RW_WRITE + side_effect_mem on them,
    as `_decode_op`), then query i attends slots 0..start+i. Shapes and dtypes are checked when the graph is
    inferred (the kernel checks again)."""

    def shape(q, k, v, start, cos, sin, kc, vc, consts):
        if (
            len(q) != 2
            or len(kc) != 3
            or list(kc) != list(vc)
            or q[1] % kc[2]
            or (q[1] // kc[2]) % kc[0]
            or list(k) != [q[0], kc[0] * kc[2]]
            or list(v) != list(k)
        ):
            raise KernelShapeError(
                f"fused kernel ChunkAttention: q [T, heads * head_dim], k and v [T, n_kv * head_dim]"
                f" and caches [n_kv, S, head_dim] expected, got {list(q)}, {list(k)}, {list(v)},"
                f" {list(kc)}, {list(vc)}"
            )
        return list(q)

    def dtype(*dtypes):
        for i, t in enumerate(dtypes):
            want = ms.int32 if i == 3 else ms.float32
            if dtype_of(t) != want:
                raise KernelShapeError(f"fused kernel ChunkAttention: operand {i} must be {want}, got {dtype_of(t)}")
        return ms.float32

    class ChunkAttention(ops.Custom):
        __mindspore_signature__ = tuple(
            sig.make_sig(f"x{i}", sig.sig_rw.RW_WRITE if i in (6, 7) else sig.sig_rw.RW_READ) for i in range(9)
        )

        def __init__(self):
            super().__init__(f"{lib}:ChunkAttention", out_shape=shape, out_dtype=dtype, func_type="aot")
            self.add_prim_attr("side_effect_mem", True)

    return ChunkAttention()


WEIGHT_FORMATS = ("fp32", "fp16", "q8_0")
"""How the fused decode and prefill steps read the weight matrices: the network's own float32 Parameters, IEEE
binary16 copies (`DecodeWeights`: GGUF's F16, half the bytes per token; fp16 rather than bf16 because it keeps 3 more
mantissa bits, GGUF F16 files hold it bit for bit, and every AVX2 CPU widens it in one instruction, F16C), or GGUF's
Q8_0 blocks (32 int8 weights and one binary16 scale: 1.06 bytes a weight), quantized by gguf-py's reference
quantizer (llama.cpp's `quantize_row_q8_0_ref`), so the blocks equal a Q8_0 GGUF file's."""


def q8_0_blocks(w: np.ndarray) -> np.ndarray:
    """A float32 matrix [rows, n] (n a multiple of 32) as Q8_0 blocks, uint8 [rows, n / 32 * 34] (ggml's layout)."""
    if w.ndim != 2 or w.shape[1] % 32:
        raise ValueError(f"Q8_0 weights need rows of a multiple of 32 weights, got a matrix of shape {list(w.shape)}")
    return quantize(np.ascontiguousarray(w, np.float32), GGMLQuantizationType.Q8_0)


def matrix_names(net) -> list[str]:
    """The Parameter names of `net`'s weight matrices in `DecodeWeights`' order: the embedding, the LM head (when not
    tied), then each layer's q k v o gate up down."""
    names = [net.embed_tokens.weight.name] + ([] if net.tie_embeddings else [net.lm_head.weight.name])
    for layer in net.layers:
        a, m = layer.self_attn, layer.mlp
        names += [w.weight.name for w in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)]
    return names


def stored_matrix(w: np.ndarray, dtype: str) -> np.ndarray:
    """A float32 weight matrix in a stored format: binary16 ("fp16") or Q8_0 blocks ("q8_0", `q8_0_blocks`)."""
    if dtype not in WEIGHT_FORMATS[1:]:
        raise ValueError(f"decode weights: {dtype!r} is not a stored format (one of {WEIGHT_FORMATS[1:]})")
    return w.astype(np.float16) if dtype == "fp16" else q8_0_blocks(w)


def stored_shape(shape: tuple[int, ...], dtype: str) -> tuple[int, ...]:
    """The shape a [rows, n] float32 matrix has in `dtype` (Q8_0: n / 32 blocks of 34 bytes per row)."""
    return tuple(shape) if dtype == "fp16" else (shape[0], shape[1] // 32 * 34)


def stored_format_misfit(config, dtype: str) -> str:
    """Why a model of `config` cannot hold its matrices in `dtype` ('' when it can): Q8_0 needs rows of a multiple of
    32 weights (the hidden size, the MLP width and the attention width)."""
    if dtype != "q8_0":
        return ""
    widths = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size}  # q/o: hidden too
    bad = [f"{k} {v}" for k, v in widths.items() if v % 32]
    return f"Q8_0 rows need a multiple of 32 weights ({', '.join(bad)})" if bad else ""


class DecodeWeights(nn.Cell):
    """The weight matrices of `net` (embedding, LM head, each layer's q k v o gate up down) as float16 Parameters or
    Q8_0 blocks (uint8), in the fused op's operand order; the norms stay the net's float32 ones. A copy: taken when
    the Generator is built (weights changed in place later, as LoRA merges do, are not seen; the Generator is rebuilt
    after a merge). `stored`: the matrices already in `dtype`, by the net's Parameter names (moved in, popped from
    the dict): a network loaded with only them (tasks/modeling/build.py `load_network(..., weights=)`), whose own
    matrices are placeholders never allocated."""

    def __init__(self, net, dtype: str = "fp16", stored: dict[str, np.ndarray] | None = None):
        super().__init__()
        if dtype not in WEIGHT_FORMATS[1:]:
            raise ValueError(f"decode weights: {dtype!r} is not a stored format (one of {WEIGHT_FORMATS[1:]})")
        self.dtype = dtype

        def half(p):
            data = np.ascontiguousarray(stored.pop(p.name) if stored is not None else stored_matrix(p.asnumpy(), dtype))
            return parameter_over(data, f"decode_{dtype}.{p.name}")  # held once while they load

        self.embed = half(net.embed_tokens.weight)
        self.head = self.embed if net.tie_embeddings else half(net.lm_head.weight)
        mats = []
        for layer in net.layers:
            a, m = layer.self_attn, layer.mlp
            mats += [
                half(w.weight) for w in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
            ]
        self.mats = ms.ParameterTuple(mats)

    def nbytes(self) -> int:
        seen = {id(self.embed): self.embed, id(self.head): self.head, **{id(p): p for p in self.mats}}
        return sum(int(np.prod(p.shape)) * (2 if self.dtype == "fp16" else 1) for p in seen.values())


def zero_cache(shape: tuple[int, ...], name: str) -> ms.Parameter:
    """A float32 cache Parameter of zeros whose pages are only made resident as they are written
    (model/layers.py `untouched_zeros`: calloc from a worker thread's arena, where the server loads its model,
    cleared the pages and made them all resident; `Parameter(Tensor(array))` would copy, touching every page: a
    8192-slot KV cache of SmolLM2-135M is 0.38 GB whatever the prompt)."""
    return untouched_zeros(shape, name)


class SlotCaches(nn.Cell):
    """KV caches for `slots` sequences decoded together (`BatchDecodeStep`, continuous batching): per layer a K and
    a V cache [slots, nkv, S, hd], slot s holding one sequence's positions 0..S-1. The same attributes as
    `CachedDecoder` (`net`, `k_cache`, `v_cache`), so `FusedDecodeStep` takes either. Pages are resident only once
    written (`zero_cache`): the memory follows the positions the sequences reach, not slots x S."""

    def __init__(self, net, slots: int, max_len: int):
        super().__init__()
        c = net.config
        object.__setattr__(self, "net", net)
        self.slots, self.max_len = slots, max_len
        shape = (slots, c.num_kv_heads, max_len, c.head_dim)
        self.k_cache = ms.ParameterTuple([zero_cache(shape, f"slot_k_cache.{i}") for i in range(c.num_layers)])
        self.v_cache = ms.ParameterTuple([zero_cache(shape, f"slot_v_cache.{i}") for i in range(c.num_layers)])


def decode_weights_for(net, weights: str, lib: str | None, path_reason: str) -> tuple[DecodeWeights | None, bool, str]:
    """The fused steps' weight matrices for a Generator of `net` in `weights`: (the matrices, None for the net's own
    fp32 ones; whether the net holds only them, its own matrices placeholders (`load_network(..., weights=)`); what
    the decode reason adds). A stored format needs the fused kernel (`lib`), and Q8_0 rows of a multiple of 32
    weights: without them the weights stay fp32 and the reason says why. A net holding only one stored format runs
    in that format only (DecodeError otherwise)."""
    stored = getattr(net, "stored_weights", None)
    if stored is not None:
        if weights != stored.dtype or lib is None:
            raise DecodeError(
                f"this network holds only {stored.dtype} weight matrices (load_network(..., weights="
                f"{stored.dtype!r})): only the fused steps in that format run it, "
                + (f"so decode with weights={stored.dtype!r}" if lib is not None else f"and {path_reason}")
            )
        return stored, True, f", {stored.dtype} weight matrices only ({stored.nbytes() / 1e6:.0f} MB)"
    if weights == "fp32":
        return None, False, ""
    if lib is None:
        return None, False, f"; {weights} weights need it, so the weights stay fp32"
    try:
        store = DecodeWeights(net, weights)
    except ValueError as exc:
        return None, False, f"; {weights} weights do not fit this model ({exc}), so the weights stay fp32"
    return store, False, f", {weights} weight matrices ({store.nbytes() / 1e6:.0f} MB)"


KERNEL_CODES = {
    1: "the operand count",
    2: "an operand's dtype",
    3: "an operand's shape",
    4: "a token, position or slot out of range",
}
"""What a whole-model step's nonzero return code names (model/decode_kernel.cc checks before it reads anything)."""

_DTYPE_NAMES = {ms.float32: b"float32", ms.float16: b"float16", ms.uint8: b"uint8", ms.int32: b"int32"}


class FusedDecodeStep:
    """One decode token (batch 1, T = 1) of a `CachedDecoder` through ONE call of model/decode_kernel.cc's
    `DecodeStep`; with `prefill=True`, a prompt chunk (batch 1, T tokens) the same way (`PrefillStep`).

    Called on the calling thread through ctypes (`step(a, b)`, numpy int32 operands, numpy float32 logits out; the
    GIL is released meanwhile), the thread taking its share of the kernel's pool as thread 0. Not as a MindSpore
    custom op: PyNative and graph calls both ran the op on MindSpore's actor thread while the Python thread slept
    until its result, and each token's wake-up of that thread then waited behind whatever held its core: beside one
    `nice -n 19` busy loop the op lost 34-43% of its speed, the same kernel called here 4-7% (docs/KERNELS.md).
    The step reads the net's own Parameters in place (their addresses, `Parameter.data_ptr()`, taken by `bind()` when
    a sequence starts: nothing is copied, so weights updated in place reach the next sequence; a graph's updates
    land in the same memory, docs/MINDSPORE_CPU.md) and writes the tokens' K/V into the decoder's cache Parameters.

    `step(token [1, 1], [pos])` returns the logits [1, V] of position pos; prefill: `step(tokens [1, T], [start,
    last])` writes slots start..start+T-1 and returns the logits [1, V] of row `last`; with `score=True`, every
    row's, [T, V] (`Generator.score`). Over `SlotCaches`: prefill and score take [start, last, slot]; `batch=True` is
    `BatchDecodeStep`, `step(tokens [B], [B, 2] of (slot, position))` -> [B, V] (`BatchDecoder`); `packed=True` is
    `PackedPrefillStep`, `step(tokens [1, P], [K, 3] of (slot, start, n))` -> [K, V]: several prompts in one pass,
    the logits after each one's last token (`BatchDecoder.prefill_many`). A nonzero return code raises RuntimeError
    naming it (`KERNEL_CODES`).
    One kernel call per token (or chunk) instead of ~280 MindSpore kernels, with AVX-512/AVX2 GEMVs (GEMMs for a
    chunk) on the kernel's own thread pool, and no graph whose buffers live as long as the process: the 64-token
    chunk graph of `CachedDecoder` keeps ~0.5 GB at SmolLM2-135M (docs/MEMORY.md).
    """

    def __init__(
        self,
        decoder,
        lib: str,
        threads: int,
        prefill: bool = False,
        weights: DecodeWeights | None = None,
        score: bool = False,
        batch: bool = False,
        packed: bool = False,
    ):
        net = decoder.net
        self.weights = weights  # None: the net's own float32 matrices
        c = net.config
        self.net, self.decoder, self.vocab = net, decoder, c.vocab_size
        scale = net.layers[0].self_attn.scale
        self.consts = np.array([c.norm_eps, scale, threads], np.float32)
        self.name = (
            "BatchDecodeStep"
            if batch
            else "PackedPrefillStep"
            if packed
            else "ScoreStep"
            if score
            else "PrefillStep"
            if prefill
            else "DecodeStep"
        )
        wt = weights
        if wt is None:
            embed = net.embed_tokens.weight
            head = net.embed_tokens.weight if net.tie_embeddings else net.lm_head.weight
        else:
            embed, head = wt.embed, wt.head
        args = [embed, net.norm.weight, head, net.rope_cos, net.rope_sin]
        for i, layer in enumerate(net.layers):
            a, m = layer.self_attn, layer.mlp
            if wt is None:
                mats = [a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, a.o_proj.weight]
                mats += [m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight]
            else:
                mats = list(wt.mats[7 * i : 7 * i + 7])
            args += [layer.input_layernorm.weight] + mats[:4] + [layer.post_attention_layernorm.weight] + mats[4:]
        self.operands = tuple(args + list(decoder.k_cache) + list(decoder.v_cache))  # the op's order after consts

        dll = ctypes.CDLL(lib)
        fn = getattr(dll, self.name)
        i64p = ctypes.POINTER(ctypes.c_int64)
        fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)]
        fn.argtypes += [ctypes.POINTER(i64p), ctypes.POINTER(ctypes.c_char_p), ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        self._park = dll.DecodePoolPark
        self._park.restype = None
        n = 3 + len(self.operands) + 1  # a, b, consts, the operands, the logits
        self._fn, self._n = fn, n
        self._ptrs = (ctypes.c_void_p * n)()
        self._ndims = (ctypes.c_int * n)()
        self._dims = [(ctypes.c_int64 * 4)() for _ in range(n)]  # every operand has at most 3 dimensions
        self._shapes = (i64p * n)(*[ctypes.cast(d, i64p) for d in self._dims])
        self._dtypes = (ctypes.c_char_p * n)(b"int32", b"int32", b"float32", *([None] * (n - 4)), b"float32")
        self._bound = False
        self._lock = threading.Lock()  # one call at a time: the operand tables are this object's

    def bind(self) -> None:
        """Take the operands' addresses, shapes and dtypes (checked here, with a KernelShapeError naming the operand):
        when a sequence starts (`Generator`, `BatchDecoder`), so a Parameter set to new data between sequences is
        read where it now is. Costs ~0.1 ms at 30 layers."""
        with self._lock:
            _decode_dtypes(ms.int32, ms.int32, ms.float32, *(p.dtype for p in self.operands))
            self._set(2, self.consts.ctypes.data, self.consts.shape)
            for i, p in enumerate(self.operands, start=3):
                self._set(i, p.data_ptr(), p.shape)
                self._dtypes[i] = _DTYPE_NAMES[p.dtype]
            self._bound = True

    def park(self) -> None:
        """The caller's sequences are over for now: the kernel's pool threads sleep at once instead of spinning
        10 ms for a next call that is not coming (decode_kernel.cc `Pool::park`). Each sequence's end calls it
        (`Generator`, `BatchDecoder` when its last slot is released): after that spin a sequence started a moment
        later beside a `nice -n 19` process lost 25-45% of its speed, the scheduler making up to the niced process
        for the spin; parked, 0-6% (docs/KERNELS.md, "Decoding"). Never blocks; a call in flight is left alone."""
        self._park()

    def _set(self, i: int, ptr: int, shape) -> None:
        self._ptrs[i] = ptr
        self._ndims[i] = len(shape)
        for k, d in enumerate(shape):
            self._dims[i][k] = int(d)

    def __call__(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        if not self._bound:
            self.bind()
        a = np.ascontiguousarray(a, np.int32)
        b = np.ascontiguousarray(b, np.int32)
        out = np.empty((_logit_rows(self.name, [a.shape, b.shape]), self.vocab), np.float32)
        with self._lock:
            self._set(0, a.ctypes.data, a.shape)
            self._set(1, b.ctypes.data, b.shape)
            self._set(self._n - 1, out.ctypes.data, out.shape)
            rc = self._fn(self._n, self._ptrs, self._ndims, self._shapes, self._dtypes, None, None)
        if rc:
            raise RuntimeError(f"fused kernel {self.name} returned {rc}: {KERNEL_CODES.get(rc, 'unknown code')}")
        return out
