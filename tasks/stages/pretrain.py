"""The pretrain stage: from scratch, or continued from a model artifact, on a data artifact.

    path = run(cfg, store, data_artifact)                  # supervised child process, cached by content
    path = run(cfg, store, data_artifact, init_from=prev)   # continued pretraining (keeps prev's tokenizer)

The stage runs in a child process (`python -m tasks.stages.pretrain --child SPEC`):
MindSpore's context is process-global, and a crash or OOM must not take the
caller (a Prefect flow) down. The child trains in `<root>/runs/pretrain/<key>/`
(checkpoints, metrics) and publishes the artifact through the store when done;
a retry of the same key resumes from the newest checkpoint there.

Artifact payload: model.safetensors (weights), model.json (architecture,
tokenizer ids), the tokenizer files, metrics.jsonl, loss_curve.png.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from model.config import ModelConfig
from model.runtime import setup_mindspore
from tasks.config.schema import PipelineConfig
from tasks.runtime.mesh import Mesh
from tasks.runtime.supervise import supervise
from tasks.stages import code_version
from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import sha256_file
from tasks.store.errors import ArtifactError
from tasks.store.model_artifact import read_info, write_model
from tasks.store.published import verify_published
from tasks.store.reader import block_batches
from tasks.store.tensors import load_weights
from tasks.tokenizer import files_sha256, tokenizer_files
from tasks.training.checkpoint import load_checkpoint, newest_checkpoint
from tasks.training.metrics import add_run_files
from tasks.training.outcome import run_outcome
from tasks.training.resume import resolve_checkpoint
from tasks.training.schedule import budget_line
from tasks.training.trainer import Hooks, Sinks, TrainData, Trainee, fit

STAGE = "pretrain"


# ----------------------------------------------------------------------------- keys and inputs


def stage_key(
    cfg: PipelineConfig, store: ArtifactStore, data_artifact: Path, init_from: Path | None, stage: str = STAGE
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    inputs = [store.input_ref(data_artifact)]
    if init_from is not None:
        inputs.append(store.input_ref(init_from))
    section = {"model": cfg.section("model"), "pretrain": cfg.section("pretrain"), "parallel": cfg.layout_section()}
    section["pretrain"].pop("init_from", None)  # identified by its digest among the inputs instead
    if cfg.checkpoint.load_checkpoint:  # continuing a training checkpoint: which one, by content
        section["load_checkpoint"] = checkpoint_ref(cfg.resolve_path(cfg.checkpoint.load_checkpoint))
    return store.key(stage, section, inputs, code_version(stage)), inputs, section


def checkpoint_ref(path: Path) -> dict[str, Any]:
    """Identity of a training checkpoint for cache keys: its path and the digest of its state.json."""

    ckpt = resolve_checkpoint(path)
    return {"path": str(ckpt), "state_sha256": sha256_file(ckpt / "state.json")}


# ----------------------------------------------------------------------------- supervisor (parent)


def run(
    cfg: PipelineConfig,
    store: ArtifactStore,
    data_artifact: Path,
    init_from: Path | None = None,
    *,
    keyed: tuple,
    retries: int = 0,
    isolate: bool = True,
    progress: bool = True,
    inject: dict | None = None,
) -> Path:
    """Return the pretrain artifact for these inputs, training it in a child process if needed.

    A failed attempt is retried `retries` times; each retry resumes from the newest checkpoint.
    `inject` (tests only) adds fault settings to the first attempt: {"stop_after": k} stops it
    after k steps as if killed, {"fault_steps": [...]} makes those steps non-finite. `keyed`: what `stage_key`
    returned for these arguments, from the stage runner (tasks/stages/runner.py), which resolved the inputs, checked the
    machine and computed it once."""

    data_artifact = store.inside(data_artifact)
    init_from = store.inside(init_from) if init_from else None
    key = keyed[0]
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    spec = {
        "config": cfg.model_dump(mode="json"),
        "root": str(store.root),
        "data": str(data_artifact),
        "init_from": str(init_from) if init_from else None,
        "key": key,
        "keyed": list(keyed),
        "progress": progress and sys.stderr.isatty(),
    }  # a bar only where a terminal shows it
    return supervise(
        STAGE, store, key, spec, train, retries=retries, isolate=isolate, inject=inject, parallel=cfg.parallel
    )


# ----------------------------------------------------------------------------- data


def mixed_batches(main: Iterator, replay: Iterator | None, ratio: float, batch_size: int) -> Iterator:
    """Replace round(ratio × B) rows of each main batch with rows of the replay stream."""
    n_replay = int(round(ratio * batch_size)) if replay is not None else 0
    for ids, labels in main:
        if n_replay:
            rids, rlabels = next(replay)
            ids = np.concatenate([ids[: batch_size - n_replay], rids[:n_replay]])
            labels = np.concatenate([labels[: batch_size - n_replay], rlabels[:n_replay]])
        yield ids, labels


def unigram_entropy(data_artifact: Path, split: str = "train") -> float:
    """Entropy (nats/token) of the split's unigram token distribution: the loss of a model that ignores context."""
    counts: np.ndarray | None = None
    for _ids, labels in block_batches(data_artifact, split, 64, 10**9, seed=0, repeat=False):
        tok = labels[labels != -100]
        c = np.bincount(tok, minlength=1)
        counts = (
            c
            if counts is None
            else np.pad(counts, (0, max(0, len(c) - len(counts)))) + np.pad(c, (0, max(0, len(counts) - len(c))))
        )
    if counts is None or counts.sum() == 0:
        return float("nan")
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def replay_data_artifact(store: ArtifactStore, init_from: Path) -> Path:
    """The data artifact `init_from` was trained on, found by its key in this store (a manifest's
    recorded path is never followed outside the artifact root) and checked against its recorded digest."""

    prev = store.read_manifest(init_from)
    ref = next((i for i in prev.get("inputs", []) if i.get("kind") == "artifact" and i.get("stage") == "data"), None)
    found = None
    if ref is not None:
        try:
            found = store.lookup("data", str(ref.get("key", "")))
        except ArtifactError:
            found = None
    if found is None:
        raise ValueError(
            f"pretrain.replay_ratio: the data artifact of {init_from} is not in {store.root}; "
            "rebuild it or set replay_ratio: 0"
        )
    if store.read_manifest(found)["digest"] != ref.get("digest"):
        raise ValueError(
            f"pretrain.replay_ratio: {found} differs from the data {init_from} was trained on "
            "(digest mismatch); rebuild it or set replay_ratio: 0"
        )
    return found


