"""Distributed training on CPU under msrun: data and tensor parallel equivalence, resharding checkpoints.

The msrun jobs start 2 workers on this machine (MindSpore's TCP backend); each takes ~20 s.
"""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import numpy as np
import pytest

from model.config import ModelConfig
from tasks.config.loader import resolve_pipeline
from tasks.config.schema import ParallelSection
from tasks.modeling.parallelize import shard, split_axis, unshard
from tasks.runtime.distributed import rank_logs, run_msrun
from tasks.runtime.supervise import StageFailed
from tasks.stages import pretrain
from tasks.store.artifacts import ArtifactStore
from tasks.store.tensors import save_tensors
from tasks.training.checkpoint import _publish, complete_checkpoints, load_checkpoint, save_checkpoint, shard_files
from tests.helpers import assert_same_scalars, assert_same_weights, pretrain_child, run_stage, train_tol

TINY = ModelConfig.from_name("tiny")

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(*overrides: str):
    base = [
        "pretrain.train.loop.max_steps=6",
        "pretrain.train.loop.log_steps=1",
        "pretrain.train.loop.eval_steps=3",
        "pretrain.train.loop.eval_batches=2",
        "pretrain.train.schedule.warmup_steps=2",
        "pretrain.train.loop.micro_batch_size=8",
        "checkpoint.save_steps=3",
        "checkpoint.keep_checkpoint_max=3",
        f"parallel.master_port={free_port()}",
        "pretrain.train.layerwise=false",  # the whole-model graph; LAYERWISE (below) the default step
    ]
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*base, *overrides])


DP2 = [
    "parallel.data_parallel=2",
    "parallel.device_num=2",
    "pretrain.train.loop.micro_batch_size=4",
]  # same global batch 8
TP2 = ["parallel.tensor_parallel=2", "parallel.device_num=2"]


@pytest.fixture(scope="module")
def data_artifact(tmp_path_factory) -> Path:

    root = tmp_path_factory.mktemp("data_root")
    return run_stage("data", _cfg(), ArtifactStore(root), progress=False)


def _metrics(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def _train_losses(path: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _metrics(path) if "grad_norm" in r}


def _single(cfg, root: Path, data_art: Path, **kw):
    """The single-process reference, trained in this process."""
    train, run_dir = pretrain_child(cfg, root, data_art, **kw)
    return train(), run_dir


def _copy_data(root: Path, data_art: Path) -> Path:
    import shutil

    dst = root / "data" / data_art.name
    shutil.copytree(data_art, dst)
    return dst


# ----------------------------------------------------------------------------- resharding (no msrun)


def _tiny_arrays(seed: int = 0) -> dict[str, np.ndarray]:
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM

    net = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=seed)
    return {p.name: p.asnumpy().copy() for p in net.trainable_params()}


def test_split_axes_cover_the_megatron_layout():
    assert split_axis("layers.3.self_attn.q_proj.weight") == 0
    assert split_axis("adam_m.layers.0.mlp.up_proj.weight") == 0
    assert split_axis("adam_v.layers.1.self_attn.o_proj.weight") == 1
    assert split_axis("layers.0.mlp.down_proj.weight") == 1
    for name in (
        "embed_tokens.weight",
        "lm_head.weight",
        "norm.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.mlp.down_proj.lora_A.weight",
    ):
        assert split_axis(name) is None, name


def test_shard_then_unshard_is_bit_exact():
    full = _tiny_arrays()
    parts = [shard(full, 2, r) for r in range(2)]
    assert (
        parts[0]["layers.0.self_attn.q_proj.weight"].shape[0] * 2 == full["layers.0.self_attn.q_proj.weight"].shape[0]
    )
    assert parts[1]["layers.0.mlp.down_proj.weight"].shape[1] * 2 == full["layers.0.mlp.down_proj.weight"].shape[1]
    assert not np.array_equal(parts[0]["layers.0.mlp.gate_proj.weight"], parts[1]["layers.0.mlp.gate_proj.weight"])
    back = unshard(parts)
    assert back.keys() == full.keys()
    for k in full:
        assert back[k].tobytes() == full[k].tobytes(), k


