"""Optimizer-state sharding (ZeRO-1, `parallel.optimizer_shard: true`) under data parallel, on CPU under msrun.

Each data-parallel rank keeps the AdamW moments of its 1/dp share of the flat, padded parameter buffer and
updates that share of the parameters in place (model/train_kernels.cc ZeroAdamW; without a compiler: an fp32 master copy
of the share and MindSpore's AdamWeightDecay); the updated shares are AllGathered back into the parameters.
Checked here: the same per-step losses as dp=2 without sharding and as one process with the same global
batch; replicas bit-identical; checkpoints hold the shares and reshard bit for bit; resume across
layouts; the planner's per-rank estimate against the measured per-rank peak RSS.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tasks.runtime.distributed import rank_logs
from tasks.store.artifacts import ArtifactStore
from tasks.store.tensors import save_tensors
from tasks.training.checkpoint import (
    _publish,
    complete_checkpoints,
    flatten_moments,
    load_checkpoint,
    save_checkpoint,
    unflatten_moments,
    zero_files,
)
from tests.helpers import assert_same_scalars, assert_same_weights, fp32_tol, run_stage
from tests.test_distributed import (  # noqa: F401
    DP2,
    _cfg,
    _copy_data,
    _metrics,
    _single,
    _stopped_after_3,
    _tiny_arrays,
    _train_losses,
    data_artifact,
)

REPO = Path(__file__).resolve().parent.parent
ZERO = [*DP2, "parallel.optimizer_shard=true"]


# ----------------------------------------------------------------------------- shares and resharding (no msrun)


def _sharded_optimizer(dp: int, dp_index: int, chunk_elements: int = 4 * 2**20, in_place: bool = True):
    from model.config import ModelConfig
    from model.llama import LlamaForCausalLM
    from tasks.training.zero import ShardedAdamW

    params = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=0).trainable_params()
    return ShardedAdamW(
        params,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        grad_clip=1.0,
        decay_mask=[True] * len(params),
        dp=dp,
        dp_index=dp_index,
        chunk_elements=chunk_elements,
        in_place=in_place,
    )


def test_fused_kernels_false_keeps_the_update_on_mindspores_kernel():
    """pretrain.train.fused_kernels: false means no custom op at all, in ZeRO-1's update as in AdamW's (the trainer used
    to build ShardedAdamW in place whatever the key said): the build's one decision (model.kernels.decide) tells
    both."""
    from types import SimpleNamespace

    from model.kernel_ops import zero_ops
    from model.kernels import decide
    from tasks.config.schema import TrainSection
    from tasks.training.optimizer import parallelize_optimizer

    params = _sharded_optimizer(1, 0).params
    zero = SimpleNamespace(zero=True, dp=2, dp_index=1)
    plain = SimpleNamespace(zero=False, tp=1, tp_group=None)
    built = zero_ops() is not None
    for fused in (True, False):
        train = TrainSection.model_validate({"fused_kernels": fused})
        in_place = decide(train.fused_kernels, "CPU", "fp16")[1]  # fp16 compute: the fp32 master update still may
        assert parallelize_optimizer(list(params), train, zero, in_place).in_place is (fused and built), fused
        assert (parallelize_optimizer(list(params), train, plain, in_place).kernel is not None) is (fused and built)


def _moments() -> dict[str, np.ndarray]:
    opt = {f"adam_m.{k}": v * 0.5 for k, v in _tiny_arrays(1).items()}
    opt.update({f"adam_v.{k}": v**2 for k, v in _tiny_arrays(2).items()})
    return opt


def _write_zero_checkpoint(root: Path, step: int, weights, opt, state, layout) -> Path:
    """A checkpoint as dp ZeRO-1 ranks write it (what _save_distributed produces with opt_shard)."""
    tmp = root / f".tmp-step_{step:08d}-dist"
    tmp.mkdir(parents=True)
    files = {"model.safetensors": save_tensors(tmp / "model.safetensors", weights)}
    for name, share in zip(zero_files(layout["data_parallel"]), flatten_moments(opt, layout)):
        files[name] = save_tensors(tmp / name, share)
    lay = {"data_parallel": layout["data_parallel"], "tensor_parallel": 1, "optimizer_shard": layout}
    return _publish(root, tmp, step, {**state, "layout": lay}, files, keep=3)


def test_shares_cover_the_flat_buffer_once():
    """dp=7 does not divide the tiny model's element count: the last share is zero-padded, nothing overlaps."""
    opts = [_sharded_optimizer(7, r) for r in range(7)]
    numel, shard = opts[0].numel, opts[0].shard
    assert numel % 7 and shard == -(-numel // 7)
    covered = np.zeros(numel, np.int32)
    for o in opts:
        for i, a, b in o.segments:
            covered[o.offsets[i] + a : o.offsets[i] + b] += 1
        assert sum(b - a for _, a, b in o.segments) + o.pad == shard
    assert (covered == 1).all()
    assert [o.pad for o in opts] == [0] * 6 + [7 * shard - numel]
    # without the in-place kernel, the master share starts as the parameters' own values
    o = _sharded_optimizer(7, 1, in_place=False)
    i, a, b = o.segments[0]
    assert not o.in_place and o.master[0].asnumpy().tobytes() == o.params[i].asnumpy().reshape(-1)[a:b].tobytes()


def test_persistent_state_is_the_share_only():
    """Per rank the optimizer keeps 2 fp32 values (two moments) per owned element with the in-place kernel, 3 (and
    the master) without, and nothing parameter-sized: over dp ranks 8 (12) bytes per parameter element in all,
    instead of AdamW's 8 on every rank."""
    from mindspore import Parameter

    from model.kernel_ops import zero_ops

    for dp, in_place in ((1, True), (2, True), (3, True), (2, False), (3, False)):
        opts = [_sharded_optimizer(dp, r, chunk_elements=20000, in_place=in_place) for r in range(dp)]
        numel = opts[0].numel
        for o in opts:
            assert o.in_place == (in_place and zero_ops() is not None)
            owned = sum(b - a for _, a, b in o.segments)
            assert owned == o.shard - o.pad
            state = [p for p in o.get_parameters() if p.name.startswith(("adam_m.", "adam_v.", "zero_master."))]
            assert sum(int(np.prod(p.shape)) for p in state) == (2 if o.in_place else 3) * owned
            # its Parameters are the model's own plus the share state: no full-size buffer of its own
            own = {id(p) for p in o.params}
            assert all(
                id(p) in own or p.name.startswith(("adam_m.", "adam_v.", "zero_master."))
                for p in o.get_parameters()
                if isinstance(p, Parameter)
            )
        assert sum(sum(b - a for _, a, b in o.segments) for o in opts) == numel


def test_chunked_shares_cover_the_buffer_and_round_trip():
    """Chunks of whole parameters (here ~20k elements: many chunks), each padded to a multiple of dp: every
    element is owned once, the shares are equal-sized, and moments survive shares -> full -> shares bit for bit."""
    opt = _moments()
    for dp in (2, 3):
        opts = [_sharded_optimizer(dp, r, chunk_elements=20000) for r in range(dp)]
        assert len(opts[0].chunks) > 4 and len({o.shard for o in opts}) == 1
        covered = np.zeros(opts[0].numel, np.int32)
        for o in opts:
            for i, a, b in o.segments:
                covered[o.offsets[i] + a : o.offsets[i] + b] += 1
        assert (covered == 1).all()
        layout = opts[0].layout()
        shares = flatten_moments(opt, layout)
        back = unflatten_moments(shares, layout)
        assert all(back[k].tobytes() == opt[k].tobytes() for k in opt)
        for r, o in enumerate(opts):
            o.load_full(opt, "moments")
            got = o.shard_state()
            assert all(got[k].tobytes() == shares[r][k].tobytes() for k in ("adam_m", "adam_v")), (dp, r)


def test_zero_checkpoint_reshards_bit_for_bit(tmp_path):
    """Shares of dp=2 -> full moments (dp 1, unsharded) -> the shares of dp=2 and dp=3 again, bit for bit."""
    weights, opt = _tiny_arrays(0), _moments()
    layout = _sharded_optimizer(2, 0).layout()
    state = {"consumed_samples": 96, "updates": 12, "skipped_steps": 0}
    ck = _write_zero_checkpoint(tmp_path / "zero", 12, weights, opt, state, layout)
    assert sorted(p.name for p in ck.glob("*.safetensors")) == [
        "model.safetensors",
        "optimizer.dp0-of-2.safetensors",
        "optimizer.dp1-of-2.safetensors",
    ]
    w, o, st = load_checkpoint(ck)  # sharded -> one process, unsharded
    assert st["layout"]["optimizer_shard"]["shard_numel"] == layout["shard_numel"]
    assert o.keys() == opt.keys() and all(o[k].tobytes() == opt[k].tobytes() for k in opt)
    assert all(w[k].tobytes() == weights[k].tobytes() for k in weights)
    # unsharded -> sharded: each rank cuts its share out of the full moments
    full = save_checkpoint(tmp_path / "full", 12, weights, opt, state, keep=3)
    for dp in (2, 3):
        for r in range(dp):
            so = _sharded_optimizer(dp, r)
            so.load_full(load_checkpoint(full)[1], "full")
            want = flatten_moments(opt, so.layout())[r]
            got = so.shard_state()
            assert all(got[k].tobytes() == want[k].tobytes() for k in ("adam_m", "adam_v")), (dp, r)
    # and the dp=2 shares through the full form back to dp=2 shares: the same bytes as written
    shares = flatten_moments(unflatten_moments(flatten_moments(opt, layout), layout), layout)
    from safetensors.numpy import load_file

    on_disk = [load_file(str(ck / f)) for f in zero_files(2)]
    for a, b in zip(shares, on_disk):
        assert all(a[k].tobytes() == b[k].tobytes() for k in ("adam_m", "adam_v"))
    # sharded -> tensor parallel 2: the same slices as from the unsharded checkpoint
    for r in range(2):
        a, b = load_checkpoint(ck, tp=2, tp_index=r), load_checkpoint(full, tp=2, tp_index=r)
        assert all(a[1][k].tobytes() == b[1][k].tobytes() for k in b[1])


def test_optimizer_shard_is_a_data_parallel_layout():
    from model.config import ModelConfig
    from tasks.config.loader import resolve_pipeline
    from tasks.config.schema import ConfigError
    from tasks.training.memory import Layout, estimate, unsupported

    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", ZERO)
    assert cfg.parallel.optimizer_shard
    with pytest.raises(ConfigError) as exc:
        resolve_pipeline(
            REPO / "pipelines.yaml",
            "tiny",
            [
                "parallel.data_parallel=2",
                "parallel.tensor_parallel=2",
                "parallel.device_num=4",
                "parallel.optimizer_shard=true",
            ],
        )
    assert "parallel.optimizer_shard: optimizer sharding (ZeRO-1) is built for data parallel only" in str(exc.value)
    assert unsupported(Layout(dp=2, optimizer_shard=True), "CPU") is None
    assert "not built" in unsupported(Layout(dp=2, tp=2, optimizer_shard=True), "CPU")
    mc = ModelConfig.from_name("tiny")
    one, two = (estimate(mc, micro_batch=4, seq=64, layout=Layout(dp=2, optimizer_shard=s)) for s in (False, True))
    assert two.parts["optimizer"] * 2 == one.parts["optimizer"]
    assert "master_share" not in two.parts  # the in-place kernel updates the parameters themselves
    three = estimate(mc, micro_batch=4, seq=64, layout=Layout(dp=2, optimizer_shard=True), fused_kernels=False)
    assert three.parts["master_share"] == one.parts["optimizer"] // 4  # 4 bytes of 8 per element, over 2 ranks


def test_in_place_update_matches_adamw():
    """One rank's in-place update inside a compiled graph (no msrun: the rebuild is not run): its owned ranges of
    the parameters and its moments equal AdamW's (MindSpore's AdamWeightDecay on the whole tensors) to an ulp
    (MindSpore's kernel runs the last < 16 elements of each thread's range in double precision), the rest of
    every parameter is untouched, and a refused step (allow False) writes nothing."""
    import mindspore as ms
    from mindspore import Tensor

    from model.kernel_ops import zero_ops
    from tasks.training.adamw import AdamW

    if zero_ops() is None:
        pytest.skip("no compiler: the master-share path runs (checked by the msrun tests)")
    o = _sharded_optimizer(3, 1, chunk_elements=20000)
    assert o.in_place and len(o.master) == 0
    before = [p.asnumpy().copy() for p in o.params]
    ref_params = [ms.Parameter(Tensor(b.copy()), name=f"ref.{p.name}") for p, b in zip(o.params, before)]
    ref = AdamW(
        ref_params,
        beta1=0.9,
        beta2=0.95,
        eps=1e-8,
        weight_decay=0.1,
        grad_clip=1.0,
        decay_mask=[True] * len(ref_params),
    )
    rng = np.random.default_rng(0)
    n_elements = sum(b.size for b in before)

    @ms.jit
    def run(opt, grads, lr, step, allow):
        return opt(grads, lr, step, Tensor(2.0, ms.float32), allow)

    for step in (1, 2, 3):
        grads = tuple(Tensor(rng.standard_normal(b.shape).astype(np.float32) * 0.01) for b in before)
        args = (grads, Tensor(1e-2, ms.float32), Tensor(float(step), ms.float32), Tensor(True, ms.bool_))
        g1, _ = run(o, *args)
        g2, _ = run(ref, *args)
        # the global norm: a sum over every element, split into the shares' partial sums
        assert abs(float(g1.asnumpy()) - float(g2.asnumpy())) <= fp32_tol(float(g2.asnumpy()), n_elements)
    owned = [np.zeros(b.size, bool) for b in before]
    for j, (i, a, b) in enumerate(o.segments):
        owned[i][a:b] = True
        want = ref_params[i].asnumpy().reshape(-1)[a:b]
        # elementwise math, an ulp or two of each value per step (fp32_tol with n = the 3 steps)
        assert np.abs(o.params[i].asnumpy().reshape(-1)[a:b] - want).max() <= fp32_tol(np.abs(want).max(), 3)
        for mine, full in ((o.exp_avg[j], ref.exp_avg[i]), (o.exp_avg_sq[j], ref.exp_avg_sq[i])):
            full = full.asnumpy().reshape(-1)[a:b]
            assert np.abs(mine.asnumpy() - full).max() <= fp32_tol(np.abs(full).max(), 3)
    for i, b in enumerate(before):  # only the owned ranges were written
        assert o.params[i].asnumpy().reshape(-1)[~owned[i]].tobytes() == b.reshape(-1)[~owned[i]].tobytes()
    assert any(m.any() for m in owned)
    now = [p.asnumpy().copy() for p in o.params]
    run(o, grads, Tensor(1e-2, ms.float32), Tensor(4.0, ms.float32), Tensor(False, ms.bool_))
    assert all(p.asnumpy().tobytes() == b.tobytes() for p, b in zip(o.params, now))


# ----------------------------------------------------------------------------- msrun jobs


def _peak_rss(run_dir: Path) -> list[int]:
    logs = rank_logs(run_dir / "msrun_logs")
    return [int(re.findall(r"peak RSS (\d+) bytes", p.read_text())[-1]) for p in logs.values()]


@pytest.mark.slow  # three training runs (~45 s): keeps unit + integration under 10 minutes
def test_zero_matches_unsharded_and_one_process(tmp_path, data_artifact):
    """dp=2 sharded == dp=2 unsharded == 1 process with global batch 8, per step within train_tol (tests/helpers.py);
    replicas bit-identical; every rank wrote its optimizer share; plan's per-rank estimate within 30% of each rank's
    peak RSS."""
    from model.config import ModelConfig
    from tasks.store.tensors import load_weights
    from tasks.training.memory import Layout, estimate

    single, _ = _single(_cfg(), tmp_path / "single", data_artifact)
    runs = {}
    for name, overrides in (("dp2", DP2), ("zero", ZERO)):
        root = tmp_path / name
        path = run_stage(
            "pretrain", _cfg(*overrides), ArtifactStore(root), _copy_data(root, data_artifact), progress=False
        )
        runs[name] = (path, root / "runs" / "pretrain" / path.name)
    ls, ld, lz = _train_losses(single), _train_losses(runs["dp2"][0]), _train_losses(runs["zero"][0])
    assert sorted(lz) == [1, 2, 3, 4, 5, 6]
    assert_same_scalars(ls, lz)
    assert_same_scalars(ld, lz)
    gz = [r["grad_norm"] for r in _metrics(runs["zero"][0]) if "grad_norm" in r]
    gd = [r["grad_norm"] for r in _metrics(runs["dp2"][0]) if "grad_norm" in r]
    assert_same_scalars(gz, gd)  # clipping sees the same global norm
    vz = [r["val_loss"] for r in _metrics(runs["zero"][0]) if "val_loss" in r]
    vs = [r["val_loss"] for r in _metrics(single) if "val_loss" in r]
    assert len(vz) == 3
    assert_same_scalars(vs, vz)
    wz, ws, wd = (load_weights(p) for p in (runs["zero"][0], single, runs["dp2"][0]))
    assert_same_weights(wz, ws, steps=6, lr=3e-3)
    assert_same_weights(wz, wd, steps=6, lr=3e-3)
    logs = rank_logs(runs["zero"][1] / "msrun_logs")
    digests = [re.findall(r"parameters sha256 ([0-9a-f]{64})", p.read_text()) for p in logs.values()]
    assert len(digests) == 2 and digests[0] and digests[0] == digests[1]
    ck = complete_checkpoints(runs["zero"][1] / "checkpoints")[-1]
    lay = json.loads((ck / "state.json").read_text())["layout"]
    assert lay["data_parallel"] == 2 and lay["optimizer_shard"]["data_parallel"] == 2
    assert sorted(p.name for p in ck.glob("optimizer*")) == zero_files(2)
    # the sharded checkpoint's moments equal the unsharded run's to float32 rounding (same kernel, same scalars;
    # their gradients within train_tol: the moments are sums of them)
    oz = load_checkpoint(ck)[1]
    od = load_checkpoint(complete_checkpoints(runs["dp2"][1] / "checkpoints")[-1])[1]
    assert_same_weights(oz, od, steps=0, lr=0.0)
    # memory: plan's per-rank estimate against each rank's measured peak RSS (VmHWM)
    cfg = _cfg(*ZERO)
    est = estimate(
        ModelConfig.from_name("tiny"),
        micro_batch=4,
        seq=cfg.pretrain.seq_length or cfg.data.seq_length,
        layout=Layout(dp=2, optimizer_shard=True),
    ).total
    for rss in _peak_rss(runs["zero"][1]):
        assert abs(est - rss) / rss < 0.30, (est, rss)


@pytest.mark.slow
def test_zero_accumulation_and_nonfinite_step_match_one_process(tmp_path, data_artifact):
    """Accumulation 2 × micro batch 2 on each of 2 sharded ranks, with step 2's gradients made non-finite:
    the same skipped step, losses and data position as one process with micro batch 8."""
    single, _ = _single(_cfg(), tmp_path / "single", data_artifact, fault_steps=[2])
    root = tmp_path / "zero"
    cfg = _cfg(*ZERO, "pretrain.train.loop.micro_batch_size=2", "pretrain.train.loop.gradient_accumulation=2")
    path = run_stage(
        "pretrain",
        cfg,
        ArtifactStore(root),
        _copy_data(root, data_artifact),
        progress=False,
        inject={"fault_steps": [2]},
    )
    ls, lz = _train_losses(single), _train_losses(path)
    assert_same_scalars({s: ls[s] for s in ls if s != 2}, lz)
    mz, ms_ = _metrics(path), _metrics(single)
    assert [r["skipped_steps"] for r in mz if "skipped_steps" in r] == [
        r["skipped_steps"] for r in ms_ if "skipped_steps" in r
    ]
    assert max(r.get("skipped_steps", 0) for r in mz) == 1
    assert ArtifactStore(root).verify(path)["metrics"]["consumed_samples"] == 48


@pytest.mark.slow
def test_zero_checkpoint_resumes_under_every_layout(tmp_path, data_artifact):
    """Sharded dp=2 stopped after 3 steps continues (a) sharded dp=2 from its own checkpoint, (b) as one process;
    one process stopped after 3 continues (c) sharded dp=2: each with the losses of an unbroken run."""
    _, run_straight = _single(_cfg(), tmp_path / "straight", data_artifact)
    ls = _train_losses(run_straight)
    ckpts = _stopped_after_3(tmp_path / "zero", data_artifact, ZERO)
    ck = complete_checkpoints(ckpts)[-1]
    assert sorted(p.name for p in ck.glob("optimizer*")) == zero_files(2)
    # (a) the same layout resumes its own run
    root = tmp_path / "zero"
    path = run_stage("pretrain", _cfg(*ZERO), ArtifactStore(root), root / "data" / data_artifact.name, progress=False)
    la = _train_losses(path)
    assert sorted(la) == [1, 2, 3, 4, 5, 6]
    assert_same_scalars(ls, la)
    # (b) dp 2 -> 1, sharded -> not
    _, run_b = _single(_cfg(f"checkpoint.load_checkpoint={ck}"), tmp_path / "b", data_artifact)
    lb = _train_losses(run_b)
    assert_same_scalars(ls, lb)
    # (c) dp 1 -> 2, not -> sharded
    _single(_cfg(), tmp_path / "c1", data_artifact, stop_after=3)
    ck1 = complete_checkpoints(next((tmp_path / "c1" / "runs" / "pretrain").iterdir()) / "checkpoints")[-1]
    root2 = tmp_path / "c2"
    path = run_stage(
        "pretrain",
        _cfg(*ZERO, f"checkpoint.load_checkpoint={ck1}"),
        ArtifactStore(root2),
        _copy_data(root2, data_artifact),
        progress=False,
    )
    lc = _train_losses(path)
    assert_same_scalars(ls, lc)
    assert ArtifactStore(root2).verify(path)["metrics"]["consumed_samples"] == 48


@pytest.mark.slow
def test_distributed_benchmark_runs_the_trainers_kernels_and_sharding_keeps_the_loss():
    """scripts/bench/distributed.py (the README's dp2 / dp2 + ZeRO-1 figures) on `tiny`: it builds what the trainer
    builds (the fused kernels where they compile), both layouts reach the same loss, and every figure it prints
    is a possible one."""
    import subprocess
    import sys

    from model.kernel_ops import train_ops

    script = REPO / "scripts" / "bench" / "distributed.py"
    out = subprocess.run(
        [
            sys.executable,
            str(script),
            "--preset",
            "tiny",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--layouts",
            "dp2,dp2zero",
            "--comm-repeats",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["fused_kernels"] is (train_ops() is not None)
    assert res["loss"]["dp2"] == res["loss"]["dp2zero"] and np.isfinite(res["loss"]["dp2"])
    for layout in ("dp2", "dp2zero"):
        assert res["tokens_per_s"][layout] > 0 and res["comm_s_per_step"][layout] > 0
        assert all(r > 100e6 for r in res["rank_peak_rss_bytes"][layout])  # a MindSpore process, not a stub's
        assert abs(res["plan_error"][layout]) < 0.3
    assert res["dp2zero_param_rebuild_s"]["shard_elements"] * 2 >= res["params"]