# ----------------------------------------------------------------------------- the child
# MindSpore loads inside the child's functions only (tasks.modeling.build, .step): the parent (CLI, flows)
# imports this module without it.


def train(spec: dict[str, Any]) -> Path | None:
    """Train and publish the artifact (runs inside the child process): setup → build → data → fit → publish."""
    cfg = PipelineConfig.model_validate(spec["config"])
    setup_mindspore(cfg.parallel.device_target, seed=cfg.pretrain.seed, host_blocking=True)
    par = cfg.parallel
    mesh = Mesh.init(par.data_parallel, par.tensor_parallel, par.optimizer_shard) if par.device_num > 1 else Mesh()
    return _train(
        cfg,
        ArtifactStore(spec["root"]),
        Path(spec["data"]),
        Path(spec["init_from"]) if spec["init_from"] else None,
        spec["key"],
        spec.get("progress", True),
        stop_after=spec.get("stop_after"),
        fault_steps=spec.get("fault_steps", []),
        mesh=mesh,
        keyed=spec["keyed"],
    )


def network(cfg: PipelineConfig, init_from: Path | None, mesh: Mesh | None = None):
    """The model (tasks/modeling/build.py `Built`): architecture and weights from the init artifact when continuing,
    else from the config (seeded init); this rank's slice, the fused cells where they run."""
    from tasks.modeling.build import build_network  # MindSpore: the child's import (the parent's stays light)

    pt = cfg.pretrain
    common = dict(seed=pt.seed, precision=pt.train.precision.dtype, fused_kernels=pt.train.fused_kernels, mesh=mesh)
    if init_from is None:
        return build_network(cfg.model.name, cfg.model.resolve(), **common)
    info = read_info(init_from)
    return build_network(
        info.get("name", cfg.model.name),
        ModelConfig.from_dict(info["model"]),
        weights=load_weights(init_from),
        source=str(init_from),
        **common,
    )


def _check_tokenizer(data_artifact: Path, init_from: Path | None, mc: ModelConfig) -> dict[str, Any]:
    """The data artifact's tokenizer info, checked against the model (vocab) and, when continuing, the base's."""
    tok = json.loads(verify_published(data_artifact / "tokenizer_info.json").read_text())
    for f in tokenizer_files(data_artifact):  # copied into the model artifact when publishing
        verify_published(f)
    if tok["vocab_size"] != mc.vocab_size:
        raise ValueError(
            f"tokenizer of {data_artifact} has {tok['vocab_size']} pieces but the model's vocab_size is "
            f"{mc.vocab_size}; set model.vocab_size / data.tokenizer.vocab_size to match"
        )
    if init_from is not None and _tok_sha(init_from) != _tok_sha(data_artifact):
        raise ValueError(
            f"continued pretraining must keep the base model's tokenizer: {data_artifact} was tokenized with "
            f"another tokenizer than {init_from}; rerun the data stage with the base's tokenizer"
        )
    return tok


