"""The train step one decoder layer at a time: the same step as `TrainStep` (loss, gradients, accumulation, data-
parallel reduction, global-norm clip, finite-step skip, AdamW), with the decoder's forward and backward run layer by
layer through ONE layer graph and ONE layer-gradient graph instead of one whole-model graph.

Why (docs/MEMORY.md, "Train"): MindSpore's CPU graph keeps a buffer for every kernel of a compiled graph for the
life of the process (docs/MINDSPORE_CPU.md, "Memory"), so the whole-model step holds every layer's forward and
backward intermediates at once, and `recompute()` does not change that. Here, with the fused fp32 kernels (the
trainer's build on CPU; tasks/training/layer_grad.py):

1. forward: the prologue graph (`net.layer_inputs`: embeddings, RoPE tables, mask), then the layer's forward once
   per layer, its weights graph inputs (plain Tensors over the Parameters' memory), keeping each layer's input and
   what its backward reads (`layer_grad.SAVED`: queries, keys, values, attention output, gate, up);
2. the head: final norm, LM head and the fused cross-entropy with their backward written out, returning the loss
   and its gradients at the last hidden state and at the norm / head weights;
3. backward: the layer's written-out backward once per layer from the last, from what its forward kept (no
   forward run again): d(input) and the layer's weight gradients;
4. the embedding's gradient: the first layer's d(input) summed onto the ids' rows (plus the head's, tied);
5. the update: one graph, the same as `TrainStep`'s accumulate-then-apply: reduce over the data-parallel group,
   global gradient norm, clip, finite check, AdamW (the trainer's own optimizer cell and kernel).

Without them (no compiler, fp16 compute: `layer_grad.functional_unsupported`), steps 1-3 run MindSpore's autodiff:
the layer graph over a copy of layer 0 whose weights are assigned inside each call (`model.runtime.weight_slot`,
the eval scorer's mechanism), the head through `value_and_grad`, and the layer-gradient graph recomputing each
layer's forward from its kept input (GradOperation with the upstream gradient as sens).

Every gradient is kept until the update (the norm needs all of them before any weight moves): each graph's gradient
outputs are written into the step's arrays as the graph returns, with the fused build by `model.kernel_ops.grad_put`
on the kernels' threads, which also leaves each one's Σ g² for the global norm (one pass, not a copy and a norm pass).
The activations are one layer's working set plus what each backward reads. The step runs inside
`model.runtime.graphs_back_to_back()`: MindSpore's pool keeps spinning between its graph calls instead of sleeping
after each (docs/MINDSPORE_CPU.md, "Threads"). The graphs are static (a train step's shapes are fixed; the
fused cells fail in dynamic-shape graphs in MindSpore 2.10); a new batch shape compiles its own, as the whole-model
step does. Each graph of the step has a never-taken branch (`model.runtime.actor_thread_branch`): MindSpore then runs
it on its actor thread instead of the calling thread, whose spinning beside the kernel pool cost the small graphs
~1/3 of their MatMul speed on 2 cores.

Where it does not apply, `layerwise_unsupported` says why and the trainer runs the whole-model `TrainStep`:
tensor parallel (the layers hold collectives), a parameter set that is neither the whole model nor exactly the
layers' LoRA adapters (those train through the written-out functions: base weights, norms, head and embedding
frozen, no gradient computed for them), layers whose parameters differ.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from model.kernel_ops import embed_grad, grad_put
from model.lora import is_lora_param
from model.runtime import actor_thread_branch, graphs_back_to_back, weight_slot
from tasks.runtime.mesh import Mesh
from tasks.training.adamw import AdamW
from tasks.training.layer_grad import functional_unsupported, layer_functions
from tasks.training.optimizer import parallelize_optimizer
from tasks.training.step import TrainStep, causal_lm_loss_fn


def layerwise_unsupported(net, params: list[Parameter], mesh=None) -> str | None:
    """Why the layer-at-a-time step cannot run `net` over `params` (None when it can)."""
    if not all(hasattr(net, a) for a in ("layers", "layer_inputs", "head_logits", "loss_fn")):
        return f"{type(net).__name__} is not a decoder with layer_inputs / layers / head_logits"
    if (target := ms.get_context("device_target")) != "CPU":
        return f"device target {target} (built for CPU: every gradient passes through host memory)"
    if mesh is not None and mesh.tp > 1:
        return "tensor parallel (the layers hold collectives)"
    if {id(p) for p in params} != {id(p) for p in net.trainable_params()} or not params:
        return "the step trains a subset of the parameters (frozen weights)"
    if any(is_lora_param(n) for n, _ in net.parameters_and_names()):
        why = functional_unsupported(net)  # LoRA: only the written-out layer functions train the adapters alone
        if why is not None:
            return f"LoRA adapters without the written-out layer functions ({why})"
        adapters = {id(p) for layer in net.layers for n, p in layer.parameters_and_names() if is_lora_param(n)}
        if {id(p) for p in params} != adapters:
            return "the step trains other parameters than the layers' LoRA adapters (or not all of them)"
    shapes = [
        [(p.name.split(".", 2)[-1], p.shape, p.dtype) for _, p in layer.parameters_and_names()] for layer in net.layers
    ]
    if any(s != shapes[0] for s in shapes[1:]):
        return "the layers' parameters differ"
    return None


LAYERS_PER_GRAPH = 1
"""At most this many consecutive decoder layers per call of the layer graphs (the largest divisor of the layer count
not above it). One: measured on SmolLM2-135M, 2 x 128, 2 cores (AMD EPYC, AVX-512), a step took 2.3 s / 3.33 GB
with one layer per call, 2.5 s / 3.51 GB with three and more with six (the graphs hold that many layers'
activations, and a bigger graph was not faster per layer here)."""


def layers_per_graph(num_layers: int, most: int = LAYERS_PER_GRAPH) -> int:
    return max(d for d in range(1, min(most, num_layers) + 1) if num_layers % d == 0)


def _views(ps):
    """Plain Tensors over Parameters' memory (no copy): a Parameter as a graph input compiles one graph per name."""
    return tuple(Tensor.from_numpy(p.asnumpy()) for p in ps)


