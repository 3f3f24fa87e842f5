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
gradients are two MatMuls, RoPE's is its transpose, the attention's the four BatchMatMuls and the fused softmax's
backward, RMSNorm's and SwiGLU's the fused kernels' own backward (model/train_kernels.cc). The same kernels as the
model's fused cells (model/fused_cells.py), so the arithmetic is the model's; the gradients equal autodiff's to
fp32 rounding (tests/test_layerwise.py: one layer against GradOperation, the whole step against the whole-model
step).

Kept per layer between forward and backward ([N = B·T] rows): the roped, scaled queries and the roped keys, the
values, the attention's output before o_proj, the residual after attention, the MLP's gate and up projections
(SmolLM2-135M: 5184 floats per token per layer, 5.3 MB per layer at 2 x 128). Recomputed in the backward, as cheap
as reading them: both norms' outputs, the attention scores and probabilities (B·nh·T² each: at long sequences the
largest activation there is), SwiGLU's output.

Applies to the fp32 fused build (the kernels that `FusedRMSNorm`, `FusedCausalSoftmax` and `FusedSwiGLU` run, plain
`Linear` projections, the layers' own heads): elsewhere (no kernel library, fp16 compute, adapters)
`functional_unsupported` says why and the step keeps the autodiff layer graph.
"""

from __future__ import annotations

from types import SimpleNamespace

import mindspore as ms
from mindspore import Tensor, nn, ops

from model.fused_cells import FusedCausalLMLoss, FusedCausalSoftmax, FusedRMSNorm, FusedSwiGLU
from model.layers import Linear
from model.runtime import actor_thread_branch

SAVED = ("q", "k", "v", "context", "mid", "gate", "up")
"""What the forward keeps for the backward, in order: roped and scaled queries [B, nkv, rep·T, hd], roped keys and
values [B, nkv, T, hd], the attention output [N, nh·hd], the residual after attention [N, H], gate and up [N, F]."""


def functional_unsupported(net) -> str | None:
    """Why `layer_functions` cannot stand in for `net`'s layers (None when it can)."""
    if getattr(net, "compute_dtype", ms.float32) != ms.float32:
        return "fp16 compute"
    if not (isinstance(net.loss_fn, FusedCausalLMLoss) and isinstance(net.norm.normalize, FusedRMSNorm)):
        return "the fused kernels are off"
    for layer in net.layers:
        attn, mlp = layer.self_attn, layer.mlp
        cells = (attn.softmax, mlp.swiglu, layer.input_layernorm.normalize, layer.post_attention_layernorm.normalize)
        if not (isinstance(cells[0], FusedCausalSoftmax) and isinstance(cells[1], FusedSwiGLU)
                and all(isinstance(c, FusedRMSNorm) for c in cells[2:])):
            return "the fused kernels are off"
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        if any(type(p) is not Linear for p in projections):
            return "a projection is not a plain Linear (an adapter)"
        names = [n for n, _ in layer.parameters_and_names()]
        if names != list(_ORDER):
            return f"the layer's parameters are {names}"
    return None


_ORDER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
          "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
          "post_attention_layernorm.weight")


