"""The rules that span keys or touch the file system, one function per concern; each message names a
YAML path and a fix. `check_pipeline` runs them all, so every problem is reported together."""

from __future__ import annotations

import glob
from pathlib import Path

from model.config import PRESETS, SCORING_MAX_BYTES, ModelConfig
from model.registry import BUILTIN_MODELS
from tasks.config.schema import PipelineConfig, _suggest


def expand_source(cfg: PipelineConfig, src: str) -> list[Path]:
    if src.startswith("hf:"):
        return []
    p = cfg.resolve_path(src)
    if any(ch in src for ch in "*?["):
        return [Path(x) for x in sorted(glob.glob(str(p), recursive=True))]
    return [p] if p.exists() else []


def check_pipeline(cfg: PipelineConfig, prefix: str, check_files: bool = True) -> list[str]:
    """Rules that span keys or touch the file system, one function per concern; each message names a
    YAML path and a fix. Every rule runs, so all problems are reported together."""
    errs, mc = _model_rules(cfg, prefix)
    if mc is None:
        return errs
    for rule in (_layout_rules, _length_rules, _tokenizer_rules, _schedule_rules, _lora_rules, _eval_rules):
        errs += rule(cfg, prefix, mc)
    if check_files:
        errs += _file_rules(cfg, prefix)
    return errs


def _model_rules(cfg: PipelineConfig, prefix: str) -> tuple[list[str], ModelConfig | None]:
    """The model name and preset resolve to a ModelConfig (the other rules need it)."""
    errs: list[str] = []
    if cfg.model.name not in BUILTIN_MODELS:
        errs.append(
            f"{prefix}.model.name: unknown model '{cfg.model.name}'; "
            f"{_suggest(cfg.model.name, sorted(BUILTIN_MODELS)).replace('valid keys', 'registered models')}"
        )
    if cfg.model.preset not in PRESETS:
        errs.append(
            f"{prefix}.model.preset: unknown preset '{cfg.model.preset}'; "
            f"{_suggest(cfg.model.preset, list(PRESETS)).replace('valid keys', 'presets')}"
        )
        return errs, None
    try:
        mc = cfg.model.resolve()
    except ValueError as exc:
        errs.append(f"{prefix}.model: {exc}")
        return errs, None
    return errs, mc


def _layout_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """Tensor-parallel divisibility and the parallel layout (device counts, stages, nodes)."""
    errs: list[str] = []
    par = cfg.parallel
    if mc.num_heads % mc.num_kv_heads:
        errs.append(
            f"{prefix}.model.num_kv_heads: num_heads={mc.num_heads} is not divisible by "
            f"num_kv_heads={mc.num_kv_heads}; "
            "choose num_kv_heads that divides num_heads"
        )
    if mc.num_heads % par.tensor_parallel or mc.num_kv_heads % par.tensor_parallel:
        errs.append(
            f"{prefix}.parallel.tensor_parallel: {par.tensor_parallel} must divide num_heads={mc.num_heads} "
            f"and num_kv_heads={mc.num_kv_heads}; pick a divisor of {mc.num_kv_heads}"
        )
    elif mc.intermediate_size % par.tensor_parallel:
        errs.append(
            f"{prefix}.parallel.tensor_parallel: {par.tensor_parallel} must divide "
            f"intermediate_size={mc.intermediate_size}"
        )
    prod = par.data_parallel * par.tensor_parallel
    if prod != par.device_num:
        errs.append(
            f"{prefix}.parallel.device_num: data_parallel×tensor_parallel = "
            f"{par.data_parallel}×{par.tensor_parallel} = {prod} but device_num = {par.device_num}; "
            f"set device_num: {prod} or change the layout"
        )
    pl = cfg.plan
    if pl.micro_batch_num < pl.pipeline_parallel:
        errs.append(
            f"{prefix}.plan.micro_batch_num: {pl.micro_batch_num} < pipeline_parallel={pl.pipeline_parallel}; "
            f"set micro_batch_num >= {pl.pipeline_parallel} so every stage has work"
        )
    if pl.pipeline_parallel > mc.num_layers:
        errs.append(
            f"{prefix}.plan.pipeline_parallel: {pl.pipeline_parallel} stages for {mc.num_layers} layers; "
            f"use at most {mc.num_layers}"
        )
    if par.node_rank >= par.node_num:
        errs.append(f"{prefix}.parallel.node_rank: {par.node_rank} must be < node_num={par.node_num}")
    if par.device_num % par.node_num:
        errs.append(
            f"{prefix}.parallel.node_num: device_num={par.device_num} does not split evenly over "
            f"node_num={par.node_num} nodes; make device_num a multiple of node_num"
        )
    if par.optimizer_shard and par.data_parallel > 1 and par.tensor_parallel > 1:
        errs.append(
            f"{prefix}.parallel.optimizer_shard: optimizer sharding (ZeRO-1) is built for data parallel "
            f"only, not with tensor_parallel={par.tensor_parallel}; set tensor_parallel: 1 or "
            "optimizer_shard: false"
        )
    return errs


