"""LoRA (model/lora.py): injection, frozen base, merge = W + (alpha/r)·B·A, idempotent merge, training through fit()."""

from __future__ import annotations

import mindspore as ms
import numpy as np
import pytest
from helpers import decoder_reduction, fp32_tol
from mindspore import Tensor

from model.config import ModelConfig
from model.llama import LlamaForCausalLM, causal_lm_loss
from model.lora import (
    LoRALinear,
    LoRASlots,
    inject_lora,
    lora_layers,
    lora_state_dict,
    mark_only_lora_trainable,
    match_targets,
    merge_adapter,
    merge_lora,
    trainable_summary,
    unmerge_lora,
)
from tasks.config.schema import CheckpointSection, TrainSection
from tasks.training.trainer import Sinks, TrainData, Trainee, fit

CFG = ModelConfig.from_name("tiny")
IDS = Tensor(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 24)).astype(np.int32))


def _logit_tol(want: np.ndarray, rank: int = 4) -> float:
    """Merged W + s·B·A against W x + s·B(A x) (or another compiled graph): the same sums in another float32 order
    through the decoder's reductions at 24 keys, plus the adapter's rank (fp32_tol)."""
    return fp32_tol(np.abs(want).max(), decoder_reduction(CFG, 24) + rank)


def _net(targets="q_proj,v_proj", rank=4, alpha=8.0, dropout=0.0, seed=0):
    net = LlamaForCausalLM(CFG, seed=seed)
    names = inject_lora(net, targets, rank=rank, alpha=alpha, dropout=dropout, seed=1)
    return net, names


def _randomise_b(net, scale=0.05):
    rng = np.random.default_rng(3)
    for _, layer in lora_layers(net):
        layer.lora_B.set_data(Tensor((rng.standard_normal(layer.lora_B.shape) * scale).astype(np.float32)))


def test_injected_adapter_starts_as_exact_noop_with_stable_names():
    base = LlamaForCausalLM(CFG, seed=0)
    expected = base(IDS).asnumpy()
    net, names = _net()
    assert names == [f"layers.{i}.self_attn.{p}" for i in range(CFG.num_layers) for p in ("q_proj", "v_proj")]
    np.testing.assert_array_equal(net(IDS).asnumpy(), expected)  # B = 0: bit-identical to the base
    pnames = [p.name for p in net.get_parameters()]
    assert {p.name for p in base.get_parameters()} <= set(pnames)  # base weights keep their names
    assert "layers.0.self_attn.q_proj.lora_A" in pnames and "layers.1.self_attn.v_proj.lora_B" in pnames
    q = dict(lora_layers(net))["layers.0.self_attn.q_proj"]
    assert q.scaling == 8.0 / 4 and q.lora_A.shape == (4, CFG.hidden_size) and q.lora_B.shape == (CFG.hidden_size, 4)
    assert np.abs(q.lora_A.asnumpy()).max() > 0 and not q.lora_B.asnumpy().any()  # A random, B zero


def test_target_modules_names_comma_string_and_regex():
    names = [
        "layers.0.self_attn.q_proj",
        "layers.0.self_attn.v_proj",
        "layers.0.mlp.up_proj",
        "layers.1.self_attn.q_proj",
        "lm_head",
    ]
    assert match_targets(names, ["q_proj"]) == ["layers.0.self_attn.q_proj", "layers.1.self_attn.q_proj"]
    assert match_targets(names, "q_proj,v_proj") == names[:2] + [names[3]]
    assert match_targets(names, r"layers\.1\..*proj$") == ["layers.1.self_attn.q_proj"]
    assert match_targets(names, r"mlp|lm_head") == ["layers.0.mlp.up_proj", "lm_head"]
    with pytest.raises(ValueError, match="qproj"):
        match_targets(names, ["qproj"])
    with pytest.raises(ValueError, match="match no projection"):
        match_targets(names, r"layers\.9\.")
    net, _ = _net()
    with pytest.raises(ValueError, match="already has LoRA"):
        inject_lora(net, ["k_proj"], rank=2, alpha=2)


def test_only_lora_trainable_and_the_printed_count():
    net, names = _net(targets=r"self_attn\.(q|k|v|o)_proj|mlp\.down_proj", rank=2)
    params = mark_only_lora_trainable(net)
    assert {p.name for p in params} == {f"{n}.lora_{x}" for n in names for x in "AB"}
    assert {p.name for p in net.trainable_params()} == {p.name for p in params}
    s = trainable_summary(net)
    expect = sum(2 * (layer.in_features + layer.out_features) for _, layer in lora_layers(net))
    assert s.trainable == expect and s.total == CFG.num_parameters + expect
    assert s.line() == (
        f"trainable params: {expect:,} || all params: {s.total:,} || trainable: {100 * expect / s.total:.4f}%"
    )