def _host_norm(arrays) -> float:
    """sqrt(Σ g²) over float32 arrays: each a BLAS dot in float32 (no temporary), the sum in float64; inf/nan when
    any element is."""
    total = 0.0
    for a in arrays:
        v = a.reshape(-1)
        total += float(np.dot(v, v))
    return math.sqrt(total) if math.isfinite(total) else float("nan")


class _Graph(nn.Cell):
    """`fn(target, *args)` as a Cell (for `ms.jit`): static shapes, the fused cells run (they fail in dynamic ones).
    The last argument is the never-taken branch's flag; returns (fn's result, the flag)."""

    def __init__(self, target, fn):
        super().__init__(auto_prefix=False)
        self.target, self.fn = target, fn

    def construct(self, *args):
        return self.fn(self.target, *args[:-1]), actor_thread_branch(args[-1])


def _prologue(net, ids):
    return net.layer_inputs(ids)


def _head_loss(net, x, labels):
    return net.loss_fn(net.head_logits(x), labels)


def _chunk_forward(load):
    """The layer graph's function: the weights `ws` assigned into the template's layers, then those layers."""

    def forward(chunk, x, cos, sin, mask, *ws):
        x = load(x, ws)
        for layer in chunk:
            x = layer(x, cos, sin, mask)
        return x

    return forward


class _LayerGrad(nn.Cell):
    """(d input, d weights) of the template's layers given their upstream gradient `dy`, the weights `ws` assigned
    first; the forward recomputed from the layers' input. GradOperation's sens needs a static graph."""

    def __init__(self, template, targets, load):
        super().__init__(auto_prefix=False)
        self.layer, self.weights, self.load = template, ms.ParameterTuple(targets), load
        self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

    def run(self, x, cos, sin, mask):
        cos, sin, mask = ops.stop_gradient(cos), ops.stop_gradient(sin), ops.stop_gradient(mask)
        for layer in self.layer:
            x = layer(x, cos, sin, mask)
        return x

    def construct(self, *args):
        x, cos, sin, mask, dy, flag, ws = args[0], args[1], args[2], args[3], args[4], args[5], args[6:]
        return self.grad(self.run, self.weights)(self.load(x, ws), cos, sin, mask, dy), actor_thread_branch(flag)