def _write_tp_checkpoint(root: Path, step: int, weights, opt, state, tp: int) -> Path:
    """A checkpoint laid out as tensor-parallel ranks write it (what _save_distributed produces)."""
    tmp = root / f".tmp-step_{step:08d}-dist"
    tmp.mkdir(parents=True)
    files = {}
    for i in range(tp):
        mfile, ofile = shard_files(tp, i)
        files[mfile] = save_tensors(tmp / mfile, shard(weights, tp, i))
        files[ofile] = save_tensors(tmp / ofile, shard(opt, tp, i))
    return _publish(root, tmp, step, {**state, "layout": {"data_parallel": 1, "tensor_parallel": tp}}, files, keep=3)


def test_checkpoint_reshards_tp2_to_tp1_and_back_bit_for_bit(tmp_path):
    weights = _tiny_arrays(0)
    opt = {f"adam_m.{k}": v * 0.5 for k, v in _tiny_arrays(1).items()}
    opt.update({f"adam_v.{k}": v**2 for k, v in _tiny_arrays(2).items()})
    state = {"consumed_samples": 96, "updates": 12, "skipped_steps": 0}
    full = save_checkpoint(tmp_path / "full", 12, weights, opt, state, keep=3)
    sharded = _write_tp_checkpoint(tmp_path / "tp2", 12, weights, opt, state, tp=2)
    assert sorted(p.name for p in sharded.glob("*.safetensors")) == [
        "model.tp0-of-2.safetensors",
        "model.tp1-of-2.safetensors",
        "optimizer.tp0-of-2.safetensors",
        "optimizer.tp1-of-2.safetensors",
    ]
    # tp=2 -> tp=1: merged equals the unsharded checkpoint, bit for bit
    w1, o1, st = load_checkpoint(sharded, tp=1)
    wf, of, _ = load_checkpoint(full, tp=1)
    assert st["consumed_samples"] == 96 and st["layout"]["tensor_parallel"] == 2
    for a, b in ((w1, wf), (o1, of)):
        assert a.keys() == b.keys()
        assert all(a[k].tobytes() == b[k].tobytes() for k in a)
    # tp=1 -> tp=2, and tp=2 -> tp=2 (own slice read directly): the same slices either way
    for r in range(2):
        from_full = load_checkpoint(full, tp=2, tp_index=r)
        from_tp2 = load_checkpoint(sharded, tp=2, tp_index=r)
        for i in (0, 1):
            assert all(from_full[i][k].tobytes() == from_tp2[i][k].tobytes() for k in from_full[i])
        assert from_full[0]["layers.1.mlp.down_proj.weight"].shape == (
            64,
            weights["layers.1.mlp.down_proj.weight"].shape[1] // 2,
        )


def test_corrupt_slice_is_named(tmp_path):
    weights = _tiny_arrays(0)
    opt = {f"adam_m.{k}": v for k, v in weights.items()}
    ck = _write_tp_checkpoint(tmp_path, 3, weights, opt, {"consumed_samples": 24}, tp=2)
    f = ck / "model.tp1-of-2.safetensors"
    f.write_bytes(f.read_bytes()[:-8] + b"\0" * 8)
    from tasks.store.tensors import CheckpointError

    with pytest.raises(CheckpointError, match="model.tp1-of-2.safetensors: sha256 mismatch"):
        load_checkpoint(ck, tp=1)