class _Ops(nn.Cell):
    """The kernels and shapes both graphs share."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        layer = net.layers[0]
        attn = layer.self_attn
        self.nh, self.nkv, self.hd = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.rep, self.scale = attn.n_rep, attn.scale
        norm = layer.input_layernorm.normalize.kernel
        self.rms, self.rms_grad, self.eps = norm.forward_op, norm.backward_op, norm.eps
        self.softmax, self.softmax_grad = attn.softmax.forward_op, attn.softmax.backward_op
        self.swiglu, self.swiglu_grad = layer.mlp.swiglu.forward_op, layer.mlp.swiglu.backward_op
        self.rotate = Tensor(attn.rotate.asnumpy())
        self.mm = ops.MatMul()                       # a @ b
        self.mm_bt = ops.MatMul(transpose_b=True)    # a @ b^T (a projection: x @ W^T)
        self.mm_at = ops.MatMul(transpose_a=True)    # a^T @ b (a weight's gradient: dy^T @ x)
        self.bmm = ops.BatchMatMul()
        self.bmm_bt = ops.BatchMatMul(transpose_b=True)
        self.bmm_at = ops.BatchMatMul(transpose_a=True)

    def heads(self, y, b, t, n):
        """[N, n·hd] -> [B, n, T, hd]"""
        return ops.transpose(y.reshape(b, t, n, self.hd), (0, 2, 1, 3))

    def tokens(self, y, b, t, n):
        """[B, n, T, hd] -> [N, n·hd]"""
        return ops.transpose(y, (0, 2, 1, 3)).reshape(b * t, n * self.hd)

    def rope(self, z, cos, sin):
        """z·cos + rotate_half(z)·sin, as the model's Attention._rope (rotate-half a MatMul by a ±1 permutation)."""
        rotated = self.mm(z.reshape(-1, self.hd), self.rotate).reshape(z.shape)
        return z * ops.broadcast_to(cos, z.shape) + rotated * ops.broadcast_to(sin, z.shape)

    def rope_grad(self, dz, cos, sin):
        """The transpose of `rope`: dz·cos + rotate_half^T(dz·sin)."""
        s = dz * ops.broadcast_to(sin, dz.shape)
        return dz * ops.broadcast_to(cos, dz.shape) + self.mm_bt(s.reshape(-1, self.hd), self.rotate).reshape(dz.shape)

    def probs(self, q, k, b, t):
        """The causal attention probabilities [B, nkv, rep·T, T] of the saved queries and keys."""
        scores = self.bmm_bt(q, k)                                            # [B, nkv, rep·T, T]
        return self.softmax(scores.reshape(b * self.nh, t, t)).reshape(b, self.nkv, self.rep * t, t)


class _Forward(_Ops):
    def construct(self, x, cos, sin, flag, wq, wk, wv, wo, wg, wu, wd, n1, n2):
        b, t, h = x.shape
        x2 = x.reshape(b * t, h)                                              # [N, H]
        a = self.rms(x2, n1, self.eps)
        q = self.rope(self.heads(self.mm_bt(a, wq), b, t, self.nh), cos, sin) * self.scale  # [B, nh, T, hd]
        k = self.rope(self.heads(self.mm_bt(a, wk), b, t, self.nkv), cos, sin)              # [B, nkv, T, hd]
        v = self.heads(self.mm_bt(a, wv), b, t, self.nkv)                                   # [B, nkv, T, hd]
        q = q.reshape(b, self.nkv, self.rep * t, self.hd)  # GQA: a kv head's query heads along the query axis
        context = self.tokens(self.bmm(self.probs(q, k, b, t), v).reshape(b, self.nh, t, self.hd), b, t, self.nh)
        mid = x2 + self.mm_bt(context, wo)                                    # [N, H]
        m = self.rms(mid, n2, self.eps)
        gate, up = self.mm_bt(m, wg), self.mm_bt(m, wu)                       # [N, F]
        y = mid + self.mm_bt(self.swiglu(gate, up), wd)
        return y.reshape(b, t, h), q, k, v, context, mid, gate, up, actor_thread_branch(flag)