class _HeadGrad(nn.Cell):
    """The loss (× its token weight) and the gradients of loss × weight × scale at the last hidden state and at the
    final norm's and the head's weights."""

    def __init__(self, net, head_params):
        super().__init__(auto_prefix=False)
        self.net = net
        self.grad = ms.value_and_grad(self.scaled, 0, ms.ParameterTuple(head_params), has_aux=True)

    def scaled(self, x, labels, weight, scale):
        loss = self.net.loss_fn(self.net.head_logits(x), labels) * weight
        return loss * scale, loss

    def construct(self, x, labels, weight, scale, flag):
        (_, loss), grads = self.grad(x, labels, weight, scale)
        return loss, grads, actor_thread_branch(flag)


class LayerwiseTrainStep(TrainStep):
    """`TrainStep`'s interface and arithmetic (see its docstring: token weights, loss scale, accumulation, data
    parallel, allow), the decoder run one layer at a time (module docstring). `eval_loss(ids, labels)` is the
    validation loss through the same layer graph (no whole-model forward graph either)."""

    def __init__(
        self,
        net,
        params: list[Parameter],
        optimizer: AdamW,
        accumulation: int = 1,
        loss_scale: float = 1.0,
        dp_group: str | None = None,
        dp: int = 1,
    ):
        self.net, self.params, self._grad_arrays = net, list(params), None
        self._squares: dict[int, float] = {}  # Σ g² per gradient slot, left by the last micro-batch's writes
        super().__init__(
            None, params, optimizer, accumulation=accumulation, loss_scale=loss_scale, dp_group=dp_group, dp=dp
        )

    def _compile(self, loss_fn, params, optimizer, accumulation, zero, reduce_grads, reduce_loss) -> None:
        net = self.net
        layers = list(net.layers)
        # the layer's forward and written-out backward as functions of its weights (tasks/training/layer_grad.py):
        # no recomputed forward, no template; else the autodiff layer graph over a template of g layers
        self.fn = layer_functions(net)
        # the gradient writes on the kernels' threads where the fused build runs (else NumPy's copy and norm)
        self._put = grad_put() if self.fn is not None else None
        self._embed_add = embed_grad() if self.fn is not None else None
        self.flag = Tensor(0, ms.int32)  # the graphs' never-taken branch (model.runtime.actor_thread_branch)
        g = 1 if self.fn is not None else layers_per_graph(len(layers))
        self.layer_params = [tuple(p for _, p in layer.parameters_and_names()) for layer in layers]
        self.chunks = [sum(self.layer_params[i : i + g], ()) for i in range(0, len(layers), g)]
        # LoRA (written-out path only): the adapters train, the base weights, norms, head and embedding are frozen
        self.lora = self.fn is not None and self.fn.lora
        trained = [self.fn.trained(layer) for layer in layers] if self.fn is not None else self.layer_params
        self.tied = bool(net.config.tie_embeddings)
        self.embed = net.embed_tokens.weight
        head = self.embed if self.tied else net.lm_head.weight
        self.head_weights = [net.norm.weight, head]  # the head is the embedding when tied
        self.head_params = head_params = [] if self.lora else self.head_weights  # those that train
        # where each optimizer parameter's gradient comes from: ("layer", i, j), ("head", j) or ("embed",)
        where = {id(p): ("layer", i, j) for i, ps in enumerate(trained) for j, p in enumerate(ps)}
        where.update({id(p): ("head", j) for j, p in enumerate(head_params)})
        if not self.lora:
            where[id(self.embed)] = ("embed",)
        self.slot = {where[id(p)]: k for k, p in enumerate(params)}  # gradient source -> its index in `_grads()`
        self.head_slots = [self.slot[where[id(p)]] for p in head_params]

        self._first = ms.jit(_Graph(net, _prologue))
        if self.fn is None:
            template, targets, load = weight_slot(layers[:g])  # g consecutive layers per call of the layer graphs
            self._layer = ms.jit(_Graph(template, _chunk_forward(load)))
            self._layer_grad = ms.jit(_LayerGrad(template, targets, load))
            self._head_grad = ms.jit(_HeadGrad(net, head_params))
        self._head_loss = ms.jit(_Graph(net, _head_loss))

        # one process (no reduction): the gradient norm comes from the host (`_host_norm`), so the update graph holds
        # no squares (a model-sized buffer it would keep); data parallel: the norm of the reduced gradients, in it
        self.host_norm = self.dp == 1 and hasattr(optimizer, "update")

        @ms.jit
        def apply(lr, step, grad_scale, loss, allow, *grads):  # varargs: a tuple argument recompiled every call
            grads = reduce_grads(grads)
            gnorm, finite = optimizer(grads, lr, step, grad_scale, allow)
            if zero:  # after the gradients' collectives on every rank
                loss = ops.depend(loss, gnorm)
            return gnorm, finite, reduce_loss(loss)

        @ms.jit
        def apply_normed(lr, step, grad_scale, loss, allow, gnorm, *grads):
            gnorm, finite = optimizer.update(grads, gnorm, lr, step, grad_scale, allow)
            return gnorm, finite, loss

        self._apply_grads = apply_normed if self.host_norm else apply

    def _inputs(self, ids: np.ndarray, keep: bool = True):
        """(each layer's input and the last layer's output, what each layer's backward needs (`layer_grad.SAVED`;
        nothing on the autodiff path, or with `keep` False), cos, sin, mask)."""
        (x, cos, sin, mask), _ = self._first(Tensor(ids), self.flag)
        xs, saved = [x], []
        for ps in self.chunks:
            if self.fn is not None:
                y, *kept, _ = self.fn.forward(xs[-1], cos, sin, self.flag, *_views(ps))
                saved.append(tuple(kept) if keep else None)
                del kept
            else:
                y, _ = self._layer(xs[-1], cos, sin, mask, *_views(ps), self.flag)
            xs.append(y)
            y.asnumpy()  # wait for it where the host queue is async: queued calls ran ~1.3x slower (135M, 2 cores)
        return xs, saved, cos, sin, mask

    def eval_loss(self, ids, labels) -> Tensor:
        """The mean loss of one batch (validation), one layer at a time."""
        ids = ids.asnumpy() if isinstance(ids, Tensor) else np.asarray(ids)
        labels = labels if isinstance(labels, Tensor) else Tensor(np.asarray(labels))
        with graphs_back_to_back():
            xs, *_ = self._inputs(ids, keep=False)
            return self._head_loss(xs[-1], labels, self.flag)[0]

    def _micro_grads(
        self, ids: np.ndarray, labels: np.ndarray, weight: Tensor, scale: Tensor, first: bool, last: bool = True
    ):
        """One micro-batch's forward and backward; its gradients (× weight × scale) written (`first`) or added into
        `_grads()`, each graph's as soon as it returns (with the kernels, the `last` micro-batch's writes also leave
        each gradient's Σ g² in `_squares`, but the embedding's, finished afterwards). Returns the loss × weight."""
        acc, sq = self._grads(), self._squares
        slot = self.slot
        square = last and self.host_norm  # the last micro-batch's writes give the global norm's squares too

        def put(k: int, g: np.ndarray) -> None:
            if self._put is not None and g.dtype == np.float32 and g.flags.c_contiguous:
                s = self._put(acc[k], g, not first, square)  # one pass on the kernels' threads
                if square:
                    sq[k] = s
            elif first:
                np.copyto(acc[k], g)
            else:
                acc[k] += g

        xs, saved, cos, sin, mask = self._inputs(ids)
        if self.fn is not None:
            loss, dx, *head_grads, _ = self.fn.head(
                xs[-1], Tensor(labels), weight, scale, self.flag, *_views(self.head_weights)
            )  # no head gradients under LoRA
        else:
            loss, (dx, head_grads), _ = self._head_grad(xs[-1], Tensor(labels), weight, scale, self.flag)
        xs[-1] = None
        for k, g in zip(self.head_slots, head_grads):  # the tied head's is the embedding's, its rows added below
            put(k, g.asnumpy())
        del head_grads
        n = len(self.layer_params[0])  # parameters per layer
        per = len(self.chunks[0]) // n  # layers per chunk
        for i in reversed(range(len(self.chunks))):
            if self.fn is not None:  # one layer per chunk; its trained parameters' gradients (the adapters' with LoRA)
                dx, *dws, _ = self.fn.backward(xs[i], cos, sin, self.flag, dx, *saved[i], *_views(self.chunks[i]))
                saved[i] = None
                where = [slot[("layer", i, j)] for j in range(len(dws))]
            else:
                ((dx, *_), dws), _ = self._layer_grad(xs[i], cos, sin, mask, dx, self.flag, *_views(self.chunks[i]))
                where = [slot[("layer", i * per + j // n, j % n)] for j in range(len(dws))]
            for k, w in zip(where, dws):
                put(k, w.asnumpy())
            del dws  # the graph's output buffers go back to MindSpore's pool for the next layer's call
            xs[i] = None
        if self.lora:
            return loss
        # the embedding's gradient: the first layer's d(input) summed onto the ids' rows (+ the tied head's, above):
        # MsllmEmbedGrad where the kernels are built, else NumPy
        k = slot[("embed",)]
        e = acc[k]
        h = self.embed.shape[1]
        d = dx.asnumpy().reshape(-1, h)
        if self._embed_add is not None and d.dtype == np.float32 and d.flags.c_contiguous:
            s = self._embed_add(e, d, ids, first and not self.tied, square)  # one pass on the kernels' threads
            if square:
                sq[k] = s
            else:
                sq.pop(k, None)
            return loss
        if first and not self.tied:
            e.fill(0.0)
        flat_ids = ids.reshape(-1)
        order = np.argsort(flat_ids, kind="stable")
        rows, starts = np.unique(flat_ids[order], return_index=True)
        e[rows] += np.add.reduceat(d.astype(np.float32)[order], starts, axis=0)
        sq.pop(k, None)  # rows added after its write: its squares come from `_host_norm`
        return loss

    def _norm(self, acc: list[np.ndarray]) -> float:
        """sqrt(Σ g²) over the step's gradients: the squares the writes left (`_squares`), the rest by `_host_norm`."""
        sq = self._squares
        rest = [a for k, a in enumerate(acc) if k not in sq]
        total = sum(sq.values()) + (_host_norm(rest) ** 2 if rest else 0.0)
        return math.sqrt(total) if math.isfinite(total) else float("nan")

    def _grads(self) -> list[np.ndarray]:
        """The step's gradient arrays, one per optimizer parameter, allocated once and rewritten every step. Fresh
        arrays each step cost a set of gradients more: a compiled graph keeps its last call's inputs alive until its
        next call (docs/MINDSPORE_CPU.md, "Memory"), so the update graph held the previous step's gradients while
        this step's were made (SmolLM2-135M, 2 x 128: 3.33 -> 3.00 GB steady)."""
        if self._grad_arrays is None:
            self._grad_arrays = [np.zeros(p.shape, ms.dtype_to_nptype(p.dtype)) for p in self.params]
        return self._grad_arrays

    def __call__(self, micro_batches, lr: float, step: int, loss_scale: float | None = None, allow: bool = True):
        with graphs_back_to_back():  # ~2L + 3 graphs: the pool spins between them instead of sleeping
            return self._step(micro_batches, lr, step, loss_scale, allow)

    def _step(self, micro_batches, lr: float, step: int, loss_scale: float | None, allow: bool):
        s = self.loss_scale if loss_scale is None else loss_scale
        scale = Tensor(s, ms.float32)
        weights = [Tensor(w, ms.float32) for w in self.token_weights([labels for _, labels in micro_batches])]
        losses = []
        self._squares.clear()
        for m, ((ids, labels), w) in enumerate(zip(micro_batches, weights)):
            last = m == len(micro_batches) - 1
            loss = self._micro_grads(np.asarray(ids), np.asarray(labels), w, scale, first=m == 0, last=last)
            losses.append(float(loss.asnumpy()))
        acc = self._grads()
        # the unscaled gradient's norm (a loss scale of 0 gives NaN, as 0 / 0 in the graph: the step is skipped)
        norm = (Tensor(self._norm(acc) / (s * self.k) if s else float("nan"), ms.float32),) if self.host_norm else ()
        grads = tuple(Tensor.from_numpy(a) for a in acc)
        gnorm, finite, loss = self._apply_grads(
            Tensor(lr, ms.float32),
            Tensor(float(step), ms.float32),
            Tensor(s * self.k, ms.float32),
            Tensor(sum(losses) / len(losses), ms.float32),
            Tensor(bool(allow), ms.bool_),
            *norm,
            *grads,
        )
        del grads
        loss = float(loss.asnumpy())
        finite = bool(finite.asnumpy())
        self._rebuild_if(finite and allow)
        return loss, float(gnorm.asnumpy()), finite and math.isfinite(loss)


def train_step(
    net, loss_fn, params: list[Parameter], optimizer, *, accumulation: int = 1, mesh=None, layerwise: bool = True
) -> tuple[TrainStep, str]:
    """The step the trainer runs (`train.layerwise`, true by default): layer at a time where it applies and
    `layerwise` is on, else the whole-model `TrainStep`. Returns (step, how: "layer at a time", "whole model" or
    "whole model: <why>")."""
    dp_group, dp = (mesh.dp_group, mesh.dp) if mesh is not None else (None, 1)
    if not layerwise:
        return TrainStep(loss_fn, params, optimizer, accumulation=accumulation, dp_group=dp_group, dp=dp), "whole model"
    why = layerwise_unsupported(net, params, mesh)
    if why is None:
        return LayerwiseTrainStep(
            net, params, optimizer, accumulation=accumulation, dp_group=dp_group, dp=dp
        ), "layer at a time"
    return TrainStep(
        loss_fn, params, optimizer, accumulation=accumulation, dp_group=dp_group, dp=dp
    ), f"whole model: {why}"


def causal_lm_train_step(
    net,
    params: list[Parameter],
    *,
    weight_decay: float = 0.1,
    grad_clip: float | None = 1.0,
    beta1: float = 0.9,
    beta2: float = 0.95,
    eps: float = 1e-8,
    accumulation: int = 1,
    mesh=None,
    in_place: bool = True,
    layerwise: bool = False,
) -> TrainStep:
    """A compiled next-token train step for `net` over `params` with AdamW (norms/embeddings not decayed).

    What the benchmarks, the memory measurement and the optimizer tests use; the trainer builds
    the same pieces from its train section. With a `mesh` (tasks/runtime/distributed.py) the step averages
    gradients over its data-parallel group and clips by the norm over its tensor-parallel slices.
    `in_place=False` keeps the optimizer on MindSpore's own kernels (the build's decision for it:
    tasks/modeling/build.py `Kernels.optimizer`; the model's fused cells are the build's too). `layerwise`: the
    layer-at-a-time step where it applies (as `train.layerwise: true`), else the whole-model graph.
    """
    mesh = mesh or Mesh()
    train = SimpleNamespace(  # the shape of tasks.config.schema.TrainSection that the optimizer reads
        optimizer=SimpleNamespace(
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            decay_norms_and_biases=False,
            decay_embeddings=False,
        ),
        loop=SimpleNamespace(grad_clip=grad_clip),
    )
    opt = parallelize_optimizer(params, train, mesh, in_place)
    return train_step(
        net, causal_lm_loss_fn(net), params, opt, accumulation=accumulation, mesh=mesh, layerwise=layerwise
    )[0]