def test_merged_logits_equal_base_plus_adapter_and_merging_twice_changes_nothing():
    net, _ = _net(targets=r"_proj$", rank=4)  # every projection, so MLP and attention paths are covered
    _randomise_b(net)
    base_w = {p.name: p.asnumpy() for p in net.get_parameters() if "lora" not in p.name}
    adapter = lora_state_dict(net)
    unmerged = net(IDS).asnumpy()
    # the adapter matters: it moves the logits by far more than the bound the comparisons below allow
    assert np.abs(unmerged - LlamaForCausalLM(CFG, seed=0)(IDS).asnumpy()).max() > 100 * _logit_tol(unmerged)

    assert merge_lora(net) == 2 * 7
    merged = net(IDS).asnumpy()
    np.testing.assert_allclose(merged, unmerged, atol=_logit_tol(unmerged), rtol=0)
    once = {p.name: p.asnumpy() for p in net.get_parameters()}
    merge_lora(net)  # merging twice changes nothing
    for p in net.get_parameters():
        np.testing.assert_array_equal(p.asnumpy(), once[p.name])
    np.testing.assert_array_equal(net(IDS).asnumpy(), merged)

    # the state-dict merge (what the `merged` artifact holds) is the same W + (alpha/r)·B·A
    full = merge_adapter(base_w, adapter, scaling=8.0 / 4)
    assert set(full) == set(base_w)
    for name, w in full.items():
        np.testing.assert_array_equal(w, once[name])
    q = dict(lora_layers(net))["layers.0.self_attn.q_proj"]
    w = "layers.0.self_attn.q_proj.weight"
    b_, a_ = adapter[w[:-6] + "lora_B"].astype(np.float64), adapter[w[:-6] + "lora_A"].astype(np.float64)
    ref = base_w[w].astype(np.float64) + 2.0 * b_ @ a_
    # float32 against float64: a sum over the rank (4), then the add, at the scale of its terms
    assert (
        np.abs(q.weight.asnumpy() - ref) <= fp32_tol(np.abs(base_w[w]) + 2.0 * np.abs(b_) @ np.abs(a_), 4 + 1)
    ).all()
    np.testing.assert_array_equal(merge_adapter(full, {}, 2.0)[w], full[w])  # an empty adapter merges nothing

    plain = LlamaForCausalLM(CFG, seed=5)  # a plain model with the merged state dict
    for p in plain.get_parameters():
        p.set_data(Tensor(full[p.name]))
    np.testing.assert_allclose(plain(IDS).asnumpy(), unmerged, atol=_logit_tol(unmerged), rtol=0)

    unmerge_lora(net)
    unmerge_lora(net)  # idempotent too
    for p in net.get_parameters():
        if p.name in base_w:  # (W + s·B·A) - s·B·A: two roundings at the scale of W and of s·B·A
            scale = np.abs(base_w[p.name]) + np.abs(full[p.name] - base_w[p.name])
            assert (np.abs(p.asnumpy() - base_w[p.name]) <= fp32_tol(scale, 4 + 2)).all(), p.name
    np.testing.assert_allclose(net(IDS).asnumpy(), unmerged, atol=_logit_tol(unmerged), rtol=0)


def test_merge_adapter_rejects_adapters_of_another_model():
    w = {"a.weight": np.zeros((4, 3), np.float32)}
    with pytest.raises(ValueError, match="only one half"):
        merge_adapter(w, {"a.lora_A": np.zeros((2, 3), np.float32)}, 1.0)
    with pytest.raises(ValueError, match="do not fit"):
        merge_adapter(w, {"a.lora_A": np.zeros((2, 5), np.float32), "a.lora_B": np.zeros((4, 2), np.float32)}, 1.0)
    with pytest.raises(ValueError, match="no base weight"):
        merge_adapter(w, {"b.lora_A": np.zeros((2, 3), np.float32), "b.lora_B": np.zeros((4, 2), np.float32)}, 1.0)