def test_unsupported_layouts_are_config_errors():
    from tasks.config.schema import ConfigError

    for overrides, needle in (
        (
            ["parallel.pipeline_parallel=2", "parallel.device_num=2"],  # pipeline stages are not built: plan-only
            "parallel.pipeline_parallel: moved to plan.pipeline_parallel (pipeline stages are not built",
        ),
        (
            [
                "parallel.data_parallel=2",
                "parallel.tensor_parallel=2",
                "parallel.device_num=4",
                "parallel.optimizer_shard=true",
            ],
            "optimizer_shard: optimizer sharding (ZeRO-1) is built for data parallel only",
        ),
        (
            ["parallel.data_parallel=3", "parallel.device_num=3", "parallel.node_num=2"],
            "device_num=3 does not split evenly over node_num=2",
        ),
    ):
        with pytest.raises(ConfigError) as exc:
            resolve_pipeline(REPO / "pipelines.yaml", "tiny", overrides)
        assert needle in str(exc.value), str(exc.value)


# ----------------------------------------------------------------------------- msrun jobs


@pytest.mark.slow  # a 2-rank msrun job (~25 s): keeps unit + integration under 10 minutes
def test_tensor_parallel_logits_and_train_step_match_one_device(tmp_path):
    err = run_msrun(
        [str(REPO / "tests" / "dist_tp_check.py"), str(tmp_path)],
        ParallelSection(tensor_parallel=2, device_num=2, master_port=free_port()),
        tmp_path / "logs",
        relay=False,
    )
    assert err is None, err
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["init_equal"]  # each rank's slice is the single-device init's slice
        assert res["names_equal"]  # parallelize keeps the unsplit model's parameter names
        assert res["local_shapes"]["layers.0.self_attn.q_proj.weight"] == [32, 64]  # half the heads
        assert res["local_shapes"]["layers.0.self_attn.o_proj.weight"] == [64, 32]
        # the same math split over two ranks (dist_tp_check.py: 2 x 32 tokens, one AdamW step at lr 1e-3):
        # train_tol of each compared value's magnitude
        tol = lambda scale: train_tol(TINY, 32, 2 * 32, scale)  # noqa: E731
        assert res["logits_max_abs_diff"] <= tol(res["logits_scale"]) and res["logits_scale"] > 0.1
        assert abs(res["loss"][0] - res["loss"][1]) <= tol(abs(res["loss"][0]))
        # the norm over all slices (clip is global)
        assert abs(res["grad_norm"][0] - res["grad_norm"][1]) <= tol(abs(res["grad_norm"][0]))
        assert res["grad_max_abs_diff"] <= tol(res["grad_scale"]) and res["grad_scale"] > 1e-3
        assert res["param_max_abs_diff"] <= tol(res["param_scale"] + 1e-3)
        assert res["param_update_max"] > 0.5e-3  # the step moved weights (AdamW's first step: ~lr = 1e-3)


@pytest.mark.slow  # a 2-rank msrun job and a one-process run (~25 s); the rank-failure msrun test stays default
def test_data_parallel_matches_single_process(tmp_path, data_artifact):
    """2 ranks × micro batch 4 == 1 process × micro batch 8: same losses, replicas bit-identical."""
    single, run_single = _single(_cfg(), tmp_path / "single", data_artifact)
    root = tmp_path / "dp2"
    store = ArtifactStore(root)
    cfg = _cfg(*DP2)
    path = run_stage("pretrain", cfg, store, _copy_data(root, data_artifact), progress=False)
    ls, ld = _train_losses(single), _train_losses(path)
    assert sorted(ld) == [1, 2, 3, 4, 5, 6]
    assert_same_scalars(ls, ld)
    vs = [r["val_loss"] for r in _metrics(single) if "val_loss" in r]
    vd = [r["val_loss"] for r in _metrics(path) if "val_loss" in r]
    assert len(vs) == len(vd) == 3
    assert_same_scalars(vs, vd)
    m = store.verify(path)["metrics"]
    assert m["consumed_samples"] == 48 and m["layout"] == {"data_parallel": 2, "tensor_parallel": 1}
    from tasks.store.tensors import load_weights

    a, b = load_weights(single), load_weights(path)
    assert_same_weights(a, b, steps=6, lr=3e-3)
    # both ranks ended with the same parameters (checked in-job by AllGather; each logs its digest)
    run_dir = root / "runs" / "pretrain" / path.name
    logs = rank_logs(run_dir / "msrun_logs")
    digests = [re.findall(r"parameters sha256 ([0-9a-f]{64})", p.read_text()) for p in logs.values()]
    assert len(digests) == 2 and digests[0] and digests[0] == digests[1]
    ck = complete_checkpoints(run_dir / "checkpoints")[-1]
    assert json.loads((ck / "state.json").read_text())["layout"] == {"data_parallel": 2, "tensor_parallel": 1}