def _length_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """Sequence lengths against the model's max_seq_length."""
    errs: list[str] = []
    if cfg.data.seq_length > mc.max_seq_length:
        errs.append(
            f"{prefix}.data.seq_length: {cfg.data.seq_length} exceeds the model's max_seq_length={mc.max_seq_length}; "
            f"lower it or set model.max_seq_length"
        )
    sl = cfg.pretrain.seq_length
    if sl is not None and sl > min(cfg.data.seq_length, mc.max_seq_length):
        errs.append(
            f"{prefix}.pretrain.seq_length: {sl} exceeds data.seq_length={cfg.data.seq_length} "
            f"(or the model's max_seq_length={mc.max_seq_length}); lower it"
        )
    if cfg.export.seq_length > mc.max_seq_length:
        errs.append(f"{prefix}.export.seq_length: {cfg.export.seq_length} exceeds max_seq_length={mc.max_seq_length}")
    return errs


def _tokenizer_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """The tokenizer's vocabulary against the model's."""
    errs: list[str] = []
    reused = cfg.data.tokenizer.path is not None or cfg.pretrain.init_from is not None  # the base's, checked later
    if not reused and cfg.data.tokenizer.vocab_size != mc.vocab_size:
        errs.append(
            f"{prefix}.data.tokenizer.vocab_size: {cfg.data.tokenizer.vocab_size} differs from the model's "
            f"vocab_size={mc.vocab_size}; make them equal (set model.vocab_size or data.tokenizer.vocab_size)"
        )
    return errs


def train_errors(train, where: str, device_target: str = "CPU") -> list[str]:
    """One `train` section's own rules (budget, warmup, learning rates, precision); `where` is its YAML path."""
    errs: list[str] = []
    loop, o = train.loop, train.optimizer
    key = where.split(".", 2)[-1]  # pretrain.train (without pipelines.NAME.)
    if loop.max_steps is None and loop.max_tokens is None:
        errs.append(f"{where}.loop.max_steps: set max_steps or max_tokens")
    if loop.max_steps is not None and loop.max_tokens is not None:
        errs.append(
            f"{where}.loop.max_tokens: both {key}.loop.max_steps ({loop.max_steps}) and {key}.loop.max_tokens "
            f"({loop.max_tokens}) are set; keep one of them (max_steps counts optimizer steps, max_tokens "
            "training tokens)"
        )
    if loop.max_steps is not None and train.schedule.warmup_steps > loop.max_steps:
        errs.append(
            f"{where}.schedule.warmup_steps: {train.schedule.warmup_steps} > max_steps={loop.max_steps}; "
            "warmup must fit in the run"
        )
    if o.min_lr is not None and o.min_lr > o.lr:
        errs.append(f"{where}.optimizer.min_lr: {o.min_lr} > lr={o.lr}; min_lr must be <= lr")
    if train.precision.dtype == "bf16" and device_target == "CPU":
        errs.append(
            f"{where}.precision.dtype: bf16 has no MindSpore CPU kernels for training "
            "(MatMul/Softmax reject bf16); use fp32 on CPU (fp16 also works on CPU, at about half the fp32 speed) "
            "or set parallel.device_target"
        )
    return errs


