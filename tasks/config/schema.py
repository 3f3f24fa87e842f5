"""The `pipelines.yaml` schema: one pydantic model per section, a docstring per field.

Importable without MindSpore. Loading (`base:`, `--set`, the `train` inheritance) is in loader.py, the
rules that span keys in rules.py; `tasks.config` re-exports the public names.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from model.config import ModelConfig

# ----------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """One or more problems in a pipelines file; `errors` lists them, each naming its YAML path."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


def _suggest(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"{hint}valid keys: {', '.join(sorted(valid))}"


# ----------------------------------------------------------------------------- sections


class _Section(BaseModel):
    # allow_inf_nan=False: `.inf` / `.nan` are valid YAML floats, but no setting of this schema is
    # meaningful when infinite (an infinite learning rate or loss scale trains NaN weights).
    model_config = ConfigDict(extra="forbid", strict=True, validate_default=True, allow_inf_nan=False)


class ModelSection(_Section):
    name: str = "llama"
    """Registered model name (see model.registry.default_registry)."""
    preset: str = "tiny"
    """Named ModelConfig preset: tiny, small, tiny-llama-bench, llama2-7b, llama3-8b."""
    vocab_size: int | None = Field(None, gt=0)
    """Override the preset's vocabulary size (must equal the tokenizer's)."""
    hidden_size: int | None = Field(None, gt=0)
    intermediate_size: int | None = Field(None, gt=0)
    num_layers: int | None = Field(None, gt=0)
    num_heads: int | None = Field(None, gt=0)
    num_kv_heads: int | None = Field(None, gt=0)
    max_seq_length: int | None = Field(None, gt=0)
    rope_theta: float | None = Field(None, gt=0)
    norm_eps: float | None = Field(None, gt=0)
    tie_embeddings: bool | None = None
    init_std: float | None = Field(None, gt=0)

    def overrides(self) -> dict[str, Any]:
        return {k: v for k, v in self.model_dump().items() if k not in ("name", "preset") and v is not None}

    def resolve(self) -> ModelConfig:
        """The ModelConfig this section describes (preset + overrides)."""
        return ModelConfig.from_name(self.preset, **self.overrides())


class TokenizerSection(_Section):
    path: str | None = None
    """An existing tokenizer to reuse instead of training one: a SentencePiece tokenizer.model, a Hugging Face
    tokenizer.json (its tokenizer_config.json and chat template beside it are kept too), or a directory holding
    either (a model artifact). Continued pretraining keeps the base model's."""
    model_type: Literal["bpe", "unigram"] = "bpe"
    vocab_size: int = Field(512, ge=64)
    """Vocabulary size to train; must equal the model's vocab_size."""
    character_coverage: float = Field(1.0, gt=0, le=1.0)
    """SentencePiece character_coverage; 0.9995 suits Chinese/Japanese."""
    sample_documents: int = Field(20000, gt=0)
    """At most this many documents (chosen deterministically) train the tokenizer."""
    sample_chars: int = Field(20_000_000, gt=0)
    """...and at most about this many characters of them (bounds tokenizer training time and memory)."""
    max_sentence_length: int = Field(16384, gt=0)


class CleanSection(_Section):
    normalize: Literal["NFC", "NFKC", "none"] = "NFC"
    dedup: bool = True
    """Drop exact duplicates (by sha256 of the normalized text)."""
    min_chars: int = Field(1, ge=0)
    max_chars: int | None = Field(None, gt=0)
    invalid_utf8: Literal["replace", "skip"] = "replace"


class DataSection(_Section):
    sources: list[str] = Field(default_factory=list)
    """Files, directories or globs (.txt, .jsonl, .jsonl.gz, .json, .parquet), or `hf:NAME` for a cached hub dataset."""
    text_field: str = "text"
    """Field holding the document text in JSON / JSON Lines / parquet inputs."""
    txt_split: Literal["file", "blank_lines"] = "blank_lines"
    """`.txt` inputs: one document per file, or one per blank-line-separated paragraph."""
    seq_length: int = Field(128, gt=0)
    """Tokens per training example; blocks hold seq_length + 1 tokens."""
    tokenizer: TokenizerSection = Field(default_factory=TokenizerSection)
    clean: CleanSection = Field(default_factory=CleanSection)
    tail: Literal["drop", "pad"] = "drop"
    """What happens to the last partial block of each split."""
    validation_fraction: float = Field(0.05, ge=0, lt=1)
    validation_documents: int | None = Field(None, ge=1)
    """Held-out documents by count; overrides validation_fraction."""
    num_shards: int = Field(1, ge=1, le=1000)
    num_workers: int = Field(2, ge=1)
    """Processes that tokenize in parallel."""
    chunk_documents: int = Field(2000, ge=1)
    """Documents per tokenization chunk (the unit a Dask worker maps over)."""
    chunk_bytes: int = Field(2 * 1024 * 1024, ge=1)
    """...a chunk also closes at this many bytes of text, so corpora of long documents still fan out.
    Neither chunk setting changes the output bytes."""
    seed: int = 1234
    executor: Literal["processes", "dask"] = "processes"
    """Where chunks are tokenized: a local process pool, or mapped Prefect tasks on Dask (flows only)."""
    dask_address: str | None = None
    """With executor: dask, the scheduler of an existing Dask cluster (default: a LocalCluster of num_workers)."""


class OptimizerSection(_Section):
    """AdamW (torch's, with bias correction and decoupled weight decay)."""

    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    """Peak learning rate (after warmup)."""
    min_lr: float | None = Field(None, ge=0)
    """Learning rate at the end of the decay; defaults to lr / 10."""
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False

    @property
    def final_lr(self) -> float:
        """min_lr, or lr / 10 when unset."""
        return self.lr / 10 if self.min_lr is None else self.min_lr


class ScheduleSection(_Section):
    warmup_steps: int = Field(10, ge=0)
    """Linear warmup steps (must not exceed the run's steps)."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"


class LoopSection(_Section):
    """How long and how the loop steps, logs, validates and checkpoints."""

    max_steps: int | None = Field(None, gt=0)
    """Optimizer steps to train; or max_tokens (exactly one of them is set)."""
    max_tokens: int | None = Field(None, gt=0)
    """Alternative to max_steps: stop after this many training tokens (per step: micro_batch_size ×
    gradient_accumulation × data_parallel... counted per rank as micro_batch_size × gradient_accumulation × seq)."""
    micro_batch_size: int = Field(8, gt=0)
    """Examples per forward/backward on each data-parallel rank."""
    gradient_accumulation: int = Field(1, gt=0)
    grad_clip: float | None = Field(1.0, gt=0)
    """Global gradient-norm clip; null turns clipping off."""
    log_steps: int = Field(10, gt=0)
    eval_steps: int = Field(50, gt=0)
    """Validation loss every this many steps, and at the end."""
    eval_batches: int = Field(8, gt=0)
    save_steps: int | None = Field(None, gt=0)
    """Checkpoint every this many steps; defaults to checkpoint.save_steps (filled in when the pipeline loads)."""
    max_nonfinite_steps: int = Field(5, gt=0)
    """Consecutive NaN/Inf steps (each skipped) before the run stops."""
    peak_flops: float | None = Field(None, gt=0)
    """Device peak FLOP/s for MFU; derived from the hardware when omitted."""


class PrecisionSection(_Section):
    dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute dtype of the matmuls (master weights stay fp32)."""
    loss_scale: float = Field(65536.0, gt=0)
    """Initial dynamic loss scale (fp16 only): halved on every overflowed (skipped) step."""
    loss_scale_window: int = Field(1000, gt=0)
    """fp16 only: the loss scale doubles after this many consecutive finite steps."""


class TrainSection(_Section):
    """One training run's settings, the same shape in pretrain, continued and finetune, handed whole to
    `tasks.training.trainer.fit`. `continued.train` inherits all of `pretrain.train`; `finetune.train`
    inherits only FINETUNE_INHERITS from it (see tasks/config/loader.py `inherit_train`)."""

    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    loop: LoopSection = Field(default_factory=LoopSection)
    precision: PrecisionSection = Field(default_factory=PrecisionSection)
    fused_kernels: bool = True
    """fp32 training: the causal softmax, SwiGLU, RMSNorm, cross-entropy and the AdamW update as fused custom ops
    (model/train_kernels.cc, built with g++ on first use); the one decision is model.kernels.enabled. Without a
    compiler MindSpore's own ops run: the same math to ~1e-6, slower. false always uses MindSpore's own ops."""
    layerwise: bool = True
    """Run the train step one decoder layer at a time (tasks/training/layerwise.py; the default): the same step and
    arithmetic with one layer's working set and what each layer's written-out backward reads held, instead of every
    buffer of a whole-model graph. Measured side by side with HF (docs/BENCHMARKS.md "train", docs/MEMORY.md
    "Train"): at tiny, SmolLM2-135M and the 360M shape it is at or below HF sdpa's peak RSS (SmolLM2-135M, 2 x 128:
    3.2 GB against 3.35; the whole-model graph 4.9) and faster than torch.compile on AVX2 and AVX-512, where the
    whole-model step is 1.1-1.5x sdpa's memory. false runs the whole-model graph: 1.0-1.3x this step's speed where
    its memory fits (the preflight's memory plan says). LoRA trains the adapters alone this way (base
    weights and head frozen). Where it does not apply (tensor parallel; LoRA or fp16 without the fused fp32
    kernels) the whole-model step runs and the log says why."""


FINETUNE_INHERITS = (
    "optimizer.beta1",
    "optimizer.beta2",
    "optimizer.eps",
    "loop.grad_clip",
    "loop.max_nonfinite_steps",
    "loop.peak_flops",
    "fused_kernels",
    "layerwise",
)
"""The keys of pretrain.train that finetune.train takes when it does not set them: how AdamW and the loop
behave on this machine, not what the run learns. Everything else (learning rate, schedule, budget, batch,
precision, ...) comes from finetune.train or FINETUNE_DEFAULTS, never from pretrain."""

FINETUNE_DEFAULTS = {
    "optimizer": {"lr": 1e-3, "weight_decay": 0.0},
    "schedule": {"warmup_steps": 5},
    "loop": {"max_steps": 50, "eval_batches": 4, "save_steps": 50},
}
"""finetune.train's defaults where they differ from TrainSection's (LoRA: a higher lr, no weight decay)."""


class PretrainSection(_Section):
    train: TrainSection = Field(default_factory=TrainSection)
    """Optimizer, schedule, loop, precision and kernels (inherited by continued and, in part, finetune)."""
    seq_length: int | None = Field(None, gt=0)
    """Defaults to data.seq_length (filled in when the pipeline loads); must not exceed it."""
    recompute: bool = False
    seed: int = 42
    init_from: str | None = None
    """A pretrain artifact (or converted HF checkpoint) to continue from; None = from scratch."""
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of each batch drawn from the init model's own training data."""


class CronSection(_Section):
    """When the scheduled continued-pretraining deployment of this pipeline runs (scripts/serve.py, prefect.yaml)."""

    cron: str
    """A cron expression, e.g. "0 3 * * 1" (Mondays 03:00)."""
    timezone: str = "UTC"


class ContinuedSection(_Section):
    """Continued pretraining on new-domain corpora, starting from this pipeline's pretrained model.

    The full pipeline runs it after `pretrain` when `sources` is set; the scheduled
    continued-pretraining flow runs it on every new corpus dropped into `inbox`.
    The base model's tokenizer is kept; `train` is pretrain.train with what is set here on top.
    """

    sources: list[str] = Field(default_factory=list)
    """New-domain corpora (files, directories, globs); empty = no continued pretraining in full-pipeline."""
    inbox: str | None = None
    """Directory the scheduled flow scans for new corpora (each consumed once, by sha256); default
    <artifacts>/inbox/<pipeline>/."""
    schedule: CronSection | None = None
    """Give this pipeline a `continued-pretraining/scheduled-<pipeline>` deployment on this schedule."""
    train: TrainSection = Field(default_factory=TrainSection)
    """pretrain.train, overridden by what this pipeline sets under continued.train (resolved at load)."""
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of each batch replayed from the base model's own training data (limits forgetting)."""


class ParallelSection(_Section):
    data_parallel: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    optimizer_shard: bool = False
    device_num: int = Field(1, ge=1)
    device_target: Literal["CPU", "GPU", "Ascend"] = "CPU"
    master_addr: str = "127.0.0.1"
    master_port: int = Field(8118, ge=1024, le=65535)
    node_num: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    cluster_timeout: int = Field(300, gt=0)
    """Seconds msrun's workers wait for the whole cluster to join before giving up."""


LAYOUT_KEYS = ("data_parallel", "tensor_parallel", "optimizer_shard", "device_target")
"""The parallel settings that change what training computes (cache keys); where and how ranks
connect (master_addr/port, node_rank, cluster_timeout) does not."""


class PlanSection(_Section):
    """Layouts `msllm plan` estimates but training does not build (pipeline stages: Ascend/GPU only)."""

    pipeline_parallel: int = Field(1, ge=1)
    """Pipeline stages of the configured layout that `msllm plan` estimates (devices = dp × tp × pp)."""
    micro_batch_num: int = Field(1, ge=1)
    """Micro-batches in flight per pipeline (at least pipeline_parallel)."""


class CheckpointSection(_Section):
    save_steps: int = Field(100, gt=0)
    keep_checkpoint_max: int = Field(3, ge=1)
    load_checkpoint: str | None = None
    """A checkpoint file or directory to load weights from."""
    resume: bool = True
    """Continue from the newest complete checkpoint of this run, when one exists."""


class LoraSection(_Section):
    rank: int = Field(8, gt=0)
    alpha: float = Field(16.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    target_modules: list[str] | str = Field(default_factory=lambda: ["q_proj", "v_proj"])
    """Projection names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj) or a regex."""


class FinetuneSection(_Section):
    method: Literal["lora", "full"] = "lora"
    lora: LoraSection = Field(default_factory=LoraSection)
    sources: list[str] = Field(default_factory=list)
    format: Literal["text", "instruction"] = "instruction"
    train: TrainSection = Field(default_factory=TrainSection)
    """Resolved at load: FINETUNE_DEFAULTS, then FINETUNE_INHERITS from pretrain.train, then what is set here."""
    seq_length: int | None = Field(None, gt=0)
    """Tokens per example (longer ones are truncated, shorter padded); defaults to the base model's
    training seq_length and must not exceed its max_seq_length."""
    validation_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of the examples (instruction) or blocks (text) held out for the validation loss."""
    seed: int = 42
    """Seeds the LoRA init, the train/validation split and the per-epoch shuffle."""


class EvalSection(_Section):
    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, gt=0)
    """At most this many examples per task."""
    batch_size: int = Field(8, gt=0)
    """Rows per scoring call; fewer where they would pass 1 GiB of activations. A value no call can hold (more rows
    than fit even of one token: ModelConfig.scoring_rows) is a validation error naming the cap."""
    heldout_blocks: int | None = Field(None, gt=0)
    """At most this many held-out blocks (the first, in shard order) for the held-out perplexity; all when unset."""
    perplexity_files: list[str] = Field(default_factory=list)
    prompts: list[str] = Field(default_factory=list)
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(0.0, ge=0)
    top_k: int | None = Field(None, gt=0)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int = 0
    stop: list[str] = Field(default_factory=list)
    """Stop strings for the sample generations and `msllm predict` (the text is cut before the first one; EOS always
    stops)."""
    weights: Literal["fp32", "fp16", "q8_0"] = "fp32"
    """How the eval scores and decodes read the weight matrices (model/fused_decode.py WEIGHT_FORMATS): fp32, the
    model's own; fp16 (IEEE binary16, GGUF's F16) or q8_0 (GGUF's Q8_0 blocks) score every sequence through the fused
    steps on those weights (`Generator.score`) and decode on them, so the perplexity and task scores are the ones
    `msllm serve --weights` serves. Part of the eval cache key; results.json and the manifest say which ran (a model
    the fused steps cannot take stays fp32, and the reason is logged)."""
    fused_kernels: bool = True
    """Decode (eval samples, lm-eval generation, `msllm predict`) with the fused decode kernel
    (model/decode_kernel.cc) where model.kernels.enabled(..., kind="decode") allows; false keeps MindSpore's
    kernels (the same tokens, slower). Not part of the eval cache key."""


class ExportSection(_Section):
    formats: list[Literal["mindir", "onnx", "gguf"]] = Field(default_factory=lambda: ["mindir", "onnx"])
    """mindir (MindSpore Lite), onnx (a KV-cache decoder for onnxruntime / onnxruntime-genai), gguf (llama.cpp,
    Ollama, LM Studio and other llama.cpp-family runtimes; types in gguf_types)."""
    gguf_types: list[Literal["F16", "Q8_0"]] = Field(default_factory=lambda: ["F16", "Q8_0"], min_length=1)
    """GGUF files to write with `gguf` in formats: F16 (model.f16.gguf) and/or Q8_0 (model.q8_0.gguf), each read
    back: its weights must equal the type's rounding bit for bit and its logits stay within a bound derived from
    that rounding (tasks/deploy/gguf_export.py)."""
    batch_size: int = Field(1, gt=0)
    seq_length: int = Field(32, gt=0)
    atol: float = Field(1e-4, gt=0)
    prompts: list[str] = Field(default_factory=lambda: ["ROMEO:", "To be, or not", "The king"], min_length=1)
    """Fixed prompts of the export check: logits of MindSpore vs the reloaded MindIR and onnxruntime, and greedy
    tokens."""
    max_new_tokens: int = Field(8, gt=0)
    """Greedy tokens per prompt that onnxruntime must reproduce (at most seq_length minus the prompt's length)."""
    int8: bool = False
    """Also write model.int8.onnx (onnxruntime dynamic quantization, int8 weights); its size, decode speed and
    held-out perplexity change go in the manifest. fp32 model.onnx stays the default."""


class PipelineConfig(_Section):
    """One named pipeline, fully resolved (after `base:` and `--set`)."""

    description: str = ""
    model: ModelSection = Field(default_factory=ModelSection)
    data: DataSection = Field(default_factory=DataSection)
    pretrain: PretrainSection = Field(default_factory=PretrainSection)
    continued: ContinuedSection = Field(default_factory=ContinuedSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    plan: PlanSection = Field(default_factory=PlanSection)
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    export: ExportSection = Field(default_factory=ExportSection)

    # set by resolve_pipeline; not YAML keys
    name: str = ""
    base_dir: str = "."
    notes: list[str] = Field(default_factory=list)
    """What resolving chose that the user should see (e.g. which training budget a `--set` replaced)."""

    @model_validator(mode="after")
    def _one_value_per_setting(self) -> PipelineConfig:
        """Defaults that come from another section are filled here, once, so every reader sees one value:
        pretrain.seq_length from data.seq_length, each train.loop.save_steps from checkpoint.save_steps."""
        if self.pretrain.seq_length is None:
            self.pretrain.seq_length = self.data.seq_length
        for train in (self.pretrain.train, self.continued.train, self.finetune.train):
            if train.loop.save_steps is None:
                train.loop.save_steps = self.checkpoint.save_steps
        return self

    def section(self, name: str) -> dict[str, Any]:
        """A section as plain data (what a stage's cache key hashes)."""
        return getattr(self, name).model_dump(mode="json")

    def layout_section(self) -> dict[str, Any]:
        """The `parallel` keys that change what training computes (LAYOUT_KEYS), for cache keys."""
        par = self.section("parallel")
        return {k: par[k] for k in LAYOUT_KEYS}

    def for_continued(self, sources: list[str]) -> PipelineConfig:
        """The config of a continued-pretraining run on `sources` (base tokenizer kept by the caller):
        pretrain with continued.train (already pretrain.train with continued's settings on top)."""
        c = self.model_copy(deep=True)
        c.data.sources = list(sources)
        c.pretrain.train = self.continued.train.model_copy(deep=True)
        c.pretrain.replay_ratio = self.continued.replay_ratio
        return c

    def resolve_path(self, p: str) -> Path:
        """A path from the YAML, relative to the pipelines file's directory."""
        q = Path(os.path.expanduser(p))
        return q if q.is_absolute() else Path(self.base_dir) / q


_YAML_KEYS_EXCLUDED = {"name", "base_dir", "notes"}