def test_rank_failure_names_the_rank_and_stops_the_job(tmp_path):
    err = run_msrun(
        [str(REPO / "tests" / "dist_fail.py")],
        ParallelSection(data_parallel=2, device_num=2, master_port=free_port(), cluster_timeout=60),
        tmp_path / "logs",
        relay=False,
    )
    assert err is not None
    head = err.splitlines()[0]
    assert head == "rank 1: the corpus shard of rank 1 is unreadable (injected)", err
    assert "worker_1.log" in err and "rank 0: no error in its log" in err


def test_finetune_rejects_tensor_parallel_before_training(tmp_path):
    from tests.helpers import tiny_model_artifact

    base = tiny_model_artifact(tmp_path)
    cfg = _cfg(*TP2)
    with pytest.raises(ValueError, match="fine-tuning runs data parallel only.*parallel.tensor_parallel=1"):
        run_stage("finetune", cfg, ArtifactStore(tmp_path), base, progress=False)


def _stopped_after_3(root: Path, data_artifact: Path, overrides: list[str]) -> Path:
    """Run the stage under msrun with `overrides`, stopped after 3 steps (as if killed); its checkpoints dir."""
    cfg = _cfg(*overrides)
    store = ArtifactStore(root)
    with pytest.raises(StageFailed, match="stopped before the end"):
        run_stage("pretrain", cfg, store, _copy_data(root, data_artifact), progress=False, inject={"stop_after": 3})
    key, _, _ = pretrain.stage_key(cfg, store, root / "data" / data_artifact.name, None)
    return root / "runs" / "pretrain" / key / "checkpoints"


@pytest.mark.slow
def test_two_rank_checkpoint_resumes_on_one_process(tmp_path, data_artifact):
    """dp=2 stops after 3 steps; one process continues from its checkpoint to the same losses and data position."""
    _, run_straight = _single(_cfg(), tmp_path / "straight", data_artifact)
    ckpts = _stopped_after_3(tmp_path / "dp2", data_artifact, DP2)
    assert [c.name for c in complete_checkpoints(ckpts)] == ["step_00000003"]
    resumed_cfg = _cfg(f"checkpoint.load_checkpoint={ckpts}")
    out, run_resumed = _single(resumed_cfg, tmp_path / "one", data_artifact)
    ls, lr = _train_losses(run_straight), _train_losses(run_resumed)
    assert sorted(lr) == [1, 2, 3, 4, 5, 6]  # steps 1-3 from the 2-rank run's metrics, 4-6 from this process
    assert_same_scalars(ls, lr)
    assert ArtifactStore(tmp_path / "one").verify(out)["metrics"]["consumed_samples"] == 48


