"""Tests for model/: config + presets, registry, and the LLaMA model against a numpy reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest
from helpers import EPS32, decoder_reduction, fp32_tol, train_tol
from mindspore import Tensor, nn

from model.config import ModelConfig
from model.llama import LlamaForCausalLM, causal_lm_loss
from model.registry import ModelRegistry, build_model, default_registry
from tasks.modeling.build import build_network

REPO = Path(__file__).resolve().parents[1]


def tiny(**overrides) -> ModelConfig:
    return ModelConfig.from_name("tiny", **overrides)


def random_ids(shape, vocab=512, seed=0) -> np.ndarray:
    return np.random.RandomState(seed).randint(0, vocab, size=shape).astype(np.int32)


def params_np(model) -> dict[str, np.ndarray]:
    return {p.name: p.asnumpy() for p in model.trainable_params()}


# ---- numpy reference, written from the LLaMA paper / HF semantics, not from model/llama.py ----


def np_rmsnorm(x, w, eps):
    return x / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + eps) * w


def np_rope(x, theta):
    # x: [B, heads, T, hd]; HF rotate-half convention
    t, hd = x.shape[-2], x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(t)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * cos + rotated * sin


def np_attention(x, p, prefix, cfg):
    b, t, _ = x.shape
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = (x @ p[prefix + "q_proj.weight"].T).reshape(b, t, nh, hd).transpose(0, 2, 1, 3)
    k = (x @ p[prefix + "k_proj.weight"].T).reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)
    v = (x @ p[prefix + "v_proj.weight"].T).reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)
    q, k = np_rope(q, cfg.rope_theta), np_rope(k, cfg.rope_theta)
    k = np.repeat(k, nh // nkv, axis=1)  # HF repeat_kv: query head i uses kv head i // n_rep
    v = np.repeat(v, nh // nkv, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hd)
    scores = np.where(np.tril(np.ones((t, t), bool)), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, nh * hd)
    return out @ p[prefix + "o_proj.weight"].T


def np_forward(ids, p, cfg):
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x = p["embed_tokens.weight"][ids]
    for i in range(cfg.num_layers):
        pre = f"layers.{i}."
        x = x + np_attention(np_rmsnorm(x, p[pre + "input_layernorm.weight"], cfg.norm_eps), p, pre + "self_attn.", cfg)
        h = np_rmsnorm(x, p[pre + "post_attention_layernorm.weight"], cfg.norm_eps)
        gate, up = h @ p[pre + "mlp.gate_proj.weight"].T, h @ p[pre + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ p[pre + "mlp.down_proj.weight"].T
    x = np_rmsnorm(x, p["norm.weight"], cfg.norm_eps)
    head = p["embed_tokens.weight"] if cfg.tie_embeddings else p["lm_head.weight"]
    return x @ head.T


def np_cross_entropy(logits, labels, ignore_index=-100):
    logits = logits.reshape(-1, logits.shape[-1]).astype(np.float64)
    labels = labels.reshape(-1)
    keep = labels != ignore_index
    lse = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = lse - logits[np.arange(len(labels)), np.where(keep, labels, 0)]
    return nll[keep].mean()


# ---- model ------------------------------------------------------------------


def test_forward_shape_and_dtype():
    model = LlamaForCausalLM(tiny(), seed=0)
    logits = model(Tensor(random_ids((2, 16))))
    assert logits.shape == (2, 16, 512)
    assert logits.dtype == ms.float32


def test_causality():
    model = LlamaForCausalLM(tiny(), seed=0)
    ids = random_ids((2, 16))
    changed = ids.copy()
    changed[:, 8] = (changed[:, 8] + 1) % 512
    a, b = model(Tensor(ids)).asnumpy(), model(Tensor(changed)).asnumpy()
    # the same shapes through the same kernels, so the earlier positions would be bit-identical; the bound only
    # allows a kernel that blocks its rows by content (none does), far below what a leak moves (next line)
    np.testing.assert_allclose(
        a[:, :8], b[:, :8], rtol=0, atol=fp32_tol(np.abs(a).max(), decoder_reduction(model.config, 16))
    )
    # the change does reach later positions, by far more than the bound above
    assert np.abs(a[:, 8:] - b[:, 8:]).max() > 100 * fp32_tol(np.abs(a).max(), decoder_reduction(model.config, 16))


@pytest.mark.parametrize("num_kv_heads, tie", [(4, False), (2, False), (1, True)], ids=["mha", "gqa", "mqa-tied"])
def test_matches_numpy_reference(num_kv_heads, tie):
    # init_std 0.3 makes attention far from uniform, so RoPE, masking and head mapping matter
    cfg = tiny(num_kv_heads=num_kv_heads, tie_embeddings=tie, init_std=0.3)
    model = LlamaForCausalLM(cfg, seed=1)
    ids = random_ids((2, 24), seed=1)
    expected = np_forward(ids, params_np(model), cfg)
    actual = model(Tensor(ids)).asnumpy()
    assert np.abs(expected).max() > 1.0
    # float32 MindSpore against a float64 reference: the decoder's reductions at 24 keys, at the logits' scale
    np.testing.assert_allclose(
        actual, expected, rtol=0, atol=fp32_tol(np.abs(expected).max(), decoder_reduction(cfg, 24))
    )


def test_loss_matches_numpy_and_ignores_masked_positions():
    rng = np.random.RandomState(0)
    logits = rng.normal(0, 3, size=(2, 8, 50)).astype(np.float32)
    labels = rng.randint(0, 50, size=(2, 8)).astype(np.int32)
    labels[0, :3] = -100
    labels[1, 5] = -100
    loss = causal_lm_loss(Tensor(logits), Tensor(labels)).asnumpy()
    assert loss.shape == () and loss.dtype == np.float32
    # float32 against float64: a log-sum-exp over 50 logits (|x| up to ~12), then the mean over 11 kept positions
    assert abs(float(loss) - np_cross_entropy(logits, labels)) <= fp32_tol(np.abs(logits).max(), 50 + 11)

    masked = labels == -100
    logits2 = logits.copy()
    logits2[masked] = rng.normal(0, 30, size=(masked.sum(), 50))
    assert causal_lm_loss(Tensor(logits2), Tensor(labels)).asnumpy() == loss


def test_loss_all_masked_is_zero():
    logits = Tensor(np.ones((1, 4, 10), np.float32))
    labels = Tensor(np.full((1, 4), -100, np.int32))
    assert float(causal_lm_loss(logits, labels).asnumpy()) == 0.0


def test_model_loss_equals_loss_of_logits():
    model = LlamaForCausalLM(tiny(), seed=0)
    ids, labels = random_ids((2, 16)), random_ids((2, 16), seed=3)
    labels[:, :4] = -100
    logits = model(Tensor(ids)).asnumpy()
    expected = np_cross_entropy(logits, labels)
    # model.loss (its own graph) against float64 of the same logits: the log-sum-exp over the vocabulary and the
    # mean over 24 kept positions, at the scale of a term (|logit| + the loss)
    scale = np.abs(logits).max() + expected
    assert abs(float(model.loss(Tensor(ids), Tensor(labels)).asnumpy()) - expected) <= fp32_tol(scale, 512 + 24)


@pytest.mark.parametrize("tie", [False, True])
def test_parameter_count_and_tied_head(tie):
    cfg = tiny(tie_embeddings=tie)
    model = LlamaForCausalLM(cfg, seed=0)
    assert hasattr(model, "lm_head") is (not tie)
    assert sum(p.size for p in model.trainable_params()) == cfg.num_parameters
    assert not any("rope" in p.name for p in model.get_parameters())


def test_deterministic_init():
    a, b, c = (params_np(LlamaForCausalLM(tiny(), seed=s)) for s in (7, 7, 8))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["layers.0.self_attn.q_proj.weight"], c["layers.0.self_attn.q_proj.weight"])
    assert np.all(a["norm.weight"] == 1.0)


def test_a_build_with_weights_moves_them_in_instead_of_drawing_and_copying():
    """build_network(weights=...) draws and allocates nothing for the projections and moves the arrays in (popped
    from the dict, the float32 arrays become the parameters' memory): the weights are held once while they load,
    not three times (a random init, the file's arrays and the parameters' copies). The net computes exactly as the
    model whose weights they were, and a train step on it moves them."""
    src = params_np(LlamaForCausalLM(tiny(), seed=3))
    want = {k: v.copy() for k, v in src.items()}
    net = build_network("llama", tiny(), seed=0, weights=src).net
    assert src == {}  # moved, not copied
    got = params_np(net)
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)
    assert not any(p.has_init for p in net.get_parameters())  # no placeholder left
    ids = random_ids((2, 9))
    assert np.array_equal(net(Tensor(ids)).asnumpy(), LlamaForCausalLM(tiny(), seed=3)(Tensor(ids)).asnumpy())
    optimizer = nn.AdamWeightDecay(net.trainable_params(), learning_rate=1e-2)
    grad_fn = ms.value_and_grad(lambda i, lab: net.loss(i, lab), None, optimizer.parameters)
    _, grads = grad_fn(Tensor(ids[:, :-1]), Tensor(ids[:, 1:]))
    optimizer(grads)
    after = params_np(net)
    assert not np.array_equal(after["layers.0.mlp.up_proj.weight"], want["layers.0.mlp.up_proj.weight"])


def jit_train_losses(recompute: bool, steps: int = 5, fused_kernels: bool = False) -> list[float]:
    model = build_network("llama", tiny(), seed=0, fused_kernels=fused_kernels).net
    if recompute:
        model.enable_recompute()
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2)

    def forward(ids, labels):  # jit re-parses source: an inline lambda argument fails to parse
        return model.loss(ids, labels)

    grad_fn = ms.value_and_grad(forward, None, optimizer.parameters)

    @ms.jit
    def train_step(ids, labels):
        loss, grads = grad_fn(ids, labels)
        optimizer(grads)
        return loss

    tokens = random_ids((4, 33))
    ids, labels = Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:])
    return [float(train_step(ids, labels).asnumpy()) for _ in range(steps)]


@pytest.mark.integration  # ~14 s: two GRAPH-mode train steps compiled
def test_jit_train_step_lowers_loss_and_recompute_matches():
    losses = jit_train_losses(recompute=False)
    assert all(np.isfinite(losses))
    assert abs(losses[0] - np.log(512)) < 0.1  # init std 0.02 gives near-uniform predictions
    assert losses[-1] < losses[0] - 0.5, losses
    # recompute runs the same kernels on the same shapes again: the same sums, in the same order (rtol of a few ulps,
    # not an order-dependent bound)
    np.testing.assert_allclose(jit_train_losses(recompute=True), losses, rtol=8 * EPS32)
    # the fused custom ops (model/fused_cells.py, swapped in by the build; built-in ops where no compiler) under jit,
    # with and without recompute: other kernels, so other sums, through 5 AdamW steps of lr 1e-2 (train_tol of the
    # loss at 32 keys and 4 x 32 tokens; a weight moved by one step's difference changes the next loss by far less)
    fused = jit_train_losses(recompute=False, fused_kernels=True)
    cfg = ModelConfig.from_name("tiny")
    np.testing.assert_allclose(fused, losses, rtol=0, atol=train_tol(cfg, 32, 4 * 32, max(losses)))
    np.testing.assert_allclose(jit_train_losses(recompute=True, fused_kernels=True), fused, rtol=8 * EPS32)


# ---- config -----------------------------------------------------------------


def test_presets_sizes():
    assert 20e6 <= ModelConfig.from_name("small").num_parameters <= 50e6
    assert ModelConfig.from_name("llama2-7b").num_parameters == pytest.approx(6.74e9, rel=0.01)
    assert ModelConfig.from_name("llama3-8b").num_parameters == pytest.approx(8.03e9, rel=0.01)
    assert ModelConfig.from_name("llama3-8b").head_dim == 128


def test_flops_per_token():
    cfg = ModelConfig.from_name("llama2-7b")
    n_matmul = cfg.num_parameters - cfg.vocab_size * cfg.hidden_size - (2 * 32 + 1) * 4096
    assert cfg.flops_per_token(2048) == 6 * n_matmul + 6 * 32 * 4096 * 2048  # attention: the causal half


def test_config_round_trip_and_overrides():
    cfg = ModelConfig.from_name("tiny", num_layers=3)
    assert cfg.num_layers == 3
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_rejects_unknown_key():
    with pytest.raises(ValueError, match="'num_layer'"):
        ModelConfig.from_dict({**tiny().to_dict(), "num_layer": 3})
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        ModelConfig.from_name("huge")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_layers": 0}, "num_layers must be a positive int"),
        ({"hidden_size": 64.0}, "hidden_size must be a positive int"),
        ({"num_kv_heads": 3}, "num_heads \\(4\\) must be divisible by num_kv_heads \\(3\\)"),
        ({"num_heads": 5, "num_kv_heads": 5}, "hidden_size \\(64\\) must be divisible by num_heads"),
        ({"norm_eps": 0.0}, "norm_eps must be a positive finite number"),
        ({"rope_theta": float("nan")}, "rope_theta must be a positive finite number"),  # NaN passed `value <= 0`
        ({"norm_eps": float("inf")}, "norm_eps must be a positive finite number"),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


# ---- registry ---------------------------------------------------------------


def test_registry_duplicate_name_message():
    registry = default_registry()
    with pytest.raises(ValueError) as err:
        registry.register("llama", dict)
    assert str(err.value) == ("'llama' is already used by model.llama.LlamaForCausalLM, pick another name.")


def test_registry_unknown_name_lists_names():
    registry = ModelRegistry()
    registry.register("zeta", dict)
    registry.register("alpha", list)
    assert registry.names() == ["alpha", "zeta"]
    with pytest.raises(KeyError, match=r"\['alpha', 'zeta'\]"):
        registry.get("llama")


def test_default_registry_is_fresh_and_builds():
    first = default_registry()
    first.register("other", dict)
    assert default_registry().names() == ["llama"]
    model = build_model("llama", tiny(), seed=0)
    assert isinstance(model, LlamaForCausalLM)


def test_config_and_registry_import_without_mindspore():
    code = (
        "import sys, model, model.config, model.registry; assert 'mindspore' not in sys.modules, 'mindspore imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_builtin_model_names_match_the_registry():
    from model.registry import BUILTIN_MODELS, default_registry

    assert sorted(BUILTIN_MODELS) == default_registry().names()


# ---- one build sequence (tasks/modeling/build.py) ---------------------------------------------------------


def test_every_stage_gets_its_network_from_the_one_build(monkeypatch, tmp_path):
    """Pretrain (one process, a dp replica, fused and not) and serving/eval (`load_network` of the published
    weights) all build through tasks.modeling.build.build_network: the same parameter names and init."""
    import json

    import tasks.modeling.build as build
    from tasks.config.loader import resolve_pipeline
    from tasks.runtime.mesh import Mesh
    from tasks.stages.pretrain import network
    from tasks.store.tensors import save_tensors

    calls = []
    real = build.build_network
    monkeypatch.setattr(build, "build_network", lambda *a, **k: calls.append(k.get("mesh")) or real(*a, **k))
    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", [])
    nets = {}
    for fused in (False, True):
        for mesh in (Mesh(), Mesh(dp=2, rank=1, dp_group="dp")):
            c = cfg.model_copy(deep=True)
            c.pretrain.train.fused_kernels = fused
            nets[fused, mesh.dp] = network(c, None, mesh).net
    save_tensors(tmp_path / "model.safetensors", {p.name: p.asnumpy() for p in nets[False, 1].trainable_params()})
    (tmp_path / "model.json").write_text(json.dumps({"name": "llama", "model": cfg.model.resolve().to_dict()}))
    served, _ = build.load_network(tmp_path)
    assert len(calls) == 5  # four pretrain builds and the served one, all through build_network
    want = params_np(nets[False, 1])
    for net in [*nets.values(), served]:
        got = params_np(net)
        assert list(got) == list(want)
        assert all(np.array_equal(got[k], want[k]) for k in want)


def test_no_network_is_built_outside_the_build_module():
    """Package code builds a model only through tasks/modeling/build.py (which alone calls the registry)."""
    import ast

    offenders = []
    for path in [*(REPO / "model").rglob("*.py"), *(REPO / "tasks").rglob("*.py"), *(REPO / "flows").rglob("*.py")]:
        rel = path.relative_to(REPO).as_posix()
        if rel in ("tasks/modeling/build.py", "model/registry.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", getattr(node.func, "attr", ""))
                if name in ("build_model", "LlamaForCausalLM"):
                    offenders.append(f"{rel}:{node.lineno} {name}(...)")
    assert not offenders, offenders
