"""One decoder layer's forward and backward as two functions of (activations, weights), for the layer-at-a-time train
step (tasks/training/layerwise.py): the forward returns what the backward needs, so the backward does not run the
layer's forward again.

    fn = layer_functions(net)            # None where they do not apply (the reason: functional_unsupported(net))
    flag = Tensor(0, ms.int32)           # model.runtime.actor_thread_branch's never-taken branch
    y, *saved, _ = fn.forward(x, cos, sin, flag, *ws)  # ws: the layer's weights in parameters_and_names() order
    dx, *dws, _ = fn.backward(x, cos, sin, flag, dy, *saved, *ws)
    loss, dx, dnorm, dhead, _ = fn.head(x, labels, weight, scale, flag, norm_weight, head_weight)

Why (docs/MEMORY.md, "Train"): through autodiff, the layer-gradient graph had to run the layer's forward again from
its input (GradOperation differentiates the function it runs: a third of the layer's FLOPs), and each layer's
weights were assigned into a template layer inside every graph call. Here
the weights are plain graph inputs (no template, no copy) and the backward is written out: every projection's
gradients are two MatMuls, RoPE's is its transpose (RoPE with the heads' transpose and the queries' scale one kernel
each way, model/train_kernels.cc RopeHeads / RopeTokens), the attention's the fused attention kernel's backward
(`FusedCausalAttention`; without it, the four BatchMatMuls and the fused softmax's backward), RMSNorm's and SwiGLU's the
fused kernels' own backward (model/train_kernels.cc). The same kernels as the
model's fused cells (model/fused_cells.py), so the arithmetic is the model's; the gradients equal autodiff's to
fp32 rounding (tests/test_layerwise.py: one layer against GradOperation, the whole step against the whole-model
step).

Kept per layer between forward and backward ([N = B·T] rows): the roped, scaled queries and the roped keys, the
values, the attention's output before o_proj, the residual after attention, the MLP's gate and up projections
and the attention rows' log-sum-exp (SmolLM2-135M: 5193 floats per token per layer, 5.3 MB per layer at 2 x 128).
Recomputed in the backward, as cheap as reading them: both norms' outputs, the attention probabilities (inside the
attention kernel, a 64-query block at a time: never B·nh·T²), SwiGLU's output.

LoRA: a projection with an adapter (model/lora.py `LoRALinear`, no dropout, not merged) computes x W^T + s (x A^T) B^T
and its backward d A = s (dy B)^T x, d B = s dy^T (x A^T), d x = dy W + s (dy B) A; with adapters the base weights,
norms and head are frozen (as `mark_only_lora_trainable` leaves them), so the backward computes no weight gradient but
the adapters' (a third of a full backward's MatMuls fewer) and the head only d x (`fn.lora`, `fn.trained(layer)`: the
parameters the backward returns gradients for).

Applies to the fp32 fused build (the kernels that `FusedRMSNorm`, `FusedCausalSoftmax` and `FusedSwiGLU` run, plain
`Linear` projections or LoRA adapters on them, the layers' own heads): elsewhere (no kernel library, fp16 compute,
LoRA dropout) `functional_unsupported` says why and the step keeps the autodiff layer graph (and LoRA the whole-model
step)."""

from __future__ import annotations

from types import SimpleNamespace

import mindspore as ms
from mindspore import Tensor, nn, ops

from model.fused_cells import (
    FusedCausalAttention,
    FusedCausalLMLoss,
    FusedCausalSoftmax,
    FusedHeadMatMul,
    FusedRMSNorm,
    FusedSwiGLU,
)
from model.kernel_ops import train_ops
from model.layers import Linear
from model.lora import LORA_A, LORA_B, LoRALinear, is_lora_param
from model.runtime import actor_thread_branch

SAVED = ("q", "k", "v", "context", "mid", "gate", "up", "lse")
"""What the forward keeps for the backward, in order: roped and scaled queries ([B, nh, T, hd] with the attention
kernel, [B, nkv, rep·T, hd] without), roped keys and values [B, nkv, T, hd], the attention output [N, nh·hd], the
residual after attention [N, H], gate and up [N, F], the attention rows' log-sum-exp [B, nh, T] (a 0-d zero without
the kernel)."""