@pytest.mark.slow
def test_tensor_parallel_checkpoint_resumes_under_another_layout(tmp_path, data_artifact):
    """tp=2 -> 1 process, and 1 process -> tp=2: the run continues with the losses of an unbroken one."""
    _, run_straight = _single(_cfg(), tmp_path / "straight", data_artifact)
    ls = _train_losses(run_straight)
    # tp=2 for 3 steps, then one process
    ck = complete_checkpoints(_stopped_after_3(tmp_path / "tp2", data_artifact, TP2))[-1]
    assert (ck / "model.tp1-of-2.safetensors").is_file()
    _, run_a = _single(_cfg(f"checkpoint.load_checkpoint={ck}"), tmp_path / "a", data_artifact)
    la = _train_losses(run_a)
    assert_same_scalars(ls, la)
    # one process for 3 steps, then tp=2 from its checkpoint
    _single(_cfg(), tmp_path / "b1", data_artifact, stop_after=3)
    ck1 = complete_checkpoints(next((tmp_path / "b1" / "runs" / "pretrain").iterdir()) / "checkpoints")[-1]
    root2 = tmp_path / "b2"
    path = run_stage(
        "pretrain",
        _cfg(*TP2, f"checkpoint.load_checkpoint={ck1}"),
        ArtifactStore(root2),
        _copy_data(root2, data_artifact),
        progress=False,
    )
    lb = _train_losses(path)
    assert_same_scalars(ls, lb)
    assert ArtifactStore(root2).verify(path)["metrics"]["consumed_samples"] == 48


def test_cache_key_follows_the_layout_not_the_rendezvous(tmp_path, data_artifact):
    store = ArtifactStore(tmp_path)
    data_copy = _copy_data(tmp_path, data_artifact)

    def key(*o):
        return pretrain.stage_key(resolve_pipeline(REPO / "pipelines.yaml", "tiny", list(o)), store, data_copy, None)[0]

    base = key()
    assert key("parallel.master_port=9001", "parallel.cluster_timeout=30") == base
    assert key("parallel.data_parallel=2", "parallel.device_num=2") != base
    assert key("parallel.tensor_parallel=2", "parallel.device_num=2") != key(
        "parallel.data_parallel=2", "parallel.device_num=2"
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides, dp, tp",
    [
        # 4 ranks: groups dp_0/dp_1 and tp_0/tp_1
        (
            [
                "parallel.data_parallel=2",
                "parallel.tensor_parallel=2",
                "parallel.device_num=4",
                "pretrain.train.loop.micro_batch_size=4",
            ],
            2,
            2,
        ),
        # gradients reduced once per step, after accumulating 2 micro batches of 2
        (
            [
                "parallel.data_parallel=2",
                "parallel.device_num=2",
                "pretrain.train.loop.micro_batch_size=2",
                "pretrain.train.loop.gradient_accumulation=2",
            ],
            2,
            1,
        ),
    ],
    ids=["dp2xtp2", "dp2-accumulation2"],
)
def test_more_layouts_match_single_process(tmp_path, data_artifact, overrides, dp, tp):
    """Global batch 8 either way: the same per-step losses and data position as one process."""
    single, _ = _single(_cfg(), tmp_path / "single", data_artifact)
    root = tmp_path / "parallel"
    path = run_stage("pretrain", _cfg(*overrides), ArtifactStore(root), _copy_data(root, data_artifact), progress=False)
    ls, lp = _train_losses(single), _train_losses(path)
    assert_same_scalars(ls, lp)
    assert ArtifactStore(root).verify(path)["metrics"]["consumed_samples"] == 48
    ck = complete_checkpoints(root / "runs" / "pretrain" / path.name / "checkpoints")[-1]
    assert json.loads((ck / "state.json").read_text())["layout"] == {"data_parallel": dp, "tensor_parallel": tp}
    assert sorted(p.name for p in ck.glob("model*.safetensors")) == (
        [f"model.tp{i}-of-{tp}.safetensors" for i in range(tp)] if tp > 1 else ["model.safetensors"]
    )


LAYERWISE = "pretrain.train.layerwise=true"


