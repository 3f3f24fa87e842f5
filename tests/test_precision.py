"""fp16 mixed precision: fp16 compute with fp32 master weights, dynamic loss scaling, exact fp16 resume."""

from __future__ import annotations

import json
from pathlib import Path

import mindspore as ms
import numpy as np
import pytest

from model.config import ModelConfig
from model.llama import LlamaForCausalLM, causal_lm_loss
from tasks.config.loader import resolve_pipeline
from tasks.store.artifacts import ArtifactStore
from tasks.training.adamw import AdamW, decays
from tasks.training.checkpoint import load_checkpoint
from tasks.training.step import DynamicLossScale, TrainStep
from tests.helpers import pretrain_child, run_stage

REPO = Path(__file__).resolve().parent.parent


def _step_fn(net):
    params = net.trainable_params()
    opt = AdamW(
        params,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        grad_clip=1.0,
        decay_mask=[decays(q.name, decay_norms_and_biases=False, decay_embeddings=False) for q in params],
    )

    def loss_fn(ids, labels):
        return causal_lm_loss(net(ids), labels)

    return TrainStep(loss_fn, params, opt)


def _batch(cfg: ModelConfig, seed: int = 2):
    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (4, 17)).astype(np.int32)
    return [(ids[:, :-1], ids[:, 1:])]


def _fp16_tol(cfg, scale: float) -> float:
    """fp16 compute against fp32: each op's inputs and outputs are stored in float16 (its sums accumulate in float32),
    so each of a layer's ~7 stored activations (norm, q/k/v, attention, o, gate/up, down) rounds a value by at most
    eps16 / 2 relative, plus the final norm and the head; the roundings are independent, so like fp32_tol they add
    as sqrt(ops): 4 * eps16 * sqrt(ops) of the logits' magnitude (2.0 ** -10 the spacing of float16 at 1). For
    the tiny preset (2 layers) ~1.6e-2 of max |logit|, above the 7e-4 measured and far below a wrong op (O(1))."""
    ops = 7 * cfg.num_layers + 2
    return 4 * 2.0**-10 * (ops + 1) ** 0.5 * scale


def test_fp16_model_keeps_fp32_weights_and_logits_close_to_fp32():
    cfg = ModelConfig.from_name("tiny")
    ref = LlamaForCausalLM(cfg, seed=0)
    half = LlamaForCausalLM(cfg, seed=0, compute_dtype=ms.float16)
    assert all(p.dtype == ms.float32 for p in half.trainable_params())
    ids = ms.Tensor(_batch(cfg)[0][0])
    a, b = ref(ids), half(ids)
    assert b.dtype == ms.float32
    a, b = a.asnumpy(), b.asnumpy()
    assert np.abs(a - b).max() <= _fp16_tol(cfg, np.abs(a).max())
    with pytest.raises(ValueError, match="compute_dtype"):
        LlamaForCausalLM(cfg, seed=0, compute_dtype=ms.bfloat16)


def test_fp16_training_lowers_loss_and_stays_finite():
    cfg = ModelConfig.from_name("tiny")
    net = LlamaForCausalLM(cfg, seed=0, compute_dtype=ms.float16)
    step = _step_fn(net)
    batch = _batch(cfg)
    out = [step(batch, 3e-3, s, 65536.0) for s in range(1, 9)]
    losses = [o[0] for o in out]
    assert all(o[2] for o in out) and all(np.isfinite(losses))
    assert losses[-1] < losses[0] - 0.5
    assert all(np.isfinite(p.asnumpy()).all() for p in net.trainable_params())
    # after training the fp16 forward still tracks an fp32 forward of the same weights
    ref = LlamaForCausalLM(cfg, seed=0)
    for p, q in zip(ref.trainable_params(), net.trainable_params()):
        p.set_data(ms.Tensor(q.asnumpy()))
    ids = ms.Tensor(batch[0][0])
    a, b = ref(ids).asnumpy(), net(ids).asnumpy()
    assert np.abs(a - b).max() <= _fp16_tol(cfg, np.abs(a).max())


def test_dynamic_scale_halves_on_overflow_and_skips_without_touching_parameters():
    cfg = ModelConfig.from_name("tiny")
    net = LlamaForCausalLM(cfg, seed=0, compute_dtype=ms.float16)
    step = _step_fn(net)
    batch = _batch(cfg)
    scaler = DynamicLossScale(2.0**40, window=1000, dynamic=True)
    params = net.trainable_params()
    overflows, updates = 0, 0
    for _ in range(40):
        before = [p.asnumpy().copy() for p in params]
        scale = scaler.scale
        loss, _, finite = step(batch, 3e-3, updates + 1, scale)
        assert np.isfinite(loss)  # the forward is fine; only the scaled backward overflows
        overflow = scaler.update(finite)
        if finite:
            updates += 1
            if updates == 3:
                break
            continue
        assert overflow and updates == 0 and scaler.scale == scale / 2  # overflows come first, each halves S
        overflows += 1
        for p, b in zip(params, before):
            np.testing.assert_array_equal(p.asnumpy(), b)  # a skipped step leaves the weights alone
    assert updates == 3 and 5 <= overflows < 40
    assert 1.0 < scaler.scale == 2.0 ** (40 - overflows)
    # at the floor a non-finite step is a genuine fault, not an overflow
    floor = DynamicLossScale(1.0, window=2, dynamic=True)
    assert floor.update(False) is False and floor.scale == 1.0
    fixed = DynamicLossScale(1.0, window=2, dynamic=False)  # fp32: S never moves
    assert [fixed.update(f) for f in (False, True, True, True)] == [False] * 4 and fixed.scale == 1.0


