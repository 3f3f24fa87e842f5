"""The finetune stage: LoRA or full fine-tuning of a model artifact (merging the result: tasks/modeling/merge.py).

    path = run(cfg, store, base_artifact)     # supervised child process, cached by content
    merged = merge(store, path)               # tasks.modeling.merge: a model artifact (stage `merged`) for eval/export

Data: tasks/stages/finetune/data.py (formats, template, packing, the batch stream). Settings:
`finetune.train`, the `train` shape of every stage, handed whole to `fit`; it takes from pretrain.train
only tasks.config.schema.FINETUNE_INHERITS (AdamW's betas/eps, grad_clip, max_nonfinite_steps, peak_flops,
fused_kernels), the rest from FINETUNE_DEFAULTS and what finetune.train sets.

Training reuses `tasks.training.trainer.fit` (the one loop): only the LoRA matrices (or, with
`method: full`, every weight) are handed to it as `params`, so the base weights are
outside the optimizer and stay bit-identical. Checkpoints live in
`<root>/runs/finetune/<key>/`; a rerun of the same key resumes from the newest.

Artifact payload: adapter.safetensors (the LoRA matrices `<module>.lora_A` [r, in] and
`<module>.lora_B` [out, r]; with `method: full`, every weight), adapter.json (method,
rank, alpha, scaling, target modules, template, seq_length and the base artifact's
stage/key/digest/path), metrics.jsonl, loss_curve.png. No tokenizer and no base
weights: `merge()` takes both from the base artifact it names.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from model.config import ModelConfig
from model.runtime import setup_mindspore
from tasks.config.schema import ConfigError, PipelineConfig
from tasks.prompts import TEMPLATE
from tasks.runtime.mesh import Mesh
from tasks.runtime.supervise import supervise
from tasks.stages import code_version
from tasks.stages.finetune.data import example_batches, load_data, source_files
from tasks.store.artifacts import ArtifactStore, raw_file_input
from tasks.store.disk import atomic_write_json
from tasks.store.model_artifact import load_tokenizer, read_info
from tasks.store.tensors import load_weights, save_tensors
from tasks.training.metrics import add_run_files
from tasks.training.outcome import run_outcome
from tasks.training.trainer import Hooks, Sinks, TrainData, Trainee, fit

STAGE = "finetune"
MERGED = "merged"


# ----------------------------------------------------------------------------- keys, inputs, checks


def seq_length_for(cfg: PipelineConfig, info: dict[str, Any]) -> int:
    max_len = info["model"]["max_seq_length"]
    return cfg.finetune.seq_length or min(info.get("seq_length") or max_len, max_len)


def check(cfg: PipelineConfig, info: dict[str, Any]) -> None:
    """Settings that depend on the base model or span keys; ConfigError naming the YAML path."""
    ft, p = cfg.finetune, f"pipelines.{cfg.name}.finetune"
    errs = []
    max_len = info["model"]["max_seq_length"]
    if ft.seq_length is not None and ft.seq_length > max_len:
        errs.append(f"{p}.seq_length: {ft.seq_length} exceeds the base model's max_seq_length={max_len}; lower it")
    if errs:
        raise ConfigError(errs)


def stage_key(
    cfg: PipelineConfig, store: ArtifactStore, base: Path
) -> tuple[str, list[dict[str, Any]], dict[str, Any]]:
    """Content key over the finetune settings that shape the output, the base's digest and the data bytes."""
    inputs = [store.input_ref(base), *(raw_file_input(f) for f in source_files(cfg))]
    ft = cfg.section("finetune")
    ft.pop("sources")  # identified by their bytes among the inputs
    if ft["method"] == "full":
        ft.pop("lora")
    section = {"finetune": ft}  # ft["train"]: resolved, with what it inherited from pretrain.train
    if ft["format"] == "text":
        section["text_field"] = cfg.data.text_field
    if cfg.parallel.device_num > 1:  # data parallel multiplies the global batch
        section["parallel"] = cfg.layout_section()
    return store.key(STAGE, section, inputs, code_version(STAGE)), inputs, section


# ----------------------------------------------------------------------------- supervisor (parent)