def _schedule_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """Each train section's rules (an error continued/finetune inherited from pretrain is reported once),
    finetune's fp32, and replay."""
    dev = cfg.parallel.device_target
    errs = train_errors(cfg.pretrain.train, f"{prefix}.pretrain.train", dev)
    for section in ("continued", "finetune"):
        for e in train_errors(getattr(cfg, section).train, f"{prefix}.{section}.train", dev):
            if e.replace(f"{prefix}.{section}.train", f"{prefix}.pretrain.train", 1) not in errs:
                errs.append(e)
    if cfg.finetune.train.precision.dtype != "fp32":
        errs.append(
            f"{prefix}.finetune.train.precision.dtype: fine-tuning trains in fp32 (the base model loads "
            "in fp32); remove it or set fp32"
        )
    if cfg.pretrain.replay_ratio > 0 and not cfg.pretrain.init_from:
        errs.append(
            f"{prefix}.pretrain.replay_ratio: replay needs pretrain.init_from (the model whose data is replayed)"
        )
    return errs


def _lora_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """LoRA target modules and the held-out split."""
    errs: list[str] = []
    valid_mods = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    tm = cfg.finetune.lora.target_modules
    if isinstance(tm, list):
        for i, m in enumerate(tm):
            if m not in valid_mods:
                errs.append(
                    f"{prefix}.finetune.lora.target_modules[{i}]: unknown module '{m}'; "
                    f"{_suggest(m, sorted(valid_mods)).replace('valid keys', 'modules')}"
                )
    if cfg.data.validation_fraction == 0 and cfg.data.validation_documents is None:
        errs.append(
            f"{prefix}.data.validation_fraction: 0 leaves no held-out split; set a fraction > 0 or validation_documents"
        )
    return errs


def _eval_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """eval.batch_size against what one scoring call of this model can hold (the scorer takes fewer rows where
    they would pass SCORING_MAX_BYTES of activations: a larger value would be clamped, silently)."""
    cap = mc.scoring_rows(1, cfg.eval.batch_size)  # rows of one token: the most any call takes
    if cfg.eval.batch_size <= cap:
        return []
    t = min(cfg.data.seq_length, mc.max_seq_length)
    return [
        f"{prefix}.eval.batch_size: {cfg.eval.batch_size} rows per scoring call, but this model's scorer holds "
        f"at most {cap} rows in its {SCORING_MAX_BYTES >> 30} GiB of activations (even of one token; "
        f"{mc.scoring_rows(t, cfg.eval.batch_size)} of data.seq_length={t}) and would clamp it to that; "
        f"set eval.batch_size at most {cap}"
    ]


def _file_rules(cfg: PipelineConfig, prefix: str) -> list[str]:
    """Every path the pipeline reads exists (skipped with check_files=False)."""
    errs: list[str] = []
    if not cfg.data.sources:
        errs.append(f"{prefix}.data.sources: empty; list at least one corpus file, directory or glob")
    for i, src in enumerate(cfg.data.sources):
        if not src.startswith("hf:") and not expand_source(cfg, src):
            errs.append(
                f"{prefix}.data.sources[{i}]: '{src}' matches no file (looked in {cfg.resolve_path(src)}); fix the path"
            )
    for key, val in (
        ("data.tokenizer.path", cfg.data.tokenizer.path),
        ("checkpoint.load_checkpoint", cfg.checkpoint.load_checkpoint),
        ("pretrain.init_from", cfg.pretrain.init_from),
    ):
        if val and not cfg.resolve_path(val).exists():
            fix = (
                "fetch the model first (bash scripts/fetch_smollm2.sh fetches SmolLM2 for the smollm2 pipeline) or "
                "fix the path"
                if str(val).endswith(".gguf")
                else "fix the path"
            )
            errs.append(f"{prefix}.{key}: '{val}' does not exist (looked in {cfg.resolve_path(val)}); {fix}")
    for i, src in enumerate(cfg.continued.sources):
        if not expand_source(cfg, src):
            errs.append(
                f"{prefix}.continued.sources[{i}]: '{src}' matches no file (looked in {cfg.resolve_path(src)}); fix "
                "the path"
            )
    for i, src in enumerate(cfg.finetune.sources):
        if not expand_source(cfg, src):
            errs.append(f"{prefix}.finetune.sources[{i}]: '{src}' matches no file; fix the path")
    for i, src in enumerate(cfg.eval.perplexity_files):
        if not cfg.resolve_path(src).is_file():
            errs.append(f"{prefix}.eval.perplexity_files[{i}]: '{src}' is not a file; fix the path")
    return errs
