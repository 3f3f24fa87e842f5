"""Probe (not used by the pipeline): a train step that runs the decoder ONE LAYER AT A TIME, beside the trainer's
whole-model step, for the next step of issue 33 (train peak RSS <= HF sdpa). Prints one JSON line per side.

MindSpore's CPU graph keeps a buffer for every kernel of a compiled graph (docs/MINDSPORE_CPU.md, "Memory"), so the
whole-model train step holds every layer's forward and backward intermediates at once, and `recompute()` does not
change that (SmolLM2-135M, 2 x 128: 4.91 GB without, 5.10 GB with). Here the forward runs each layer through ONE
layer graph (the eval scorer's `model.runtime.layerwise_hidden_states` mechanism: the layer's weights assigned into a
copy of layer 0 inside the graph) keeping only each layer's input, the head and loss run as one graph that returns
the gradient at the last hidden state, and the backward runs ONE layer-gradient graph per layer from the last,
recomputing that layer's forward (GradOperation with the upstream gradient as sens). The embedding's gradient is
the head's (tied) plus the first layer's input gradient scattered onto the ids. Each layer's AdamW step runs
right after its gradients (nn.AdamWeightDecay over that layer's parameters, one jit graph each: the same math per
parameter as one optimizer over all), so one layer's gradients are alive at a time, not all of them.

    python scripts/probes/layerwise_train.py --preset smollm2-135m --batch 2 --seq 128 --steps 4

Measured 2026-12-03 on the 2-core AMD EPYC (AVX-512), quiet, 2 x 128, nn.AdamWeightDecay on both sides, steps
after the first (compilation) averaged:

    SmolLM2-135M --fused:  86.5 vs 81.2 tokens/s (1.07x), peak 3.10 vs 3.83 GB; losses equal within fp32 rounding
    SmolLM2-135M plain:    75.0 vs 74.9 tokens/s, peak 3.12 vs 4.80 GB; the same losses to the last digit
    SmolLM2-360M --fused:  38.7 vs 37.1 tokens/s, peak 6.92 vs 7.77 GB

and the first step (compilation) 10 s instead of 26 at 135M. (HF sdpa at 135M: 3.37 GB in scripts/bench/train.py.)
Keeping every gradient until one optimizer step over all (what global-norm clipping and the finite-step skip
need) cost +0.35 GB at 135M. What remains for the trainer (docs/MEMORY.md, "Train"): clipping and the finite check
with per-layer updates (the norm needs every gradient before any update), accumulation, the trainer's own AdamW
and fused loss, data / tensor parallel.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def _hwm_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1e6


def run_side(a) -> dict:
    import numpy as np

    from model.runtime import setup_mindspore, weight_slot

    setup_mindspore()
    import mindspore as ms
    from mindspore import Tensor, nn, ops

    from model.config import ModelConfig
    from model.llama import causal_lm_loss
    from tasks.training.build import build_network

    cfg = ModelConfig.from_name(a.preset)
    net = build_network("llama", cfg, seed=0, fused_kernels=a.fused).net
    rng = np.random.RandomState(0)
    batches = [rng.randint(3, cfg.vocab_size, (a.batch, a.seq + 1)).astype(np.int32) for _ in range(a.steps)]

    if a.side == "standard":
        opt = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-4)

        def loss_of(ids, labels):
            return net.loss(ids, labels)

        grad_fn = ms.value_and_grad(loss_of, None, opt.parameters)

        @ms.jit
        def step(ids, labels):
            loss, grads = grad_fn(ids, labels)
            opt(grads)
            return loss

        def train(tok):
            return float(step(Tensor(tok[:, :-1]), Tensor(tok[:, 1:])).asnumpy())
    else:
        train = _layerwise_step(net, cfg, ms, Tensor, nn, ops, np, weight_slot, causal_lm_loss)

    losses, times = [], []
    for tok in batches:
        t0 = time.perf_counter()
        losses.append(train(tok))
        times.append(time.perf_counter() - t0)
    steady = times[1:] or times
    return {"side": a.side, "losses": losses, "first_step_s": round(times[0], 2),
            "step_s": round(sum(steady) / len(steady), 2),
            "tokens_per_s": round(a.batch * a.seq * len(steady) / sum(steady), 1), "peak_rss_gb": round(_hwm_gb(), 3)}


def _layerwise_step(net, cfg, ms, Tensor, nn, ops, np, weight_slot, causal_lm_loss):
    layers = list(net.layers)
    template, targets, load = weight_slot(layers[0])
    params = [tuple(p for _, p in layer.parameters_and_names()) for layer in layers]

    def prologue(net, ids):
        return net.layer_inputs(ids)

    def forward(layer, x, cos, sin, mask, *ws):
        return layer(load(x, ws), cos, sin, mask)

    class Static(nn.Cell):  # static shapes (a train step's are fixed): the fused cells fail in dynamic-shape graphs
        def __init__(self, target, fn):
            super().__init__(auto_prefix=False)
            self.target, self.fn = target, fn

        def construct(self, *args):
            return self.fn(self.target, *args)

    first, layer_forward = ms.jit(Static(net, prologue)), ms.jit(Static(template, forward))

    class LayerGrad(nn.Cell):  # static shapes: GradOperation's sens cannot be dynamic
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.layer, self.weights = template, ms.ParameterTuple(targets)
            self.grad = ops.GradOperation(get_all=True, get_by_list=True, sens_param=True)

        def run(self, x, cos, sin, mask):
            return self.layer(x, cos, sin, mask)

        def construct(self, *args):
            x, cos, sin, mask, dy, ws = args[0], args[1], args[2], args[3], args[4], args[5:]
            return self.grad(self.run, self.weights)(load(x, ws), cos, sin, mask, dy)

    head_weight = net.embed_tokens.weight if cfg.tie_embeddings else net.lm_head.weight

    class HeadGrad(nn.Cell):
        def __init__(self):
            super().__init__(auto_prefix=False)
            self.net, self.weights = net, ms.ParameterTuple([net.norm.weight, head_weight])
            self.grad = ops.GradOperation(get_all=True, get_by_list=True)

        def loss(self, x, labels):  # MindSpore's own loss ops: with the fused loss cell, grad_jit failed ("pointer null")
            return causal_lm_loss(self.net.head_logits(x), labels)

        def construct(self, *args):
            return self.loss(args[0], args[1]), self.grad(self.loss, self.weights)(args[0], args[1])

    class OptStep(nn.Cell):  # AdamW over some parameters, in one graph (the same math per parameter as one optimizer)
        def __init__(self, ps):
            super().__init__(auto_prefix=False)
            self.opt = nn.AdamWeightDecay(list(ps), learning_rate=1e-4)

        def construct(self, *grads):
            return self.opt(grads)

    layer_grad, head_grad = ms.jit(LayerGrad()), ms.jit(HeadGrad())
    # each layer's AdamW step right after its gradients (then they are dropped); the rest after the embedding's
    layer_opts = [ms.jit(OptStep(ps)) for ps in params]
    rest = [p for p in net.trainable_params() if not any(p is q for ps in params for q in ps)]
    rest_opt = ms.jit(OptStep(rest))

    def views(ps):  # plain Tensors over the Parameters' memory: a Parameter input compiles a graph per name
        return (Tensor.from_numpy(p.asnumpy()) for p in ps)

    def train(tok):
        ids, labels = Tensor(tok[:, :-1]), Tensor(tok[:, 1:])
        x, cos, sin, mask = first(ids)
        xs = [x]
        for ps in params:
            xs.append(layer_forward(xs[-1], cos, sin, mask, *views(ps)))
        loss, (dx, (dnorm, dhead)) = head_grad(xs[-1], labels)
        dx = dx[0]
        grads = {net.norm.weight.name: dnorm}
        if cfg.tie_embeddings:
            emb = dhead.asnumpy().copy()
        else:
            grads[head_weight.name], emb = dhead, np.zeros(net.embed_tokens.weight.shape, np.float32)
        for i in reversed(range(len(layers))):
            (dx, *_), dws = layer_grad(xs[i], cos, sin, mask, dx, *views(params[i]))
            layer_opts[i](*dws)
            xs[i + 1] = None
        np.add.at(emb, tok[:, :-1].reshape(-1), dx.asnumpy().reshape(-1, cfg.hidden_size))
        grads[net.embed_tokens.weight.name] = Tensor.from_numpy(emb)
        rest_opt(*(grads[p.name] for p in rest))
        return float(loss.asnumpy())

    return train


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fused", action="store_true", help="the fused-kernel cells (the trainer's default) on both sides")
    ap.add_argument("--side", choices=["standard", "layerwise"], default=None)
    a = ap.parse_args()
    if a.side:
        print(json.dumps(run_side(a)))
        return
    for side in ("standard", "layerwise"):  # one process each (each peak its own), one after the other
        out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--batch", str(a.batch), "--seq",
                              str(a.seq), "--steps", str(a.steps), "--side", side] + ["--fused"] * a.fused,
                             capture_output=True, text=True)
        print(out.stdout.strip().splitlines()[-1] if out.returncode == 0 else json.dumps(
            {"side": side, "error": (out.stderr.strip().splitlines() or ["?"])[-1]}), flush=True)


if __name__ == "__main__":
    main()