def run(
    cfg: PipelineConfig,
    store: ArtifactStore,
    base_artifact: Path,
    *,
    keyed: tuple,
    progress: bool = True,
    isolate: bool = True,
    retries: int = 0,
    inject: dict | None = None,
) -> Path:
    """Return the finetune artifact for this base and data, training it in a child process if needed.

    `isolate=False` trains in this process (tests). `inject` (tests only) adds
    {"stop_after": k} / {"fault_steps": [...]} to the first attempt, as in pretrain. `keyed`: what `stage_key`
    returned for these arguments, from the stage runner (tasks/stages/runner.py), which resolved the inputs, checked the
    machine and computed it once."""

    base = store.inside(base_artifact)
    check(cfg, read_info(base))
    if cfg.parallel.tensor_parallel > 1:
        raise ValueError(
            f"parallel.tensor_parallel: {cfg.parallel.tensor_parallel} > 1 is for pretraining; fine-tuning runs data "
            "parallel only (LoRA adapters are not split across ranks); run this stage with "
            f"--set parallel.tensor_parallel=1 --set parallel.device_num={cfg.parallel.data_parallel}"
        )
    key = keyed[0]
    hit = store.lookup(STAGE, key)
    if hit is not None:
        return hit
    spec = {
        "config": cfg.model_dump(mode="json"),
        "root": str(store.root),
        "base": str(base),
        "key": key,
        "keyed": list(keyed),
        "progress": progress and sys.stderr.isatty(),
    }  # a bar only where a terminal shows it
    return supervise(
        STAGE, store, key, spec, train, retries=retries, isolate=isolate, inject=inject, parallel=cfg.parallel
    )


# ----------------------------------------------------------------------------- the child


def train(spec: dict[str, Any]) -> Path | None:
    """Train and publish the artifact (inside the child process, or in-process with isolate=False)."""
    cfg = PipelineConfig.model_validate(spec["config"])
    setup_mindspore(cfg.parallel.device_target, seed=cfg.finetune.seed, host_blocking=True)
    mesh = (
        Mesh.init(cfg.parallel.data_parallel, 1, cfg.parallel.optimizer_shard)
        if cfg.parallel.device_num > 1
        else Mesh()
    )
    return _train(
        cfg,
        ArtifactStore(spec["root"]),
        Path(spec["base"]),
        spec["key"],
        spec.get("progress", True),
        stop_after=spec.get("stop_after"),
        fault_steps=spec.get("fault_steps", []),
        mesh=mesh,
        keyed=spec["keyed"],
    )


def network(cfg: PipelineConfig, base: Path, info: dict[str, Any]):
    """`info`: the base's model.json. (the base model with LoRA injected or every weight trainable
    (tasks/modeling/build.py `Built`), its
    trainable params, the LoRA modules). fp32 compute: LoRALinear is fp32 (train.precision sets loss scaling)."""
    from model.lora import inject_lora, mark_only_lora_trainable  # MindSpore: the child's imports
    from tasks.modeling.build import build_network

    ft = cfg.finetune
    built = build_network(
        info.get("name", "llama"),
        ModelConfig.from_dict(info["model"]),
        seed=ft.seed,
        fused_kernels=ft.train.fused_kernels,
        weights=load_weights(base),
        source=str(base),
    )
    net, modules = built.net, []
    if ft.method == "lora":
        lc = ft.lora
        modules = inject_lora(net, lc.target_modules, lc.rank, lc.alpha, lc.dropout, seed=ft.seed)
        return built, mark_only_lora_trainable(net), modules
    return built, net.trainable_params(), modules


def _batches(cfg: PipelineConfig, data, pad: int, mesh: Mesh):
    """(train batches from a sample index, validation batches or None): data-parallel rank r trains on rows r,
    r + dp, ... of the global batch (micro × dp examples); rank 0 validates on global batches, the same examples
    whatever the layout."""
    ft = cfg.finetune
    mb = ft.train.loop.micro_batch_size

    def batches(start: int) -> Iterator:
        for ids, labels in example_batches(data.train, mb * mesh.dp, ft.seed, start_sample=start, pad_id=pad):
            yield ids[mesh.dp_index :: mesh.dp], labels[mesh.dp_index :: mesh.dp]

    def valid() -> Iterator:
        return example_batches(data.valid, mb * mesh.dp, ft.seed, repeat=False, shuffle=False, pad_id=pad)

    return batches, (valid if data.valid is not None else None)


