"""Fault classes 1, 2, 3, 5 and 8 of the reliability contract (README "Reliability"): nothing wrong is
published, cached or loaded. Each test reproduces a fault that once gave a silent wrong result, a raw
traceback or a misleading message, on the tiny pipeline with real MindSpore training."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tasks.config.loader import resolve_pipeline
from tasks.config.schema import ConfigError
from tasks.runtime.supervise import StageFailed
from tasks.stages import pretrain
from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import atomic_write_json, sha256_file
from tasks.store.tensors import CheckpointError
from tasks.training.checkpoint import complete_checkpoints, is_good, load_checkpoint
from tasks.training.outcome import NonFiniteError
from tests.helpers import pretrain_child, run_stage

REPO = Path(__file__).resolve().parent.parent
BASE = [
    "pretrain.train.loop.max_steps=6",
    "pretrain.train.loop.log_steps=1",
    "pretrain.train.loop.eval_steps=3",
    "pretrain.train.loop.eval_batches=2",
    "pretrain.train.schedule.warmup_steps=0",
    "pretrain.train.loop.micro_batch_size=4",
    "checkpoint.save_steps=1",
    "checkpoint.keep_checkpoint_max=2",
]


def _cfg(*overrides: str):
    return resolve_pipeline(REPO / "pipelines.yaml", "tiny", [*BASE, *overrides])


@pytest.fixture(scope="module")
def data_artifact(tmp_path_factory) -> Path:

    return run_stage("data", _cfg(), ArtifactStore(tmp_path_factory.mktemp("fault_data")), progress=False)


def _train(cfg, root: Path, data_art: Path, init_from: Path | None = None, **kw):
    return pretrain_child(cfg, root, data_art, init_from, **kw)


def _all_finite(ckpt: Path) -> bool:
    w, o, _ = load_checkpoint(ckpt)
    return all(np.isfinite(a).all() for a in (*w.values(), *o.values()))


def _copy_data(data_artifact: Path, root: Path) -> Path:
    dst = root / "data" / data_artifact.name
    shutil.copytree(data_artifact, dst)
    return dst


# ----------------------------------------------------------------------------- 1. non-finite training


class TestNonFiniteTraining:
    @pytest.mark.parametrize(
        "override",
        [
            "pretrain.train.optimizer.lr=.inf",
            "pretrain.train.precision.loss_scale=.inf",
            "pretrain.train.optimizer.lr=.nan",
            "eval.temperature=.inf",
        ],
    )
    def test_every_float_must_be_finite(self, override):
        with pytest.raises(ConfigError, match=r"is not a finite number"):
            _cfg(override)

    def test_update_that_would_make_weights_nonfinite_is_refused(self):
        """A huge lr with finite loss and gradients: the update would overflow float32; it is skipped and
        counted, the weights and moments stay exactly as they were."""
        import mindspore as ms

        from model.config import ModelConfig
        from model.llama import LlamaForCausalLM
        from tasks.training.adamw import UpdateGuard
        from tasks.training.layerwise import causal_lm_train_step

        net = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=0)
        params = net.trainable_params()
        before = [p.asnumpy().copy() for p in params]
        step = causal_lm_train_step(net, params)
        guard = UpdateGuard(UpdateGuard.max_abs(before), beta1=0.9, beta2=0.95, weight_decay=0.1)
        ids = np.random.default_rng(0).integers(0, 512, (2, 17)).astype(np.int32)
        assert guard.allows(3e-4, 1) and not guard.allows(1e38, 1)
        loss, gnorm, finite = step([(ids[:, :-1], ids[:, 1:])], 1e38, 1, allow=guard.allows(1e38, 1))
        assert np.isfinite(loss) and np.isfinite(gnorm) and finite  # the gradients were fine ...
        for a, p in zip(before, params):  # ... but nothing was applied
            np.testing.assert_array_equal(a, p.asnumpy())
        assert all(not m.asnumpy().any() for m in step.optimizer.exp_avg)
        # the same step without the guard is what used to happen: loss and gradient norm finite, and
        # the update overflows (lr' = lr·√(1−β2)/(1−β1) exceeds float32's range at lr 2e38)
        loss, gnorm, finite = step([(ids[:, :-1], ids[:, 1:])], 2e38, 1)
        assert np.isfinite(loss) and finite and not guard.allows(2e38, 1)
        assert not all(np.isfinite(p.asnumpy()).all() for p in params)
        del ms

    def test_huge_lr_run_stops_without_a_nonfinite_checkpoint(self, tmp_path, data_artifact):
        fn, run_dir = _train(
            _cfg(
                "pretrain.train.optimizer.lr=1e38",
                "pretrain.train.optimizer.min_lr=0",
                "pretrain.train.loop.max_nonfinite_steps=3",
            ),
            tmp_path,
            data_artifact,
        )
        with pytest.raises(NonFiniteError, match=r"3 consecutive non-finite steps.*last good checkpoint is none"):
            fn()
        ckpts = complete_checkpoints(run_dir / "checkpoints")
        assert ckpts and all(_all_finite(c) for c in ckpts) and not any(is_good(c) for c in ckpts)
        assert ArtifactStore(tmp_path).list("pretrain") == []

    def test_streak_names_the_last_good_checkpoint_and_resume_uses_it(self, tmp_path, data_artifact):
        """Checkpoints are still written during a streak (the data position moves on), but the one the
        error names and the retry resumes from is the newest with no non-finite step since the previous."""
        cfg = _cfg("pretrain.train.loop.max_nonfinite_steps=3")
        fn, run_dir = _train(cfg, tmp_path, data_artifact, fault_steps=[3, 4, 5])
        with pytest.raises(NonFiniteError, match=r"last good checkpoint is \S*step_00000002"):
            fn()
        names = [c.name for c in complete_checkpoints(run_dir / "checkpoints")]
        assert names == ["step_00000002", "step_00000003", "step_00000004"]  # rotation kept the good one
        assert [is_good(run_dir / "checkpoints" / n) for n in names] == [True, False, False]
        assert _all_finite(run_dir / "checkpoints" / "step_00000002")
        fn2, _ = _train(cfg, tmp_path, data_artifact)  # the retry, without the fault
        out = fn2()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        assert out is not None and [r["step"] for r in rows if "grad_norm" in r] == [1, 2, 3, 4, 5, 6]
        assert json.loads((out / "manifest.json").read_text())["metrics"]["skipped_steps"] == 0

    def test_fp16_run_that_never_updates_is_not_published(self, tmp_path, data_artifact):
        fn, _ = _train(
            _cfg(
                "pretrain.train.precision.dtype=fp16",
                "pretrain.train.loop.max_steps=3",
                "pretrain.train.loop.eval_steps=3",
            ),
            tmp_path,
            data_artifact,
            fault_steps=[1, 2, 3],
        )
        with pytest.raises(NonFiniteError, match=r"no update was applied in 3 steps: every step overflowed in fp16"):
            fn()
        assert ArtifactStore(tmp_path).list("pretrain") == []

    def test_nonfinite_final_validation_loss_is_not_published(self, tmp_path, data_artifact):
        """lr 1e30 passes the update guard (weights ~1e30 are finite) but the model then computes NaN."""
        fn, _ = _train(
            _cfg(
                "pretrain.train.optimizer.lr=1e30",
                "pretrain.train.optimizer.min_lr=0",
                "pretrain.train.loop.max_steps=2",
                "pretrain.train.loop.eval_steps=2",
            ),
            tmp_path,
            data_artifact,
        )
        with pytest.raises(NonFiniteError, match=r"final validation loss is nan"):
            fn()
        assert ArtifactStore(tmp_path).list("pretrain") == []

    def test_eval_of_a_model_with_nonfinite_logits_fails(self, tmp_path):
        from tasks.stages import evaluate
        from tasks.store.tensors import CheckpointError
        from tests.helpers import tiny_model_artifact

        good = tiny_model_artifact(tmp_path)
        store = ArtifactStore(tmp_path)
        from safetensors.numpy import load_file, save_file

        cfg = resolve_pipeline(
            REPO / "pipelines.yaml",
            "tiny",
            ["eval.tasks=[local_boolq]", "eval.limit=4", f"eval.perplexity_files=[{REPO}/README.md]"],
        )
        # the final norm's weights finite but at float32's edge: every weight loads, the logits overflow to inf and
        # the eval's own check refuses them; NaN weights are refused earlier, when the model loads, naming the tensor
        for value, key, error, match in (
            (3e38, "f" * 20, evaluate.EvalError, r"non-finite"),
            (np.nan, "e" * 20, CheckpointError, r"norm\.weight.*NaN/Inf"),
        ):
            w = load_file(str(good / "model.safetensors"))
            w["norm.weight"][:] = value
            with store.build("pretrain", key, pipeline="test", config={}, inputs=[], code="test") as b:
                for f in good.iterdir():
                    if f.name != "manifest.json" and f.is_file():
                        shutil.copy2(f, b.dir / f.name)
                save_file(w, str(b.dir / "model.safetensors"))
            with pytest.raises(error, match=match):
                run_stage("eval", cfg, store, b.path, progress=False)
            assert store.list("eval") == []


# ----------------------------------------------------------------------------- 2. loading checks what it loads


class TestCheckpointLoading:
    def test_checkpoint_of_another_architecture_is_refused(self, tmp_path, data_artifact):
        fn, run3 = _train(_cfg("model.num_layers=3", "pretrain.train.loop.max_steps=1"), tmp_path / "a", data_artifact)
        fn()
        ck = complete_checkpoints(run3 / "checkpoints")[-1]
        fn2, _ = _train(_cfg(f"checkpoint.load_checkpoint={ck}"), tmp_path / "b", data_artifact)
        with pytest.raises(CheckpointError, match=r"model config differs.*num_layers: checkpoint 3 vs this run 2"):
            fn2()

    def test_unexpected_tensors_are_an_error(self):
        from model.config import ModelConfig
        from model.llama import LlamaForCausalLM
        from tasks.store.tensors import assign

        params = LlamaForCausalLM(ModelConfig.from_name("tiny"), seed=0).trainable_params()
        arrays = {p.name: p.asnumpy() for p in params}
        arrays["layers.2.mlp.down_proj.weight"] = np.zeros((64, 172), np.float32)
        with pytest.raises(CheckpointError, match=r"1 tensor\(s\) this model does not have \(layers\.2"):
            assign(params, arrays, "ckpt")

    def test_checkpoint_trained_with_another_tokenizer_is_refused(self, tmp_path, data_artifact):

        fn, run_a = _train(_cfg("pretrain.train.loop.max_steps=1"), tmp_path / "a", data_artifact)
        fn()
        other_cfg = _cfg("data.tokenizer.model_type=unigram")
        other = run_stage("data", other_cfg, ArtifactStore(tmp_path / "b"), progress=False)
        ck = complete_checkpoints(run_a / "checkpoints")[-1]
        fn2, run_b = _train(
            _cfg("data.tokenizer.model_type=unigram", f"checkpoint.load_checkpoint={ck}"), tmp_path / "b", other
        )
        with pytest.raises(CheckpointError, match=r"trained with tokenizer sha256 \w+… but this run's data"):
            fn2()
        assert not (run_b / "metrics.jsonl").exists() or not (run_b / "metrics.jsonl").read_text().strip()

    def test_truncated_safetensors_with_matching_sha_names_the_file(self, tmp_path, data_artifact):
        fn, run_dir = _train(_cfg("pretrain.train.loop.max_steps=1"), tmp_path, data_artifact)
        fn()
        ck = complete_checkpoints(run_dir / "checkpoints")[-1]
        f = ck / "model.safetensors"
        f.write_bytes(f.read_bytes()[:1000])
        state = json.loads((ck / "state.json").read_text())
        state["files"]["model.safetensors"] = sha256_file(f)
        atomic_write_json(ck / "state.json", state)
        with pytest.raises(CheckpointError, match=rf"{f}: not a readable safetensors file.*truncated or corrupt"):
            load_checkpoint(ck)


# ----------------------------------------------------------------------------- 3. a manifest is data, not trust


class TestManifestPaths:
    def test_shard_paths_outside_the_artifact_are_refused(self, tmp_path, data_artifact):
        from tasks.store.data_schema import DataError
        from tasks.store.errors import ArtifactError
        from tasks.store.reader import open_blocks

        art = _copy_data(data_artifact, tmp_path / "root")
        outside = tmp_path / "outside"
        outside.mkdir()
        m = json.loads((art / "manifest.json").read_text())
        rel = m["data"]["splits"]["train"]["files"][0]
        for suffix in ("", ".db"):
            shutil.copy2(art / (rel + suffix), outside / (Path(rel).name + suffix))
        m["data"]["splits"]["train"]["files"][0] = str(outside / Path(rel).name)
        m["files"] += [
            {
                "path": str(outside / (Path(rel).name + s)),
                "size": (outside / (Path(rel).name + s)).stat().st_size,
                "sha256": sha256_file(outside / (Path(rel).name + s)),
            }
            for s in ("", ".db")
        ]
        atomic_write_json(art / "manifest.json", m)
        # refused when the manifest is read (its file list names a path outside the artifact: tasks/store/published.py),
        # before the shard reader's own check (data_schema: "points outside the artifact") is reached
        with pytest.raises((DataError, ArtifactError), match=r"outside the artifact|not a path inside the artifact"):
            next(open_blocks(art, "train", batch_size=2, seed=0))

    def test_replay_data_is_found_by_key_not_by_recorded_path(self, tmp_path, data_artifact):
        """A pretrain manifest whose data input path points outside the root (at a real data artifact)
        is not followed: the replay data must be the artifact with that key in this store."""
        root = tmp_path / "root"
        fn, _ = _train(_cfg("pretrain.train.loop.max_steps=1"), root, _copy_data(data_artifact, root))
        base = fn()
        m = json.loads((base / "manifest.json").read_text())
        ref = next(i for i in m["inputs"] if i.get("stage") == "data")
        assert pretrain.replay_data_artifact(ArtifactStore(root), base) == root / "data" / ref["key"]
        shutil.rmtree(root / "data" / ref["key"])
        ref["path"] = str(data_artifact)  # a valid data artifact, outside this root
        atomic_write_json(base / "manifest.json", m)
        with pytest.raises(ValueError, match=r"replay_ratio: the data artifact of .* is not in"):
            pretrain.replay_data_artifact(ArtifactStore(root), base)

    def test_finetune_base_outside_the_root_is_not_followed(self, tmp_path):
        from tasks.modeling.merge import base_of
        from tasks.store.errors import ArtifactError
        from tests.helpers import tiny_model_artifact

        (tmp_path / "elsewhere").mkdir()
        outside = tiny_model_artifact(tmp_path / "elsewhere")
        root = tmp_path / "root"
        (root / "finetune" / "abc").mkdir(parents=True)
        m = ArtifactStore.read_manifest(outside)
        (root / "finetune" / "abc" / "adapter.json").write_text(
            json.dumps({"base": {"stage": "pretrain", "key": m["key"], "digest": m["digest"], "path": str(outside)}})
        )
        with pytest.raises(ArtifactError, match=r"is gone"):
            base_of(ArtifactStore(root), root / "finetune" / "abc")


# ----------------------------------------------------------------------------- 5. one clear message per failure


class TestOneMessage:
    def test_unknown_model_name_is_a_config_error(self):
        out = subprocess.run(
            [sys.executable, "-m", "tasks.cli", "validate", "--pipeline", "tiny", "--set", "model.name=lama"],
            capture_output=True,
            text=True,
            cwd=REPO,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr
        assert "pipelines.tiny.model.name: unknown model 'lama'; did you mean 'llama'?" in out.stderr

    def test_child_failure_prints_once_and_a_permanent_one_is_not_retried(self, tmp_path, data_artifact, capfd):
        root = tmp_path / "art"
        store = ArtifactStore(root)
        data_copy = _copy_data(data_artifact, root)
        cfg = _cfg()
        cfg.model.name = "lama"  # bypasses validation: the registry raises KeyError in the child
        with pytest.raises(StageFailed) as ei:
            run_stage("pretrain", cfg, store, data_copy, progress=False, retries=2)
        err = capfd.readouterr().err
        assert ei.value.permanent and str(ei.value).startswith("unknown model 'lama'; registered models")
        assert "Traceback" not in err and "unknown model" not in err  # the one line is the caller's to print
        assert "retrying" not in err

    def test_corrupt_init_weights_give_one_line(self, tmp_path, data_artifact, capfd):
        root = tmp_path / "art"
        store = ArtifactStore(root)
        data_copy = _copy_data(data_artifact, root)
        fn, _ = _train(_cfg("pretrain.train.loop.max_steps=1"), root, data_copy)
        base = fn()
        f = base / "model.safetensors"
        f.write_bytes(f.read_bytes()[:500])
        with pytest.raises(StageFailed) as ei:
            run_stage("pretrain", _cfg(), store, data_copy, init_from=base, progress=False, retries=1)
        err = capfd.readouterr().err
        assert ei.value.permanent and f"{f}: sha256 differs from the manifest" in str(ei.value)  # checked on load
        assert "Traceback" not in err and "retrying" not in err

    def test_full_disk_is_one_line_and_not_retried(self, tmp_path, data_artifact, capfd):
        """Training onto a full disk (a real tmpfs with room for the data and not for a checkpoint): the
        child's traceback printed twice (the supervisor retried ENOSPC), then "SafetensorError … os error 28".
        Now: one line naming the file and "no space left on the device", permanent, no retry."""
        import os

        if os.geteuid() != 0:
            pytest.skip("needs root to mount a small tmpfs (the full disk)")
        mnt = tmp_path / "small"
        mnt.mkdir()
        if subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True
        ).returncode:
            pytest.skip("cannot mount a tmpfs here (no CAP_SYS_ADMIN)")
        try:
            root = mnt / "art"
            data_copy = _copy_data(data_artifact, root)
            st = os.statvfs(mnt)
            used = (st.f_blocks - st.f_bfree) * st.f_frsize
            # room for the spec, logs and the weights (0.6 MB), not for the AdamW moments (1.25 MB) beside them
            subprocess.run(["mount", "-o", f"remount,size={used + (1 << 20)}", str(mnt)], check=True)
            with pytest.raises(StageFailed) as ei:
                run_stage(
                    "pretrain",
                    _cfg("pretrain.train.loop.max_steps=2", "checkpoint.save_steps=1"),
                    ArtifactStore(root),
                    data_copy,
                    progress=False,
                    retries=2,
                )
            err = capfd.readouterr().err
            msg = str(ei.value)
            assert ei.value.permanent and "\n" not in msg, msg
            assert ".safetensors: no space left on the device" in msg and str(root) in msg, msg
            assert "Traceback" not in err and "retrying" not in err and "SafetensorError" not in msg + err, err
            assert not list((root / "pretrain").glob("*")) if (root / "pretrain").exists() else True
        finally:
            subprocess.run(["umount", "-l", str(mnt)], check=False)


# ----------------------------------------------------------------------------- 8. no impossible figure


class TestNoImpossibleFigure:
    def test_mfu_denominator_is_the_theoretical_peak_not_a_busy_sgemm(self, tmp_path, data_artifact, monkeypatch):
        """A busy machine under-measures the sgemm; MFU divided by it once printed 211%."""
        from tasks.training import hardware

        monkeypatch.setattr(hardware, "measure_peak_flops", lambda *a, **k: 1e6)  # what a busy machine measures
        theo, how = hardware.theoretical_peak_flops()
        peak = hardware.resolve_peak_flops()
        assert theo > 1e9 and "cores ×" in how and peak.flops == theo and peak.achievable == 1e6
        fn, run_dir = _train(
            _cfg("pretrain.train.loop.max_steps=3", "pretrain.train.loop.eval_steps=3"), tmp_path, data_artifact
        )
        fn()
        rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        mfus = [r["mfu"] for r in rows if "mfu" in r]
        assert mfus and all(0 < m < 1 for m in mfus)
        assert hardware.resolve_peak_flops(5e9).flops == 5e9  # pretrain.train.loop.peak_flops, when set, is used as is


# ----------------------------------------------------------------------------- issue 27: resume after kill -9


class TestResumeAtTheEnd:
    @pytest.mark.parametrize("metrics", ["kept", "torn", "lost"])
    def test_killed_after_the_last_checkpoint_resumes_and_publishes(self, tmp_path, data_artifact, metrics):
        """Killed after the final checkpoint but before publishing: the resume has no step left; it failed with
        `unsupported format string passed to NoneType.__format__` (val_loss None) instead of publishing."""
        root = tmp_path / "art"
        data_copy = _copy_data(data_artifact, root)
        fn, run_dir = _train(
            _cfg("pretrain.train.loop.max_steps=3", "pretrain.train.loop.eval_steps=2"), root, data_copy
        )
        first = fn()
        val = ArtifactStore.read_manifest(first)["metrics"]["val_loss"]
        shutil.rmtree(first)  # as if the kill came just before the rename into place
        m = run_dir / "metrics.jsonl"
        if metrics == "torn":
            m.write_text(m.read_text()[:-20])
        elif metrics == "lost":
            m.unlink()
        again = fn()
        got = ArtifactStore.read_manifest(again)["metrics"]
        # the same run replayed from its checkpoint: the same kernels on the same shapes (1e-5 relative leaves room
        # for the validation graph's compile-time choices; a wrong resume moves the loss by far more)
        assert got["steps"] == 3 and got["val_loss"] == pytest.approx(val, rel=1e-5)