def test_dropout_is_a_deterministic_function_of_the_input_and_off_in_eval():
    from model.layers import Linear

    rng = np.random.default_rng(0)
    layer = LoRALinear(Linear(rng.standard_normal((16, 32)).astype(np.float32)), rank=32, alpha=32, dropout=0.5, seed=3)
    layer.lora_A.set_data(Tensor(np.eye(32, dtype=np.float32)))  # A = I, B = I[:16]: the LoRA path
    layer.lora_B.set_data(Tensor(np.eye(16, 32, dtype=np.float32)))  # passes x[:, :16] (dropped) through
    x = Tensor(rng.standard_normal((64, 32)).astype(np.float32))
    base = x.asnumpy() @ layer.weight.asnumpy().T
    layer.set_train(True)
    a, b = layer(x).asnumpy(), layer(x).asnumpy()
    np.testing.assert_array_equal(a, b)  # same input, same mask: resume replays it exactly
    lora_part = a - base
    # numpy's float32 x·Wᵀ against the layer's (32 terms), the LoRA path's two sums of 32, at their terms' scale
    xn, wn = np.abs(x.asnumpy()), np.abs(layer.weight.asnumpy())
    tol = fp32_tol((xn @ wn.T).max() + 2.0 * xn.max(), 3 * 32)
    dropped = np.isclose(lora_part, 0, rtol=0, atol=tol).mean()
    assert 0.4 < dropped < 0.6
    kept = ~np.isclose(lora_part, 0, rtol=0, atol=tol)
    np.testing.assert_allclose(lora_part[kept], 2.0 * x.asnumpy()[:, :16][kept], rtol=0, atol=tol)  # 1/(1-p)
    layer.set_train(False)
    np.testing.assert_allclose(layer(x).asnumpy() - base, x.asnumpy()[:, :16], rtol=0, atol=tol)


def test_lora_training_keeps_base_bit_identical_and_lowers_the_loss(tmp_path):
    """A toy task (continue a fixed pattern) through the shared loop: only lora_A/B move, and the loss falls."""
    ms.set_seed(0)
    net, _ = _net(targets=r"_proj$|lm_head", rank=4, alpha=8.0)  # a random tiny model's lm_head caps its logits
    params = mark_only_lora_trainable(net)
    before = {p.name: p.asnumpy().copy() for p in net.get_parameters() if "lora" not in p.name}
    pattern = np.tile(np.array([5, 17, 99, 250, 3, 42, 7, 300], np.int32), 5)  # period 8, 40 tokens
    ids = np.stack([np.roll(pattern, -k)[:33] for k in range(8)])
    x, y = ids[:, :-1], ids[:, 1:].copy()

    def batches(start):
        while True:
            yield x, y

    def loss_fn(a, b):
        return causal_lm_loss(net(a), b)

    train = TrainSection.model_validate(
        {
            "optimizer": {"lr": 1e-2, "min_lr": 1e-3, "weight_decay": 0.0},
            "schedule": {"warmup_steps": 2},
            "loop": {
                "max_steps": 25,
                "micro_batch_size": 8,
                "log_steps": 1,
                "eval_steps": 1000,
                "save_steps": 25,
                "peak_flops": 1e11,
            },
        }
    )
    result = fit(
        Trainee(net, params, loss_fn, flops_per_token=1.0),
        train,
        TrainData(batches, None, 32),
        Sinks(tmp_path, {"seed": 0}, progress=False),
        checkpoint=CheckpointSection(),
    )
    losses = [r["loss"] for r in result.history if "grad_norm" in r]
    assert losses[-1] < losses[0] - 3.0, losses  # 6.25 -> 1.11 when written
    for p in net.get_parameters():
        if p.name in before:
            np.testing.assert_array_equal(p.asnumpy(), before[p.name])  # bit-identical base weights
    moved = [p for p in params if p.name.endswith("lora_B")]
    assert all(np.abs(p.asnumpy()).max() > 0 for p in moved)
    from tasks.training.checkpoint import load_checkpoint, newest_checkpoint

    weights, _, _ = load_checkpoint(newest_checkpoint(tmp_path / "checkpoints"))
    assert set(weights) == {p.name for p in params}  # checkpoints hold the adapter only