def _train(
    cfg: PipelineConfig,
    store: ArtifactStore,
    base: Path,
    key: str,
    progress: bool,
    stop_after: int | None = None,
    fault_steps: list[int] | None = None,
    mesh=None,
    *,
    keyed: list,
) -> Path | None:
    """`keyed`: the parent's (key, inputs, section), for the manifest."""
    from model.lora import trainable_summary  # MindSpore: the child's imports
    from tasks.modeling.build import log_kernels
    from tasks.training.step import causal_lm_loss_fn

    mesh = mesh or Mesh()
    ft = cfg.finetune
    info = read_info(base)
    built, params, modules = network(cfg, base, info)
    net, mc = built.net, built.config
    kernels = log_kernels(built.kernels, STAGE)  # logged once; recorded in the manifest
    seq = seq_length_for(cfg, info)
    sp = load_tokenizer(base)
    data = load_data(cfg, sp, seq)
    print(f"[finetune] {ft.format} data: {data.stats}", file=sys.stderr)
    summary = trainable_summary(net)
    print(f"[finetune] {ft.method}: {summary.line()}", file=sys.stderr)
    net.set_train(True)
    batches, valid = _batches(cfg, data, sp.pad_id() if sp.pad_id() >= 0 else sp.eos_id(), mesh)
    run_dir = store.root / "runs" / STAGE / key
    _, inputs, section = keyed
    meta = {
        "model": mc.to_dict(),
        "name": info.get("name", "llama"),
        "base_artifact": inputs[0]["key"],
        "method": ft.method,
        "seed": ft.seed,
    }
    # Model FLOPs per token: forward + backward; with LoRA the frozen weights need no weight
    # gradients, so about 4N instead of 6N (the adapters' own matmuls are negligible).
    fpt = mc.flops_per_token(seq) * (4 / 6 if ft.method == "lora" else 1.0)
    result = fit(
        Trainee(net, params, causal_lm_loss_fn(net), fpt, built.kernels),
        ft.train,
        TrainData(batches, valid, seq),
        Sinks(run_dir, meta, progress),
        checkpoint=cfg.checkpoint,
        mesh=mesh,
        hooks=Hooks(list(fault_steps or []), stop_after),
    )
    if (outcome := run_outcome(result, mesh, run_dir)) is not True:
        return outcome  # stopped on request, or not rank 0: rank 0 publishes
    return _publish(
        cfg, store, (key, inputs, section), net, params, modules, info, sp, data, summary, result, seq, kernels
    )


def _publish(
    cfg: PipelineConfig,
    store: ArtifactStore,
    keyed: tuple,
    net,
    params,
    modules: list[str],
    info: dict[str, Any],
    sp,
    data,
    summary,
    result,
    seq: int,
    kernels: str,
) -> Path:
    """The adapter artifact: adapter.safetensors + adapter.json, the run's files and its metrics."""
    from model.lora import lora_state_dict  # lazy: MindSpore, the child's import

    ft, lc = cfg.finetune, cfg.finetune.lora
    key, inputs, section = keyed
    base_ref = inputs[0]
    run_dir = store.root / "runs" / STAGE / key
    train_rows = [r for r in result.history if "grad_norm" in r]
    with store.build(STAGE, key, pipeline=cfg.name, config=section, inputs=inputs, code=code_version(STAGE)) as b:
        weights = lora_state_dict(net) if ft.method == "lora" else {p.name: p.asnumpy() for p in params}
        save_tensors(b.dir / "adapter.safetensors", weights)
        atomic_write_json(
            b.dir / "adapter.json",
            {
                "method": ft.method,
                **(
                    {
                        "rank": lc.rank,
                        "alpha": lc.alpha,
                        "scaling": lc.alpha / lc.rank,
                        "dropout": lc.dropout,
                        "target_modules": lc.target_modules,
                        "modules": modules,
                    }
                    if ft.method == "lora"
                    else {}
                ),
                "format": ft.format,
                "template": (
                    ("chat_template of the tokenizer" if sp.chat_template else TEMPLATE)
                    if ft.format == "instruction"
                    else None
                ),
                "seq_length": seq,
                "base": {k: base_ref[k] for k in ("stage", "key", "digest", "path")},
                "model": {"name": info.get("name", "llama"), "config": net.config.to_dict()},
            },
        )
        add_run_files(
            b.dir,
            run_dir,
            result,
            f"{cfg.name}: {ft.method} fine-tuning ({summary.trainable / 1e6:.3g}M "
            f"trainable{', response tokens only' if ft.format == 'instruction' else ''})",
        )
        b.metrics.update(
            **result.manifest_metrics(),
            method=ft.method,
            native_kernels=kernels,
            first_loss=train_rows[0]["loss"] if train_rows else None,
            first_loss_step=train_rows[0]["step"] if train_rows else None,
            loss_on="response tokens" if ft.format == "instruction" else "all tokens",
            trainable_params=summary.trainable,
            total_params=summary.total,
            trainable_share=summary.share,
            adapter_bytes=(b.dir / "adapter.safetensors").stat().st_size,
            seq_length=seq,
            **data.stats,
        )
    print(
        f"[finetune] validation loss {result.initial_val_loss} -> {result.val_loss} "
        f"({b.metrics['loss_on']}); adapter {b.metrics['adapter_bytes'] / 1e6:.2f} MB",
        file=sys.stderr,
    )
    return b.path