@pytest.mark.slow
@pytest.mark.parametrize(
    "overrides",
    [
        [*DP2],
        [
            *DP2,
            "pretrain.train.loop.micro_batch_size=2",
            "pretrain.train.loop.gradient_accumulation=2",
            "parallel.optimizer_shard=true",
        ],
    ],
    ids=["dp2", "dp2-accumulation2-zero1"],
)
def test_layer_at_a_time_under_data_parallel_matches_one_process(tmp_path, data_artifact, overrides, capfd):
    """The layer-at-a-time step under msrun: each rank's layer gradients reduced in its update graph (the norm there
    too, not on the host) give one process's losses, validation losses and weights (global batch 8 either way)."""
    from tasks.store.tensors import load_weights

    single, _ = _single(_cfg(LAYERWISE), tmp_path / "single", data_artifact)
    assert "[train] step: layer at a time\n" in capfd.readouterr().err  # the reference ran that way too
    root = tmp_path / "parallel"
    path = run_stage(
        "pretrain", _cfg(LAYERWISE, *overrides), ArtifactStore(root), _copy_data(root, data_artifact), progress=False
    )
    run_dir = root / "runs" / "pretrain" / path.name
    logs = rank_logs(run_dir / "msrun_logs")
    assert sorted(logs) == [0, 1] and "[train] step: layer at a time\n" in logs[0].read_text(), logs[0].read_text()
    ls, lp = _train_losses(single), _train_losses(path)
    assert sorted(lp) == [1, 2, 3, 4, 5, 6]
    assert_same_scalars(ls, lp)
    vs = [r["val_loss"] for r in _metrics(single) if "val_loss" in r]
    vp = [r["val_loss"] for r in _metrics(path) if "val_loss" in r]
    assert len(vs) == len(vp) == 3, (vs, vp)
    if not any(o.startswith("pretrain.train.loop.micro_batch_size=") for o in overrides):
        # validation reads eval_batches micro batches per rank: the same samples only at the same global micro batch
        assert_same_scalars(vs, vp)
    a, b = load_weights(single), load_weights(path)
    assert_same_weights(a, b, steps=6, lr=3e-3)
    digests = [re.findall(r"parameters sha256 ([0-9a-f]{64})", p.read_text()) for p in logs.values()]
    assert digests[0] and digests[0] == digests[1]  # the replicas agree
    assert ArtifactStore(root).verify(path)["metrics"]["consumed_samples"] == 48
    layout = json.loads((complete_checkpoints(run_dir / "checkpoints")[-1] / "state.json").read_text())["layout"]
    assert ("optimizer_shard" in layout) == ("parallel.optimizer_shard=true" in overrides), layout


@pytest.mark.slow
def test_finetune_data_parallel_matches_single_process(tmp_path):
    """LoRA on response-only instruction data (unequal token counts per rank): 2 × 4 == 1 × 8."""
    from tasks.store.tensors import load_weights
    from tests.helpers import tiny_model_artifact

    (tmp_path / "base").mkdir()
    base = tiny_model_artifact(tmp_path / "base")
    common = [
        "finetune.train.loop.max_steps=4",
        "finetune.train.loop.log_steps=1",
        "finetune.train.loop.eval_steps=2",
        "finetune.train.schedule.warmup_steps=1",
    ]
    one = run_stage("finetune", _cfg(*common), ArtifactStore(tmp_path / "base"), base, progress=False, isolate=False)
    root = tmp_path / "dp2"
    store = ArtifactStore(root)
    import shutil

    shutil.copytree(base, root / "pretrain" / base.name)
    two = run_stage(
        "finetune",
        _cfg(*common, "parallel.data_parallel=2", "parallel.device_num=2", "finetune.train.loop.micro_batch_size=4"),
        store,
        root / "pretrain" / base.name,
        progress=False,
    )
    l1, l2 = _train_losses(one), _train_losses(two)
    assert sorted(l2) == [1, 2, 3, 4]
    assert_same_scalars(l1, l2)
    v1 = [r["val_loss"] for r in _metrics(one) if "val_loss" in r]
    v2 = [r["val_loss"] for r in _metrics(two) if "val_loss" in r]
    assert len(v1) == len(v2) == 3
    assert_same_scalars(v1, v2)
    a1, a2 = load_weights(one / "adapter.safetensors"), load_weights(two / "adapter.safetensors")
    assert_same_weights(a1, a2, steps=4, lr=1e-2)
