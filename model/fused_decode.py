"""The fused decode kernels (model/decode_kernel.cc) as MindSpore custom ops, for model/generate.py's Generator:

    lib = build_decode_kernel(fused=True)       # the compiled library, or None (decision, no g++, failed build)
    step = FusedDecodeStep(decoder, lib, decode_threads())                 # one token through the whole model
    chunk = FusedDecodeStep(decoder, lib, threads, prefill=True)          # a prompt chunk through the whole model
    attn = chunk_attention_op(lib)              # RoPE + cache write + attention of one layer (CachedDecoder's chunk
    graph) decode_kernel_path() # "avx512" / "avx2" / "neon" / "scalar", or "off: <why>"

Whether they run is model.kernels.off_reason(..., kind="decode"): eval.fused_kernels, MSLLM_FUSED_DECODE and
MSLLM_FUSED_KERNELS. The ops read the net's own Parameters and write the caches in place.
"""

from __future__ import annotations

import os

import mindspore as ms
import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from mindspore import Tensor, nn, ops
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
    """The decode op's dtype check (the kernel checks again): token and position int32, the weight matrices all
    float32 or all float16, the rest float32."""
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


def _decode_op(lib: str, vocab: int, n_layers: int, name: str = "DecodeStep"):
    """A whole-model custom op of model/decode_kernel.cc: `DecodeStep` (one token), `PrefillStep` (a prompt chunk),
    `ScoreStep` (a chunk, every row's logits), `BatchDecodeStep` or `PackedPrefillStep` (several prompts), declared
    as writing its 2 * n_layers cache inputs (RW_WRITE, side_effect_mem, as model/kernel_ops.py's in-place ops): so
    a graph never hands the kernel a copy of a cache Parameter, and the write is ordered after any earlier read of
    it. They return the logits [1, V] (PrefillStep: of the chunk's row `last`; ScoreStep: [T, V]; BatchDecodeStep:
    [B, V]; PackedPrefillStep: [K, V], each prompt's last row)."""
    n_in = 8 + 11 * n_layers
    writes = range(8 + 9 * n_layers, n_in)

    class WholeModelStep(ops.Custom):
        __mindspore_signature__ = tuple(
            sig.make_sig(f"x{i}", sig.sig_rw.RW_WRITE if i in writes else sig.sig_rw.RW_READ) for i in range(n_in)
        )

        def __init__(self):
            super().__init__(
                f"{lib}:{name}",
                out_shape=lambda *shapes: [_logit_rows(name, shapes), vocab],
                out_dtype=_decode_dtypes,
                func_type="aot",
            )
            self.add_prim_attr("side_effect_mem", True)

    return WholeModelStep()


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


class FusedDecodeStep(nn.Cell):
    """One decode token (batch 1, T = 1) of a `CachedDecoder` as ONE MindSpore custom op (model/decode_kernel.cc);
    with `prefill=True`, a prompt chunk (batch 1, T tokens) the same way (`PrefillStep`).

    The op reads the net's own Parameters (nothing is copied, so weights updated in place reach the
    next step, as on every jit path) and writes the tokens' K/V into the decoder's cache Parameters in
    place. `construct(token [1, 1] int32, pos int32)` returns the logits [1, V] of position pos;
    prefill: `construct(tokens [1, T] int32, [start, last] int32)` writes slots start..start+T-1 and returns the
    logits of row `last`; with `score=True`, the logits of every row, [T, V] (`Generator.score`). Over `SlotCaches`:
    prefill and score take [start, last, slot]; `batch=True` is `BatchDecodeStep`, `construct(tokens [B] int32,
    [B, 2] int32 of (slot, position))` -> logits [B, V] (`BatchDecoder`); `packed=True` is `PackedPrefillStep`,
    `construct(tokens [1, P] int32, [K, 3] int32 of (slot, start, n))` -> [K, V]: several prompts in one pass, the
    logits after each one's last token (`BatchDecoder.prefill_many`).
    One kernel per token (or chunk) instead of ~280 MindSpore kernels, with AVX-512/AVX2
    GEMVs (GEMMs for a chunk) on the kernel's own thread pool,
    and no graph whose buffers live as long as the process: the
    64-token chunk graph of `CachedDecoder` keeps ~0.5 GB at SmolLM2-135M (docs/MEMORY.md).
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
        super().__init__()
        net = decoder.net
        self.weights = weights  # None: the net's own float32 matrices
        c = net.config
        object.__setattr__(self, "net", net)
        object.__setattr__(self, "decoder", decoder)
        v = c.vocab_size
        scale = net.layers[0].self_attn.scale
        self.consts = Tensor(np.array([c.norm_eps, scale, threads], np.float32))
        name = (
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
        self.op = _decode_op(lib, v, len(net.layers), name)

        # The operands after the token, the position and consts, in the op's order, gathered here once: a construct
        # that walked the net's layers to collect them took 4.4 s and 0.45 GB to compile at 30 layers (0.15 s as a
        # flat tuple: MindSpore parses every Cell attribute path it meets, per layer)
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
        args += list(decoder.k_cache) + list(decoder.v_cache)
        object.__setattr__(self, "operands", tuple(args))  # not registered: the Parameters stay their owners'

    def construct(self, token: Tensor, pos: Tensor) -> Tensor:
        return self.op(token, pos, self.consts, *self.operands)