def functional_unsupported(net) -> str | None:
    """Why `layer_functions` cannot stand in for `net`'s layers (None when it can)."""
    if getattr(net, "compute_dtype", ms.float32) != ms.float32:
        return "fp16 compute"
    if not (isinstance(net.loss_fn, FusedCausalLMLoss) and isinstance(net.norm.normalize, FusedRMSNorm)):
        return "the fused kernels are off"
    first = _adapted(net.layers[0])
    if len({p.scaling for layer in net.layers for p in _projections(layer) if isinstance(p, LoRALinear)}) > 1:
        return "the layers' adapters differ"
    for layer in net.layers:
        attn, mlp = layer.self_attn, layer.mlp
        cells = (attn.softmax, mlp.swiglu, layer.input_layernorm.normalize, layer.post_attention_layernorm.normalize)
        if not (
            isinstance(cells[0], FusedCausalSoftmax)
            and isinstance(cells[1], FusedSwiGLU)
            and all(isinstance(c, FusedRMSNorm) for c in cells[2:])
        ):
            return "the fused kernels are off"
        projections = _projections(layer)
        for name, p in zip(_PROJ, projections):
            if isinstance(p, LoRALinear):
                if p.dropout > 0 or p.merged:
                    return f"the LoRA adapter on {name} has dropout or is merged"
            elif type(p) is not Linear:
                return f"{name} is a {type(p).__name__}, not a Linear or a LoRA adapter"
        adapted = _adapted(layer)
        if adapted != first:
            return "the layers' adapters differ"
        names = [n for n, _ in layer.parameters_and_names()]
        if names != _names(adapted):
            return f"the layer's parameters are {names}"
    return None


_PROJ = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight")


def _projections(layer) -> tuple:
    attn, mlp = layer.self_attn, layer.mlp
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _adapted(layer) -> tuple[bool, ...]:
    """Which of the seven projections carry a LoRA adapter."""
    return tuple(isinstance(p, LoRALinear) for p in _projections(layer))


def _names(adapted) -> list[str]:
    """A layer's parameters in parameters_and_names() order: each projection's weight, then its adapter's A and B."""
    names = []
    for name, a in zip(_PROJ, adapted):
        names += [f"{name}.weight"] + ([f"{name}.{LORA_A}", f"{name}.{LORA_B}"] if a else [])
    return names + list(_NORMS)