class _Backward(_Ops):
    def construct(self, x, cos, sin, flag, dy, q, k, v, context, mid, gate, up, wq, wk, wv, wo, wg, wu, wd, n1, n2):
        b, t, h = x.shape
        x2, dy = x.reshape(b * t, h), dy.reshape(b * t, h)
        # MLP: y = mid + swiglu(gate, up) @ wd^T, gate / up = rms(mid) @ wg^T / wu^T
        m = self.rms(mid, n2, self.eps)
        dwd = self.mm_at(dy, self.swiglu(gate, up))
        dgate, dup = self.swiglu_grad(gate, up, self.mm(dy, wd))
        dwg, dwu = self.mm_at(dgate, m), self.mm_at(dup, m)
        dmid, dn2 = self.rms_grad(mid, n2, self.eps, self.mm(dgate, wg) + self.mm(dup, wu))
        dmid = dy + dmid
        # attention: mid = x + context @ wo^T
        dwo = self.mm_at(dmid, context)
        dc = self.heads(self.mm(dmid, wo), b, t, self.nh).reshape(b, self.nkv, self.rep * t, self.hd)
        p = self.probs(q, k, b, t)
        dv = self.bmm_at(p, dc)                                               # [B, nkv, T, hd]
        ds = self.softmax_grad(p.reshape(b * self.nh, t, t), self.bmm_bt(dc, v).reshape(b * self.nh, t, t))
        ds = ds.reshape(b, self.nkv, self.rep * t, t)
        dq = self.bmm(ds, k).reshape(b, self.nh, t, self.hd) * self.scale
        dk = self.bmm_at(ds, q)                                               # [B, nkv, T, hd]
        dq = self.tokens(self.rope_grad(dq, cos, sin), b, t, self.nh)         # [N, nh·hd]
        dk = self.tokens(self.rope_grad(dk, cos, sin), b, t, self.nkv)
        dv = self.tokens(dv, b, t, self.nkv)
        a = self.rms(x2, n1, self.eps)
        dwq, dwk, dwv = self.mm_at(dq, a), self.mm_at(dk, a), self.mm_at(dv, a)
        dx, dn1 = self.rms_grad(x2, n1, self.eps, self.mm(dq, wq) + self.mm(dk, wk) + self.mm(dv, wv))
        return (dmid + dx).reshape(b, t, h), dwq, dwk, dwv, dwo, dwg, dwu, dwd, dn1, dn2, actor_thread_branch(flag)


class _Head(nn.Cell):
    """The final norm, the LM head and the fused cross-entropy with their backward written out, 2-D throughout (no
    [B, T, V] view of the logits: a Reshape is a copy on CPU, and autodiff's head graph took ~1.3x as long, tiny 8 x
    256). Returns (loss x weight, d x [B, T, H] of loss x weight x scale, d norm weight, d head weight)."""

    def __init__(self, net):
        super().__init__(auto_prefix=False)
        norm = net.norm.normalize.kernel
        self.rms, self.rms_grad, self.eps = norm.forward_op, norm.backward_op, norm.eps
        ce = net.loss_fn.cross_entropy
        self.ce, self.ce_grad = ce.forward_op, ce.backward_op
        self.mm, self.mm_bt, self.mm_at = ops.MatMul(), ops.MatMul(transpose_b=True), ops.MatMul(transpose_a=True)

    def construct(self, x, labels, weight, scale, flag, norm_w, head_w):
        b, t, h = x.shape
        x2 = x.reshape(b * t, h)
        labels = labels.reshape(-1).astype(ms.int32)                          # [N]
        xn = self.rms(x2, norm_w, self.eps)
        logits = self.mm_bt(xn, head_w)                                       # [N, V]
        nll, lse = self.ce(logits, labels)
        count = ops.maximum((labels != -100).astype(ms.float32).sum(), 1.0)
        loss = nll.sum() / count * weight
        dnll = ops.broadcast_to((weight * scale / count).reshape(1), nll.shape)  # ignored rows: the kernel gives 0
        dlogits = self.ce_grad(logits, labels, lse, dnll)
        dhead = self.mm_at(dlogits, xn)                                       # [V, H]
        dx, dnorm = self.rms_grad(x2, norm_w, self.eps, self.mm(dlogits, head_w))
        return loss, dx.reshape(b, t, h), dnorm, dhead, actor_thread_branch(flag)


def layer_functions(net) -> SimpleNamespace | None:
    """The compiled forward and backward of one of `net`'s layers (module docstring), or None where
    `functional_unsupported(net)` says why not."""
    if functional_unsupported(net) is not None:
        return None
    return SimpleNamespace(forward=ms.jit(_Forward(net)), backward=ms.jit(_Backward(net)), head=ms.jit(_Head(net)))