def _random_adapter(base_w: dict, targets: tuple[str, ...], rank: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for k, w in base_w.items():
        if k.endswith(".weight") and k.split(".")[-2] in targets:
            m = k[: -len(".weight")]
            out[m + ".lora_A"] = rng.normal(0, 1 / np.sqrt(w.shape[1]), (rank, w.shape[1])).astype(np.float32)
            out[m + ".lora_B"] = rng.normal(0, 0.5, (w.shape[0], rank)).astype(np.float32)
    return out


def test_lora_slots_serve_several_adapters_on_one_compiled_network():
    """Two adapters of different ranks and targets on ONE network: after `use(name)` a forward compiled once equals a
    plain model holding that adapter merged (merge_adapter); `use(None)` is the base; the network holds the base
    weights once, and each adapter costs only its A and scaling·B."""
    base = LlamaForCausalLM(CFG, seed=3)
    base.set_train(False)
    base_w = {p.name: p.asnumpy() for p in base.get_parameters()}
    ads = {
        "a": (_random_adapter(base_w, ("q_proj", "v_proj"), 4, 1), 2.0),
        "b": (_random_adapter(base_w, ("q_proj", "o_proj", "down_proj"), 2, 2), 0.5),
    }

    def compiled(model):
        def forward(ids):
            return model(ids)

        return ms.jit(forward)

    def merged_net(name):
        plain = LlamaForCausalLM(CFG, seed=3)
        plain.set_train(False)
        full = base_w if name is None else merge_adapter(base_w, *ads[name])
        for p in plain.get_parameters():
            p.set_data(Tensor(full[p.name]))
        return compiled(plain)(IDS).asnumpy()

    want = {name: merged_net(name) for name in (None, "a", "b")}
    # each adapter moves the logits by far more than the bound the comparisons below allow
    assert all(np.abs(want[n] - want[None]).max() > 100 * _logit_tol(want[None]) for n in ("a", "b"))

    net = LlamaForCausalLM(CFG, seed=3)
    net.set_train(False)
    slots = LoRASlots(net, ads)
    assert slots.rank == 4 and sorted(slots.names) == ["a", "b"]
    assert {m.rsplit(".", 1)[-1] for m, _ in slots.layers} == {"q_proj", "v_proj", "o_proj", "down_proj"}
    forward = compiled(net)
    for name in ("a", None, "b", "a", "b", None):  # every switch after the one compilation
        slots.use(name)
        got = forward(IDS).asnumpy()
        # merged W + s·B·A vs W x + s·B(A x): the same sums in another fp32 order
        np.testing.assert_allclose(got, want[name], rtol=0, atol=_logit_tol(want[name]), err_msg=str(name))
    assert all(not layer.lora_B.asnumpy().any() for _, layer in slots.layers)  # the base: every update zero

    params = list(net.get_parameters())
    base_params = [p for p in params if p.name in base_w]
    assert len(base_params) == len(base_w) == len(params) - 2 * len(slots.layers)  # the base weights once
    for p in base_params:
        np.testing.assert_array_equal(p.asnumpy(), base_w[p.name])
    padded = sum(
        4 * (4 * layer.in_features + layer.out_features * 4)
        for m, layer in slots.layers
        if m + ".lora_A" in ads["a"][0]
    ) + sum(
        4 * (4 * layer.in_features + layer.out_features * 4)
        for m, layer in slots.layers
        if m + ".lora_A" in ads["b"][0]
    )
    assert slots.adapter_nbytes() == padded


def test_set_data_does_not_reach_a_compiled_graph_but_copy_does():
    """Why `LoRASlots.use` copies in place: `copy_` writes the storage a compiled graph reads; after a graph is
    compiled, `Parameter.set_data` swaps the Parameter's tensor and the graph keeps reading the old one (MindSpore
    2.x on CPU), so never set_data a served network's LoRA Parameters."""

    class Net(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.p = ms.Parameter(Tensor(np.zeros((2, 2), np.float32)), name="p")
            self.matmul = ms.ops.MatMul()

        def construct(self, x):
            return self.matmul(x, self.p)

    n = Net()

    def f(x):
        return n(x)

    f = ms.jit(f)
    x = Tensor(np.eye(2, dtype=np.float32))
    assert not f(x).asnumpy().any()
    n.p.copy_(Tensor(np.full((2, 2), 5.0, np.float32)))
    assert (f(x).asnumpy() == 5.0).all()
    n.p.set_data(Tensor(np.full((2, 2), 3.0, np.float32)))
    assert (
        f(x).asnumpy() == 5.0
    ).all()  # still the old values: if this fails, set_data would do (the docstring is stale)
    n.p.copy_(Tensor(np.full((2, 2), 7.0, np.float32)))
    assert (f(x).asnumpy() == 5.0).all()  # and the Parameter is cut off from the graph for good: copy_ lands elsewhere