class _Ops(nn.Cell):
    """The kernels and shapes both graphs share. The layer's parameters come as one tuple `ps` in parameters_and_names()
    order; `slots[i]` is where projection i's weight (and its adapter's A and B) sit in it. With adapters (LoRA) only
    they are trained: the base weights and norms get no gradient."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        layer = net.layers[0]
        self.adapted = _adapted(layer)
        self.lora = any(self.adapted)
        self.scaling = next((p.scaling for p in _projections(layer) if isinstance(p, LoRALinear)), 1.0)
        names = _names(self.adapted)
        self.slots = tuple(
            (
                names.index(f"{n}.weight"),
                *((names.index(f"{n}.{LORA_A}"), names.index(f"{n}.{LORA_B}")) if a else (-1, -1)),
            )
            for n, a in zip(_PROJ, self.adapted)
        )
        self.norm_slots = (names.index(_NORMS[0]), names.index(_NORMS[1]))
        attn = layer.self_attn
        self.nh, self.nkv, self.hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.rep, self.scale = attn.n_rep, attn.scale
        norm = layer.input_layernorm.normalize.kernel
        self.rms, self.rms_grad, self.eps = norm.forward_op, norm.backward_op, norm.eps
        self.softmax, self.softmax_grad = attn.softmax.forward_op, attn.softmax.backward_op
        fused = attn.fused if isinstance(attn.fused, FusedCausalAttention) else None  # one kernel each way
        self.attention, self.attention_grad = (fused.forward_op, fused.backward_op) if fused else (None, None)
        self.swiglu, self.swiglu_grad = layer.mlp.swiglu.forward_op, layer.mlp.swiglu.backward_op
        rope = train_ops()  # the fused build's kernels (functional_unsupported checked it is one)
        self.rope_heads, self.rope_tokens = rope.rope_heads, rope.rope_tokens
        self.scale_q, self.unscaled = Tensor([self.scale], ms.float32), Tensor([1.0], ms.float32)
        self.mm = ops.MatMul()  # a @ b
        self.mm_bt = ops.MatMul(transpose_b=True)  # a @ b^T (a projection: x @ W^T)
        self.mm_at = ops.MatMul(transpose_a=True)  # a^T @ b (a weight's gradient: dy^T @ x)
        self.bmm = ops.BatchMatMul()
        self.bmm_bt = ops.BatchMatMul(transpose_b=True)
        self.bmm_at = ops.BatchMatMul(transpose_a=True)

    def heads(self, y, b, t, n):
        """[N, n·hd] -> [B, n, T, hd]"""
        return ops.transpose(y.reshape(b, t, n, self.hd), (0, 2, 1, 3))

    def tokens(self, y, b, t, n):
        """[B, n, T, hd] -> [N, n·hd]"""
        return ops.transpose(y, (0, 2, 1, 3)).reshape(b * t, n * self.hd)

    def proj(self, i, x, ps):
        """Projection i of x [N, in]: x W^T, plus scaling · (x A^T) B^T where it has an adapter."""
        w, a, b = self.slots[i]
        y = self.mm_bt(x, ps[w])
        if self.adapted[i]:
            y = y + self.mm_bt(self.mm_bt(x, ps[a]), ps[b]) * self.scaling
        return y

    def back(self, i, x, dy, ps):
        """(d x, the gradients projection i trains) given its input x and upstream dy: d W = dy^T x without adapters;
        with one, the base frozen: d A = s (dy B)^T x, d B = s dy^T (x A^T), d x also through the adapter."""
        w, a, b = self.slots[i]
        dx = self.mm(dy, ps[w])
        if self.adapted[i]:
            t = self.mm(dy, ps[b])  # [N, r]
            dx = dx + self.mm(t, ps[a]) * self.scaling
            return dx, (self.mm_at(t, x) * self.scaling, self.mm_at(dy, self.mm_bt(x, ps[a])) * self.scaling)
        if self.lora:
            return dx, ()
        return dx, (self.mm_at(dy, x),)

    def probs(self, q, k, b, t):
        """The causal attention probabilities [B, nkv, rep·T, T] of the saved queries and keys."""
        scores = self.bmm_bt(q, k)  # [B, nkv, rep·T, T]
        return self.softmax(scores.reshape(b * self.nh, t, t)).reshape(b, self.nkv, self.rep * t, t)


class _Forward(_Ops):
    def construct(self, x, cos, sin, flag, *ps):
        b, t, h = x.shape
        n1, n2 = ps[self.norm_slots[0]], ps[self.norm_slots[1]]
        x2 = x.reshape(b * t, h)  # [N, H]
        a = self.rms(x2, n1, self.eps)
        q = self.rope_heads(self.proj(0, a, ps), cos, sin, self.scale_q)  # [B, nh, T, hd], RoPE'd and scaled
        k = self.rope_heads(self.proj(1, a, ps), cos, sin, self.unscaled)  # [B, nkv, T, hd]
        v = self.heads(self.proj(2, a, ps), b, t, self.nkv)  # [B, nkv, T, hd]
        if self.attention is None:
            q = q.reshape(b, self.nkv, self.rep * t, self.hd)  # GQA: a kv head's query heads along the query axis
            context = self.tokens(self.bmm(self.probs(q, k, b, t), v).reshape(b, self.nh, t, self.hd), b, t, self.nh)
            lse = ops.zeros((), ms.float32)  # (the fused attention's; recomputed probs here)
        else:
            out, lse = self.attention(q, k, v)  # [B, nh, T, hd], [B, nh, T]
            context = self.tokens(out, b, t, self.nh)
        mid = x2 + self.proj(3, context, ps)  # [N, H]
        m = self.rms(mid, n2, self.eps)
        gate, up = self.proj(4, m, ps), self.proj(5, m, ps)  # [N, F]
        y = mid + self.proj(6, self.swiglu(gate, up), ps)
        return y.reshape(b, t, h), q, k, v, context, mid, gate, up, lse, actor_thread_branch(flag)


class _Backward(_Ops):
    def construct(self, x, cos, sin, flag, dy, q, k, v, context, mid, gate, up, lse, *ps):
        b, t, h = x.shape
        n1, n2 = ps[self.norm_slots[0]], ps[self.norm_slots[1]]
        x2, dy = x.reshape(b * t, h), dy.reshape(b * t, h)
        # MLP: y = mid + down(swiglu(gate, up)), gate / up = gate_proj / up_proj of rms(mid)
        m = self.rms(mid, n2, self.eps)
        dsw, gd = self.back(6, self.swiglu(gate, up), dy, ps)
        dgate, dup = self.swiglu_grad(gate, up, dsw)
        dm_gate, gg = self.back(4, m, dgate, ps)
        dm_up, gu = self.back(5, m, dup, ps)
        dmid, dn2 = self.rms_grad(mid, n2, self.eps, dm_gate + dm_up)
        dmid = dy + dmid
        # attention: mid = x + o_proj(context)
        dctx, go = self.back(3, context, dmid, ps)
        dc = self.heads(dctx, b, t, self.nh)  # [B, nh, T, hd]
        if self.attention is None:
            dc = dc.reshape(b, self.nkv, self.rep * t, self.hd)
            p = self.probs(q, k, b, t)
            dv = self.bmm_at(p, dc)  # [B, nkv, T, hd]
            ds = self.softmax_grad(p.reshape(b * self.nh, t, t), self.bmm_bt(dc, v).reshape(b * self.nh, t, t))
            ds = ds.reshape(b, self.nkv, self.rep * t, t)
            dq = self.bmm(ds, k).reshape(b, self.nh, t, self.hd)
            dk = self.bmm_at(ds, q)  # [B, nkv, T, hd]
        else:
            dq, dk, dv = self.attention_grad(q, k, v, self.heads(context, b, t, self.nh), lse, dc)
        dq = self.rope_tokens(dq, cos, sin, self.scale_q)  # [N, nh·hd]: the scale's, RoPE's and heads' transposes
        dk = self.rope_tokens(dk, cos, sin, self.unscaled)
        dv = self.tokens(dv, b, t, self.nkv)
        a = self.rms(x2, n1, self.eps)
        da_q, gq = self.back(0, a, dq, ps)
        da_k, gk = self.back(1, a, dk, ps)
        da_v, gv = self.back(2, a, dv, ps)
        dx, dn1 = self.rms_grad(x2, n1, self.eps, da_q + da_k + da_v)
        grads = gq + gk + gv + go + gg + gu + gd + (() if self.lora else (dn1, dn2))  # the trained ones, in order
        return ((dmid + dx).reshape(b, t, h),) + grads + (actor_thread_branch(flag),)


class _Head(nn.Cell):
    """The final norm, the LM head and the fused cross-entropy with their backward written out, 2-D throughout (no
    [B, T, V] view of the logits: a Reshape is a copy on CPU, and autodiff's head graph took ~1.3x as long, tiny 8 x
    256). Returns (loss x weight, d x [B, T, H] of loss x weight x scale, d norm weight, d head weight); with LoRA
    adapters in the layers (the head frozen) the last two are left out."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        norm = net.norm.normalize.kernel
        self.rms, self.rms_grad, self.eps = norm.forward_op, norm.backward_op, norm.eps
        self.ce_with_grad = train_ops().cross_entropy_with_grad  # the loss and d logits in one pass
        self.mm, self.mm_bt, self.mm_at = ops.MatMul(), ops.MatMul(transpose_b=True), ops.MatMul(transpose_a=True)
        self.frozen = any(_adapted(net.layers[0]))  # LoRA: the head trains nothing, only d x is needed
        head = net.tied_matmul if net.tie_embeddings else net.lm_head.matmul
        self.transpose = head.transpose if isinstance(head, FusedHeadMatMul) else None  # the build chose dlogitsᵀ · x

    def construct(self, x, labels, weight, scale, flag, norm_w, head_w):
        b, t, h = x.shape
        x2 = x.reshape(b * t, h)
        labels = labels.reshape(-1).astype(ms.int32)  # [N]
        xn = self.rms(x2, norm_w, self.eps)
        logits = self.mm_bt(xn, head_w)  # [N, V]
        count = ops.maximum((labels != -100).astype(ms.float32).sum(), 1.0)
        dnll = ops.broadcast_to((weight * scale / count).reshape(1), labels.shape)  # ignored rows: the kernel gives 0
        nll, dlogits = self.ce_with_grad(logits, labels, dnll)
        loss = nll.sum() / count * weight
        dx, dnorm = self.rms_grad(x2, norm_w, self.eps, self.mm(dlogits, head_w))
        if self.frozen:
            return loss, dx.reshape(b, t, h), actor_thread_branch(flag)
        if self.transpose is None:
            dhead = self.mm_at(dlogits, xn)  # [V, H]
        else:
            dhead = self.mm(self.transpose(dlogits), xn)  # [V, H]: no transposed-A MatMul
        return loss, dx.reshape(b, t, h), dnorm, dhead, actor_thread_branch(flag)


def layer_functions(net) -> SimpleNamespace | None:
    """The compiled forward and backward of one of `net`'s layers (module docstring), or None where
    `functional_unsupported(net)` says why not. `lora`: the layers carry LoRA adapters, and the functions train
    only those (`trained(layer)`: which of a layer's parameters get gradients, in the backward's order)."""
    if functional_unsupported(net) is not None:
        return None
    lora = any(_adapted(net.layers[0]))
    return SimpleNamespace(
        forward=ms.jit(_Forward(net)),
        backward=ms.jit(_Backward(net)),
        head=ms.jit(_Head(net)),
        lora=lora,
        trained=lambda layer: [p for n, p in layer.parameters_and_names() if not lora or is_lora_param(n)],
    )
