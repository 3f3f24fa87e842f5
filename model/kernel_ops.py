"""The native kernels as MindSpore custom ops (`ops.Custom(..., func_type="aot")`: a C++ function run inside the
compiled graph like any kernel), with their operands checked when MindSpore infers the graph.

    k = train_ops()                   # the fused train-step ops, or None: callers keep MindSpore's own ops
    probs = k.causal_softmax(scores)  # [N, T, S] -> [N, T, S]
    z = zero_ops()                    # the in-place AdamW op, or None

Every kernel checks its operands and returns a code on a mismatch (KERNEL_ERRORS); the ops below also check
shapes and dtypes at graph inference, so a wrong call fails there with a message naming the op and the
operand (KernelShapeError), before any kernel runs. Whether to ask for them at all is model/kernels.py's
`enabled`; the library comes from model/kernel_build.py.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import mindspore as ms
import numpy as np
from mindspore import ops
from mindspore.ops import signature as sig

from model.kernel_build import TRAIN_SOURCE, build, disabled_reason
from model.runtime import lend_idle_threads

KERNEL_ERRORS = {
    1: "wrong number of operands",
    2: "wrong dtype (float32 tensors, int32 labels/offsets/tokens)",
    3: "operand shapes do not match",
    4: "a token or position out of range",
}


class KernelShapeError(ValueError):
    """A fused op called with operands its kernel does not accept (raised when MindSpore infers the graph, or when a
    fused decode step takes its operands: model/fused_decode.py `FusedDecodeStep.bind`)."""


def _need(ok: bool, op: str, what: str) -> None:
    if not ok:
        raise KernelShapeError(f"fused kernel {op}: {what}")


def dtype_of(t):
    """The element dtype of what MindSpore hands a dtype function (`Tensor[Float32]` or `Float32`)."""
    return t.element_type() if hasattr(t, "element_type") else t


def _f32(op: str, names: str, dtypes) -> None:
    for n, t in zip(names.split(), dtypes):
        _need(dtype_of(t) == ms.float32, op, f"{n} must be float32, got {dtype_of(t)}")


def _check_causal(op, *shapes):
    _need(len(shapes[0]) == 3, op, f"scores must be [N, T, S], got shape {list(shapes[0])}")
    _need(
        shapes[0][1] <= shapes[0][2],
        op,
        f"T = {shapes[0][1]} queries exceed S = {shapes[0][2]} keys "
        f"(the queries are the last T of the S positions: T <= S)",
    )
    for s in shapes[1:]:
        _need(list(s) == list(shapes[0]), op, f"operands must have one shape, got {list(shapes[0])} and {list(s)}")
    return shapes[0]


def _check_same(op, *shapes):
    for s in shapes[1:]:
        _need(list(s) == list(shapes[0]), op, f"operands must have one shape, got {list(shapes[0])} and {list(s)}")
    return shapes[0]


def _check_rms(op, x, w, eps, dy=None):
    _need(len(x) >= 1 and x[-1] > 0, op, f"x must be [..., H] with H > 0, got {list(x)}")
    _need(_numel(w) == x[-1], op, f"weight must have H = {x[-1]} elements, got shape {list(w)}")
    _need(_numel(eps) == 1, op, f"eps must have one element, got shape {list(eps)}")
    if dy is not None:
        _need(list(dy) == list(x), op, f"dy must have x's shape {list(x)}, got {list(dy)}")


def _check_ce(op, x, y, *vecs):
    _need(len(x) == 2, op, f"logits must be [N, V], got {list(x)}")
    for name, s in (("labels", y), *(("row vector", v) for v in vecs)):
        _need(_numel(s) == x[0], op, f"{name} must have N = {x[0]} elements, got shape {list(s)}")


def _check_attention(op, q, k, v, *more):
    _need(len(q) == 4 and len(k) == 4, op, f"q and k must be [B, heads, T, hd], got {list(q)} and {list(k)}")
    _need(list(v) == list(k), op, f"v must have k's shape {list(k)}, got {list(v)}")
    _need(k[0] == q[0] and k[3] == q[3], op, f"k {list(k)} must have q's batch and head dim ({q[0]}, {q[3]})")
    _need(k[1] > 0 and q[1] % k[1] == 0, op, f"q's {q[1]} heads must be a multiple of k's {k[1]}")
    _need(q[2] <= k[2], op, f"T = {q[2]} queries exceed S = {k[2]} keys (the queries are the last T: T <= S)")
    if more:  # the backward's out, lse, dout
        _need(list(more[0]) == list(q) and list(more[2]) == list(q), op, "out and dout must have q's shape")
        _need(_numel(more[1]) == q[0] * q[1] * q[2], op, f"lse must be [B, heads, T], got {list(more[1])}")


def _check_rope(op, y, cos, sin, scale, tokens=False):
    """RopeHeads (y [N, n·hd] -> [N / T, n, T, hd]) or, `tokens`, RopeTokens (d [B, n, T, hd] -> [B·T, n·hd])."""
    same = len(cos) == 2 and list(sin) == list(cos)
    _need(same, op, f"cos and sin must be one [T, hd], got {list(cos)} and {list(sin)}")
    t, hd = cos
    _need(t > 0 and hd > 0 and hd % 2 == 0, op, f"cos must be [T, hd] with T > 0 and an even hd, got {list(cos)}")
    _need(_numel(scale) == 1, op, f"scale must have one element, got shape {list(scale)}")
    if tokens:
        _need(len(y) == 4 and y[2] == t and y[3] == hd, op, f"d must be [B, n, T = {t}, hd = {hd}], got {list(y)}")
    else:
        ok = len(y) == 2 and y[0] % t == 0 and y[1] % hd == 0
        _need(ok, op, f"y must be [B·T, n·hd] for T = {t}, hd = {hd}, got {list(y)}")


def _rope_heads_shape(y, cos, sin, scale):
    return [y[0] // cos[0], y[1] // cos[1], cos[0], cos[1]] if _known(y, cos) else [-1, -1, -1, -1]


def _rope_tokens_shape(d, cos, sin, scale):
    return [d[0] * d[2], d[1] * d[3]] if _known(d) else [-1, -1]


def _check_2d(op, x):
    _need(len(x) == 2, op, f"x must be 2-D [R, C], got shape {list(x)}")


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _dt_ce(op, x, y, *vecs):
    _need(dtype_of(y) == ms.int32, op, f"labels must be int32, got {dtype_of(y)}")
    _f32(op, "logits " + " ".join("vector" for _ in vecs), (x, *vecs))


def _known(*shapes) -> bool:
    """All dimensions known (a dynamic-shape graph infers -1 / -2 first: its checks wait for the real shapes)."""
    return all(isinstance(d, int) and d >= 0 for s in shapes for d in s)


def _shape_fn(op: str, check, out):
    def infer(*shapes):
        if _known(*shapes):
            check(op, *shapes)
        return out(*shapes)

    return infer


def _dtype_fn(op: str, check, out):
    def infer(*dtypes):
        check(op, *dtypes)
        return out(*dtypes)

    return infer


_train_ops: list = []  # memo of train_ops(): [] not yet asked, [None] unavailable, [ns]


def train_ops() -> SimpleNamespace | None:
    """The fused train-step ops of model/train_kernels.cc (fp32), or None where they cannot be built.

    causal_softmax(scores [N, T, S]) -> probs, queries at the last T of S key positions (T <= S);
    softmax_grad(probs, dprobs) -> dscores; swiglu(gate, up) -> silu(gate) * up;
    swiglu_grad(gate, up, dout) -> (dgate, dup); rms_norm(x [N, H], weight [H], eps [1]) -> y;
    rms_norm_grad(x, weight, eps, dy) -> (dx, dweight); cross_entropy(logits [N, V], labels [N] int32) ->
    (nll [N], logsumexp [N]); cross_entropy_grad(logits, labels, logsumexp, dnll) -> dlogits;
    transpose(x [R, C]) -> [C, R]; rope_heads(y [B·T, n·hd], cos [T, hd], sin [T, hd], scale [1]) -> [B, n, T, hd]
    (to heads, RoPE'd, scaled) and rope_tokens(d [B, n, T, hd], cos, sin, scale) -> [B·T, n·hd] (its transpose);
    causal_attention(q [B, nh, T, hd] (scaled), k, v [B, nkv, S, hd]) ->
    (out [B, nh, T, hd], lse [B, nh, T]); causal_attention_grad(q, k, v, out, lse, dout) -> (dq, dk, dv).
    Operands are checked when the graph is inferred (KernelShapeError) and again by the kernel.
    """
    if _train_ops:
        return _train_ops[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:
        lend_idle_threads(lib)  # MindSpore's waiting pool thread takes pieces of these kernels

        def op(name, shape_check, shape_out, dtype_names, dtype_out):
            def dt_check(op_name, *dts):
                _f32(op_name, dtype_names, dts)

            return ops.Custom(
                f"{lib}:{name}",
                out_shape=_shape_fn(name, shape_check, shape_out),
                out_dtype=_dtype_fn(name, dt_check, dtype_out),
                func_type="aot",
            )

        ns = SimpleNamespace(
            lib=lib,
            causal_softmax=op("CausalSoftmax", _check_causal, lambda x: x, "scores", lambda x: x),
            softmax_grad=op("SoftmaxGrad", _check_causal, lambda p, d: p, "probs dprobs", lambda p, d: p),
            swiglu=op("SwiGLU", _check_same, lambda g, u: g, "gate up", lambda g, u: g),
            swiglu_grad=op("SwiGLUGrad", _check_same, lambda g, u, d: (g, g), "gate up dout", lambda g, u, d: (g, g)),
            rms_norm=op("RMSNorm", _check_rms, lambda x, w, e: x, "x weight eps", lambda x, w, e: x),
            rms_norm_grad=op(
                "RMSNormGrad", _check_rms, lambda x, w, e, d: (x, w), "x weight eps dy", lambda x, w, e, d: (x, w)
            ),
            causal_attention=op(
                "CausalAttention", _check_attention, lambda q, k, v: (q, q[:3]), "q k v", lambda q, k, v: (q, q)
            ),
            causal_attention_grad=op(
                "CausalAttentionGrad",
                _check_attention,
                lambda q, k, v, o, lse, d: (q, k, k),
                "q k v out lse dout",
                lambda q, k, v, o, lse, d: (q, q, q),
            ),
            transpose=op("Transpose", _check_2d, lambda x: [x[1], x[0]], "x", lambda x: x),
            rope_heads=op("RopeHeads", _check_rope, _rope_heads_shape, "y cos sin scale", lambda y, c, s, k: y),
            rope_tokens=op(
                "RopeTokens",
                lambda op_, *shapes: _check_rope(op_, *shapes, tokens=True),
                _rope_tokens_shape,
                "d cos sin scale",
                lambda d, c, s, k: d,
            ),
            cross_entropy=ops.Custom(
                f"{lib}:CrossEntropy",
                out_shape=_shape_fn("CrossEntropy", _check_ce, lambda x, y: ([x[0]], [x[0]])),
                out_dtype=_dtype_fn("CrossEntropy", _dt_ce, lambda x, y: (x, x)),
                func_type="aot",
            ),
            cross_entropy_with_grad=ops.Custom(
                f"{lib}:CrossEntropyWithGrad",
                out_shape=_shape_fn("CrossEntropyWithGrad", _check_ce, lambda x, y, d: ([x[0]], x)),
                out_dtype=_dtype_fn("CrossEntropyWithGrad", _dt_ce, lambda x, y, d: (x, x)),
                func_type="aot",
            ),
            cross_entropy_grad=ops.Custom(
                f"{lib}:CrossEntropyGrad",
                out_shape=_shape_fn("CrossEntropyGrad", _check_ce, lambda x, y, lse, d: x),
                out_dtype=_dtype_fn("CrossEntropyGrad", _dt_ce, lambda x, y, lse, d: x),
                func_type="aot",
            ),
        )
    _train_ops.append(ns)
    return ns


_zero_ops: list = []  # memo of zero_ops(), as _train_ops


def zero_ops() -> SimpleNamespace | None:
    """The in-place AdamW op (ZeroAdamW in model/train_kernels.cc), or None where it cannot be built (no compiler, or
    MSLLM_FUSED_KERNELS=0): tasks/training/zero.py ShardedAdamW then keeps its fp32 master share and
    MindSpore's AdamWeightDecay.

    adamw(param [n], grad [n], m [k], v [k], offset [1] int32, lr, beta1, beta2, eps, decay, coef, apply) -> [1]:
    updates m, v and param[offset:offset + k] in place (fp32; scalars 0-d fp32; apply 0 writes nothing).
    """
    if _zero_ops:
        return _zero_ops[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    ns = None
    if lib is not None:

        class ZeroAdamW(ops.Custom):
            """Declared as writing param, m and v (RW_WRITE, side_effect_mem), as MindSpore's own AdamWeightDecay:
            without it a graph run under the PYNATIVE context (mindspore.jit) hands the kernel a copy of a
            Parameter the step also reads elsewhere, and the update is lost; with it the update is ordered after
            every earlier read of those Parameters in the graph (auto-monad)."""

            __mindspore_signature__ = (
                sig.make_sig("param", sig.sig_rw.RW_WRITE),
                sig.make_sig("grad"),
                sig.make_sig("m", sig.sig_rw.RW_WRITE),
                sig.make_sig("v", sig.sig_rw.RW_WRITE),
                *(sig.make_sig(n) for n in ("offset", "lr", "beta1", "beta2", "eps", "decay", "coef", "apply")),
            )

            def __init__(self):
                super().__init__(
                    f"{lib}:ZeroAdamW", out_shape=lambda *s: [1], out_dtype=lambda *t: t[0], func_type="aot"
                )
                self.add_prim_attr("side_effect_mem", True)

        ns = SimpleNamespace(lib=lib, adamw=ZeroAdamW())
    _zero_ops.append(ns)
    return ns


_grad_put: list = []  # memo of grad_put()


def grad_put():
    """`put(dst, src, accumulate, square) -> float`: `src` written (or added) into `dst` (float32 arrays of one size,
    C-contiguous), returning Σ dst² (float64) when `square`, else 0.0; one pass on the kernels' threads
    (MsllmGradPut in model/train_kernels.cc, through ctypes). None where the library is not built (no compiler, or
    MSLLM_FUSED_KERNELS=0): the caller keeps NumPy."""
    if _grad_put:
        return _grad_put[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    fn = None
    if lib is not None:
        c = ctypes.CDLL(lib).MsllmGradPut
        c.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
        c.restype = ctypes.c_double

        def fn(dst: np.ndarray, src: np.ndarray, accumulate: bool, square: bool) -> float:
            ok = all(a.dtype == np.float32 and a.flags.c_contiguous for a in (dst, src)) and dst.size == src.size
            if not ok or not dst.flags.writeable:
                raise ValueError(f"grad_put: float32 C-contiguous arrays of one size, got {dst.dtype} and {src.dtype}")
            return c(dst.ctypes.data, src.ctypes.data, dst.size, int(accumulate), int(square))

    _grad_put.append(fn)
    return fn


_embed_grad: list = []  # memo of embed_grad()


def embed_grad():
    """`add(e, dx, ids, zero, square) -> float`: the rows of `dx` [n, h] added onto `e` [rows, h]'s rows `ids` [n]
    (int32), tokens in order, after zeroing `e` when `zero`; returns Σ e² (float64) when `square`, else 0.0; one
    pass on the kernels' threads (MsllmEmbedGrad in model/train_kernels.cc, through ctypes). An id outside [0, rows)
    is a ValueError, nothing written. None where the library is not built: the caller keeps NumPy."""
    if _embed_grad:
        return _embed_grad[0]
    lib = None if disabled_reason() else build(TRAIN_SOURCE)
    fn = None
    if lib is not None:
        c = ctypes.CDLL(lib).MsllmEmbedGrad
        c.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
        c.argtypes += [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double)]
        c.restype = ctypes.c_int

        def fn(e: np.ndarray, dx: np.ndarray, ids: np.ndarray, zero: bool, square: bool) -> float:
            ids = np.ascontiguousarray(ids, np.int32).reshape(-1)
            ok = e.ndim == 2 and e.dtype == np.float32 and e.flags.c_contiguous and e.flags.writeable
            ok = ok and dx.dtype == np.float32 and dx.flags.c_contiguous and dx.size == ids.size * e.shape[1]
            if not ok:
                raise ValueError(
                    f"embed_grad: e float32 [rows, h] C-contiguous and dx float32 [n, h] for n ids, got e {e.dtype} "
                    f"{e.shape}, dx {dx.dtype} {dx.shape}, {ids.size} ids"
                )
            out = ctypes.c_double(0.0)
            rc = c(e.ctypes.data, e.shape[0], e.shape[1], dx.ctypes.data, ids.ctypes.data, ids.size, zero, square, out)
            if rc:
                raise ValueError(f"embed_grad: a token id outside [0, {e.shape[0]}) (ids {ids.min()}..{ids.max()})")
            return out.value

    _embed_grad.append(fn)
    return fn