def test_dynamic_scale_doubles_after_window_finite_steps():
    s = DynamicLossScale(8.0, window=2, dynamic=True)
    trace = []
    for finite in (True, True, True, False, True, True, True, True):
        s.update(finite)
        trace.append(s.scale)
    assert trace == [8.0, 16.0, 16.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    restored = DynamicLossScale(65536.0, window=2, dynamic=True)
    restored.load_state_dict(json.loads(json.dumps(s.state_dict())))
    assert (restored.scale, restored.good_steps) == (32.0, 0)


# ----------------------------------------------------------------------------- through the pretrain stage


def _cfg(*overrides: str):
    base = [
        "pretrain.train.loop.max_steps=6",
        "pretrain.train.loop.log_steps=1",
        "pretrain.train.loop.eval_steps=3",
        "pretrain.train.loop.eval_batches=2",
        "pretrain.train.schedule.warmup_steps=2",
        "pretrain.train.loop.micro_batch_size=4",
        "checkpoint.save_steps=3",
        "checkpoint.keep_checkpoint_max=2",
        "pretrain.train.precision.dtype=fp16",
    ]
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*base, *overrides])


@pytest.fixture(scope="module")
def data_artifact(tmp_path_factory) -> Path:

    root = tmp_path_factory.mktemp("data_root")
    return run_stage("data", _cfg(), ArtifactStore(root), progress=False)


def _train(cfg, root: Path, data_art: Path, **kw):
    train, run_dir = pretrain_child(cfg, root, data_art, **kw)
    return train(), run_dir


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_fp16_pretrain_overflows_are_not_faults_and_scale_grows(tmp_path, data_artifact):
    # S starts absurdly high: the first steps overflow (halving S each time) without tripping
    # max_nonfinite_steps=2; then S doubles after every 2 finite steps
    cfg = _cfg(
        "pretrain.train.loop.max_steps=30",
        "pretrain.train.precision.loss_scale=1099511627776",
        "pretrain.train.precision.loss_scale_window=2",
        "pretrain.train.loop.max_nonfinite_steps=2",
        "checkpoint.save_steps=30",
        "pretrain.train.loop.eval_steps=30",
    )
    out, run_dir = _train(cfg, tmp_path / "ovf", data_artifact)
    m = json.loads((out / "manifest.json").read_text())["metrics"]
    rows = [r for r in _rows(run_dir) if "grad_norm" in r]
    n = next(i for i, r in enumerate(rows) if np.isfinite(r["grad_norm"]))  # overflows before the first update
    assert m["skipped_steps"] == 0 and 5 <= n <= m["overflow_steps"] < 30 and m["precision"] == "fp16"
    assert [r["loss_scale"] for r in rows[: n + 1]] == [2.0 ** (40 - i) for i in range(n + 1)]
    assert all(np.isfinite(r["loss"]) for r in rows)
    # afterwards S hovers at the fp16 limit: an overflow halves it, 2 finite steps double it
    grew = 0
    for a, b in zip(rows, rows[1:]):
        if not np.isfinite(a["grad_norm"]):
            assert b["loss_scale"] == a["loss_scale"] / 2
        else:
            assert b["loss_scale"] in (a["loss_scale"], 2 * a["loss_scale"])
            grew += b["loss_scale"] == 2 * a["loss_scale"]
    assert grew >= 1 and rows[-1]["overflow_steps"] == m["overflow_steps"]
    assert rows[-1]["loss"] < rows[n]["loss"]
    _, _, state = load_checkpoint(run_dir / "checkpoints" / "step_00000030")
    assert state["overflow_steps"] == m["overflow_steps"] and state["loss_scale"] == m["final_loss_scale"]


def test_fp16_resume_restores_the_loss_scale(tmp_path, data_artifact):
    cfg = _cfg("pretrain.train.precision.loss_scale_window=2")
    _, run_a = _train(cfg, tmp_path / "a", data_artifact)
    stopped, run_b = _train(cfg, tmp_path / "b", data_artifact, stop_after=3)
    assert stopped is None
    _, _, state = load_checkpoint(run_b / "checkpoints" / "step_00000003")
    assert state["loss_scale"] == 65536.0 * 2 and state["loss_scale_good_steps"] == 1  # 3 finite steps, window 2
    _train(cfg, tmp_path / "b", data_artifact)
    la = [(r["step"], r.get("loss"), r.get("loss_scale"), r.get("val_loss")) for r in _rows(run_a)]
    lb = [(r["step"], r.get("loss"), r.get("loss_scale"), r.get("val_loss")) for r in _rows(run_b)]
    assert la == lb  # bit-identical per-step losses and scales across stop + resume
    assert [r[2] for r in la if r[2] is not None] == [65536.0 * f for f in (1, 1, 2, 2, 4, 4)]
    wa = load_checkpoint(run_a / "checkpoints" / "step_00000006")
    wb = load_checkpoint(run_b / "checkpoints" / "step_00000006")
    for name in wa[0]:
        np.testing.assert_array_equal(wa[0][name], wb[0][name])
    assert wa[2]["loss_scale"] == wb[2]["loss_scale"] == 65536.0 * 8