def _data(
    cfg: PipelineConfig, store: ArtifactStore, data_artifact: Path, init_from: Path | None, seq: int, mesh: Mesh
) -> tuple[Callable[[int], Iterator], Callable[[], Iterator]]:
    """(train batches from a sample index, validation batches): data-parallel replicas read disjoint slices of the
    training blocks (mixed with replayed base data when continuing with pretrain.replay_ratio); validation reads
    global batches, the same held-out samples whatever the layout."""
    pt = cfg.pretrain
    mb = pt.train.loop.micro_batch_size
    replay_data = replay_data_artifact(store, init_from) if init_from is not None and pt.replay_ratio > 0 else None
    shards = {"num_shards": mesh.dp, "shard_id": mesh.dp_index}

    def batches(start: int) -> Iterator:
        main = block_batches(data_artifact, "train", mb, seq, pt.seed, start_sample=start, **shards)
        replay = (
            block_batches(replay_data, "train", mb, seq, pt.seed + 1, start_sample=start, **shards)
            if replay_data
            else None
        )
        return mixed_batches(main, replay, pt.replay_ratio, mb)

    def valid() -> Iterator:
        return block_batches(data_artifact, "valid", mb * mesh.dp, seq, 0, repeat=False)

    return batches, valid


def _train(
    cfg: PipelineConfig,
    store: ArtifactStore,
    data_artifact: Path,
    init_from: Path | None,
    key: str,
    progress: bool,
    stop_after: int | None = None,
    fault_steps: list[int] | None = None,
    mesh: Mesh | None = None,
    *,
    keyed: list,
) -> Path | None:
    """`keyed`: the parent's (key, inputs, section), for the manifest."""
    from tasks.modeling.build import log_kernels  # MindSpore: the child's imports (the parent's stay light)
    from tasks.training.step import causal_lm_loss_fn

    mesh = mesh or Mesh()
    pt = cfg.pretrain
    built = network(cfg, init_from, mesh)
    net, mc = built.net, built.config
    kernels = log_kernels(built.kernels, STAGE)  # logged once; recorded in the manifest
    tok = _check_tokenizer(data_artifact, init_from, mc)
    if pt.recompute:
        net.enable_recompute()
    seq = pt.seq_length
    print(f"[pretrain] {budget_line(pt.train.loop, seq)}", file=sys.stderr)
    batches, valid = _data(cfg, store, data_artifact, init_from, seq, mesh)
    params = net.trainable_params()
    run_dir = store.root / "runs" / STAGE / key
    meta = {
        "model": mc.to_dict(),
        "name": cfg.model.name,
        "tokenizer_sha256": _tok_sha(data_artifact),
        "seed": pt.seed,
        "data_artifact": store.read_manifest(data_artifact)["key"],
    }
    trainee = Trainee(net, params, causal_lm_loss_fn(net), mc.flops_per_token(seq), built.kernels)
    result = fit(
        trainee,
        pt.train,
        TrainData(batches, valid, seq),
        Sinks(run_dir, meta, progress),
        checkpoint=cfg.checkpoint,
        mesh=mesh,
        hooks=Hooks(list(fault_steps or []), stop_after),
    )
    if (outcome := run_outcome(result, mesh, run_dir)) is not True:
        return outcome  # stopped on request, or not rank 0: rank 0 publishes
    weights = {p.name: p.asnumpy() for p in params}
    if mesh.tp > 1:  # the full model, merged from the final checkpoint's tensor-parallel slices
        weights = load_checkpoint(newest_checkpoint(run_dir / "checkpoints"))[0]
    return _publish(cfg, store, keyed, data_artifact, init_from, mc, weights, tok, result, seq, mesh, kernels)


def _publish(
    cfg: PipelineConfig,
    store: ArtifactStore,
    keyed,
    data_artifact: Path,
    init_from: Path | None,
    mc: ModelConfig,
    weights: dict[str, np.ndarray],
    tok: dict[str, Any],
    result,
    seq: int,
    mesh: Mesh,
    kernels: str,
) -> Path:
    """The model artifact: weights, tokenizer, model.json, the run's files and its metrics."""
    pt = cfg.pretrain
    key, inputs, section = keyed
    entropy = unigram_entropy(data_artifact)
    val = "n/a (no validation split)" if result.val_loss is None else f"{result.val_loss:.4f}"
    print(f"[pretrain] val_loss {val} vs unigram entropy {entropy:.4f} nats/token", file=sys.stderr)
    run_dir = store.root / "runs" / STAGE / key
    with store.build(STAGE, key, pipeline=cfg.name, config=section, inputs=inputs, code=code_version(STAGE)) as b:
        write_model(
            b.dir,
            name=cfg.model.name,
            config=mc,
            weights=weights,
            tokenizer_model=data_artifact,
            tokenizer_info=tok,
            seq_length=seq,
        )
        add_run_files(b.dir, run_dir, result, f"{cfg.name}: {cfg.model.preset} ({mc.num_parameters / 1e6:.1f}M params)")
        b.metrics.update(
            **result.manifest_metrics(),
            tokens=result.consumed_samples * seq,
            val_ppl=math.exp(result.val_loss) if result.val_loss is not None else None,
            unigram_entropy=entropy,
            precision=pt.train.precision.dtype,
            parameters=mc.num_parameters,
            continued_from=str(init_from) if init_from else None,
            layout=mesh.layout(),
            native_kernels=kernels,
        )
    return b.path


def _tok_sha(artifact: Path) -> str:
    """The digest of the artifact's tokenizer files (tasks.tokenizer.files_sha256)."""
    return files_sha256(tokenizer_files(artifact))
