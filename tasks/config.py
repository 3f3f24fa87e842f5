"""The `pipelines.yaml` schema: one pydantic model per section, validated before any compute.

Importable without MindSpore, so the CLI and the flows validate a pipeline in
milliseconds. Use:

    pipes = load_pipelines("pipelines.yaml")            # PipelinesFile
    cfg = resolve_pipeline("pipelines.yaml", "demo", overrides=["pretrain.max_steps=10"])
    cfg.pretrain.max_steps  -> 10

Every error names its YAML path (`pipelines.demo.parallel.tensor_parallel`)
and what would fix it; all errors of a file are reported together
(`ConfigError.errors`).
"""

from __future__ import annotations

import copy
import difflib
import glob
import os
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from model.config import PRESETS, ModelConfig
from model.registry import BUILTIN_MODELS

# ----------------------------------------------------------------------------- errors


class ConfigError(ValueError):
    """One or more problems in a pipelines file; `errors` lists them, each naming its YAML path."""

    def __init__(self, errors: list[str]):
        self.errors = list(errors)
        super().__init__("\n".join(self.errors))


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
    name: Literal["adamw"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(3e-5, ge=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.1, ge=0)
    decay_norms_and_biases: bool = False
    decay_embeddings: bool = False


class ScheduleSection(_Section):
    warmup_steps: int = Field(10, ge=0)
    decay: Literal["cosine", "linear", "constant"] = "cosine"


class PretrainSection(_Section):
    micro_batch_size: int = Field(8, gt=0)
    gradient_accumulation: int = Field(1, gt=0)
    seq_length: int | None = Field(None, gt=0)
    """Defaults to data.seq_length; must not exceed it."""
    max_steps: int | None = Field(None, gt=0)
    max_tokens: int | None = Field(None, gt=0)
    """Alternative to max_steps: stop after this many training tokens."""
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)
    grad_clip: float | None = Field(1.0, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    loss_scale: float = Field(65536.0, gt=0)
    """Initial dynamic loss scale (fp16 only): halved on every overflowed (skipped) step."""
    loss_scale_window: int = Field(1000, gt=0)
    """fp16 only: the loss scale doubles after this many consecutive finite steps."""
    recompute: bool = False
    fused_kernels: bool = True
    """fp32 training (pretrain and finetune): the causal softmax, SwiGLU and RMSNorm, forward and backward, as fused
    custom ops (model/train_kernels.cc, built with g++ on first use). Without a compiler MindSpore's own ops
    run: the same math to ~1e-6, slower. false always uses MindSpore's own ops."""
    seed: int = 42
    log_steps: int = Field(10, gt=0)
    eval_steps: int = Field(50, gt=0)
    eval_batches: int = Field(8, gt=0)
    max_nonfinite_steps: int = Field(5, gt=0)
    """Consecutive NaN/Inf steps (each skipped) before the run stops."""
    peak_flops: float | None = Field(None, gt=0)
    """Device peak FLOP/s for MFU; measured with a matmul when omitted."""
    init_from: str | None = None
    """A pretrain artifact (or converted HF checkpoint) to continue from; None = from scratch."""
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of each batch drawn from the init model's own training data."""


class ScheduleSection(_Section):
    """When the scheduled continued-pretraining deployment of this pipeline runs (scripts/serve.py, prefect.yaml)."""

    cron: str
    """A cron expression, e.g. "0 3 * * 1" (Mondays 03:00)."""
    timezone: str = "UTC"


class ContinuedSection(_Section):
    """Continued pretraining on new-domain corpora, starting from this pipeline's pretrained model.

    The full pipeline runs it after `pretrain` when `sources` is set; the scheduled
    continued-pretraining flow runs it on every new corpus dropped into `inbox`.
    The base model's tokenizer is kept; other pretrain settings are inherited.
    """

    sources: list[str] = Field(default_factory=list)
    """New-domain corpora (files, directories, globs); empty = no continued pretraining in full-pipeline."""
    inbox: str | None = None
    """Directory the scheduled flow scans for new corpora (each consumed once, by sha256); default
    <artifacts>/inbox/<pipeline>/."""
    schedule: ScheduleSection | None = None
    """Give this pipeline a `continued-pretraining/scheduled-<pipeline>` deployment on this schedule."""
    max_steps: int = Field(100, gt=0)
    lr: float | None = Field(None, gt=0)
    """Peak learning rate (default: pretrain.optimizer.lr)."""
    warmup_steps: int = Field(10, ge=0)
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Share of each batch replayed from the base model's own training data (limits forgetting)."""


class ParallelSection(_Section):
    data_parallel: int = Field(1, ge=1)
    tensor_parallel: int = Field(1, ge=1)
    pipeline_parallel: int = Field(1, ge=1)
    micro_batch_num: int = Field(1, ge=1)
    optimizer_shard: bool = False
    device_num: int = Field(1, ge=1)
    device_target: Literal["CPU", "GPU", "Ascend"] = "CPU"
    master_addr: str = "127.0.0.1"
    master_port: int = Field(8118, ge=1024, le=65535)
    node_num: int = Field(1, ge=1)
    node_rank: int = Field(0, ge=0)
    cluster_timeout: int = Field(300, gt=0)
    """Seconds msrun's workers wait for the whole cluster to join before giving up."""


LAYOUT_KEYS = ("data_parallel", "tensor_parallel", "pipeline_parallel", "micro_batch_num", "optimizer_shard",
               "device_target")
"""The parallel settings that change what training computes (cache keys); where and how ranks
connect (master_addr/port, node_rank, cluster_timeout) does not."""


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
    max_steps: int = Field(50, gt=0)
    micro_batch_size: int = Field(8, gt=0)
    lr: float = Field(1e-3, gt=0)
    min_lr: float | None = Field(None, ge=0)
    """Learning rate at the end of the decay; defaults to lr / 10."""
    warmup_steps: int = Field(5, ge=0)
    """Linear warmup steps (must not exceed max_steps)."""
    decay: Literal["cosine", "linear", "constant"] = "cosine"
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay of the trained parameters (0 is usual for LoRA)."""
    seq_length: int | None = Field(None, gt=0)
    """Tokens per example (longer ones are truncated, shorter padded); defaults to the base model's
    training seq_length and must not exceed its max_seq_length."""
    validation_fraction: float = Field(0.05, ge=0, lt=1)
    """Share of the examples (instruction) or blocks (text) held out for the validation loss."""
    seed: int = 42
    """Seeds the LoRA init, the train/validation split and the per-epoch shuffle."""
    log_steps: int = Field(10, gt=0)
    eval_steps: int = Field(50, gt=0)
    """Validation loss (response tokens only for instruction data) every this many steps, and at the end."""
    eval_batches: int = Field(4, gt=0)
    save_steps: int = Field(50, gt=0)
    """Checkpoint (trained parameters + optimizer) every this many steps; a rerun resumes from the newest."""


class EvalSection(_Section):
    tasks: list[str] = Field(default_factory=list)
    limit: int | None = Field(None, gt=0)
    """At most this many examples per task."""
    batch_size: int = Field(8, gt=0)
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
    """Stop strings for the sample generations and `msllm predict` (the text is cut before the first one; EOS always stops)."""


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
    """Fixed prompts of the export check: logits of MindSpore vs the reloaded MindIR and onnxruntime, and greedy tokens."""
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
    finetune: FinetuneSection = Field(default_factory=FinetuneSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    export: ExportSection = Field(default_factory=ExportSection)

    # set by resolve_pipeline; not YAML keys
    name: str = ""
    base_dir: str = "."
    notes: list[str] = Field(default_factory=list)
    """What resolving chose that the user should see (e.g. which training budget a `--set` replaced)."""

    def section(self, name: str) -> dict[str, Any]:
        """A section as plain data (what a stage's cache key hashes)."""
        return getattr(self, name).model_dump(mode="json")

    def layout_section(self) -> dict[str, Any]:
        """The `parallel` keys that change what training computes (LAYOUT_KEYS), for cache keys."""
        par = self.section("parallel")
        return {k: par[k] for k in LAYOUT_KEYS}

    def for_continued(self, sources: list[str]) -> "PipelineConfig":
        """The config of a continued-pretraining run on `sources` (base tokenizer kept by the caller)."""
        c = self.model_copy(deep=True)
        c.data.sources = list(sources)
        cont = self.continued
        c.pretrain.max_steps, c.pretrain.max_tokens = cont.max_steps, None
        c.pretrain.schedule.warmup_steps = cont.warmup_steps
        c.pretrain.eval_steps = min(c.pretrain.eval_steps, cont.max_steps)
        if cont.lr is not None:
            c.pretrain.optimizer.lr = cont.lr
            c.pretrain.optimizer.min_lr = min(c.pretrain.optimizer.min_lr, cont.lr)
        c.pretrain.replay_ratio = cont.replay_ratio
        return c

    def resolve_path(self, p: str) -> Path:
        """A path from the YAML, relative to the pipelines file's directory."""
        q = Path(os.path.expanduser(p))
        return q if q.is_absolute() else Path(self.base_dir) / q


_YAML_KEYS_EXCLUDED = {"name", "base_dir", "notes"}


# ----------------------------------------------------------------------------- loading


def _suggest(key: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"did you mean '{near[0]}'? " if near else ""
    return f"{hint}valid keys: {', '.join(sorted(valid))}"


def _model_at(loc: tuple, root: type[BaseModel] = PipelineConfig) -> type[BaseModel] | None:
    m: Any = root
    for part in loc:
        if not (isinstance(m, type) and issubclass(m, BaseModel)) or part not in m.model_fields:
            return None
        ann = m.model_fields[part].annotation
        m = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    return m


def _format_pydantic(prefix: str, exc: ValidationError) -> list[str]:
    out = []
    for e in exc.errors():
        loc = tuple(str(x) for x in e["loc"])
        path = ".".join([prefix, *loc])
        if e["type"] == "extra_forbidden":
            parent = _model_at(tuple(e["loc"][:-1]))
            valid = [k for k in (parent.model_fields if parent else []) if k not in _YAML_KEYS_EXCLUDED]
            out.append(f"{path}: unknown key '{loc[-1]}'; {_suggest(loc[-1], valid)}")
        elif e["type"] == "finite_number":
            out.append(f"{path}: {e['input']!r} is not a finite number; use a finite value (no .inf / .nan)")
        elif e["type"] == "literal_error":
            out.append(f"{path}: {e['input']!r} is not allowed; {e['msg'].lower()}")
        elif e["type"] in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
            out.append(f"{path}: {e['input']!r} is out of range; value must be {e['msg'].split('be ', 1)[-1]}")
        else:
            out.append(f"{path}: {e['msg']} (got {e['input']!r}); fix the type of this value{_yaml11_hint(e['input'])}")
    return out


_SEXAGESIMAL = re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$")
_YAML11_BOOLS = {"yes", "no", "on", "off", "y", "n"}


def _yaml11_hint(value: Any) -> str:
    """Why a value YAML 1.1 would have read as a number or a boolean is text here (see `Loader`)."""
    if not isinstance(value, str):
        return ""
    if _SEXAGESIMAL.match(value):
        return (f" ('{value}' is text: pipelines files are read as YAML 1.2, which has no base-60 numbers; "
                "write the number itself)")
    if value.lower() in _YAML11_BOOLS:
        return f" ('{value}' is text: pipelines files are read as YAML 1.2, where booleans are true and false)"
    return ""


def _deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


class DuplicateKeyError(yaml.YAMLError):
    def __init__(self, key: Any, line: int, first: int):
        self.key, self.line, self.first = key, line, first
        super().__init__(f"duplicate key '{key}' (first at line {first})")


class Loader(yaml.SafeLoader):
    """yaml.SafeLoader with the YAML 1.2 core schema's scalars (pipelines files and `--set` values):

    - Numbers as YAML 1.2 reads them. PyYAML follows YAML 1.1, where `1:20` is the base-60 integer 80,
      `010` is octal 8, a float needs a dot and a signed exponent (`1.0e+6`, so `1e-3` is a string) and
      `2024-01-01` is a date. Here `1e-3`, `1.0e6`, `2E5` are floats, `10` and `010` are ten, `0x10` and
      `0o17` are hex and octal, and `1:20`, `0b101` and dates stay strings (so `max_steps: 1:20` fails
      validation instead of running 80 steps). `_` between digits is still allowed (`1_000`).
    - Booleans are only `true`/`false` (any case style of YAML 1.2): `yes`, `no`, `on`, `off`, `y`, `n`
      are strings, so a value such as `normalize: no` or a name `on` is never turned into a boolean.
    - Null is `~`, `null` or empty, as before; merge keys (`<<: *anchor`) work as before.
    - A key repeated in one mapping is an error naming the key and both lines (PyYAML keeps the
      last value silently). Keys brought in by a merge (`<<: *anchor`) may be overridden as usual.
    """

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node)
                except TypeError:  # an unhashable key: the base class names it
                    continue
                if seen is not key_node:
                    raise DuplicateKeyError(key, key_node.start_mark.line + 1, seen.start_mark.line + 1)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        """YAML 1.2 integers: decimal (a leading 0 is still decimal), 0x hex, 0o octal; no base 60."""
        text = str(self.construct_scalar(node)).replace("_", "")
        sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
        if digits[:2] in ("0x", "0X"):
            return sign * int(digits[2:], 16)
        if digits[:2] in ("0o", "0O"):
            return sign * int(digits[2:], 8)
        return sign * int(digits, 10)


Loader.add_constructor("tag:yaml.org,2002:int", Loader.construct_yaml_int)

# The implicit resolvers of the YAML 1.2 core schema (https://yaml.org/spec/1.2.2/#1032-tag-resolution), plus
# `_` digit separators and the merge key; SafeLoader's YAML 1.1 ones (base 60, yes/no/on/off, timestamps, `=`)
# are dropped. A fresh dict, so yaml.SafeLoader itself is untouched.
_KEEP = {"tag:yaml.org,2002:null", "tag:yaml.org,2002:merge"}
Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag in _KEEP]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                             list("tTfF"))
Loader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(r"""^(?:
      [-+]?[0-9][0-9_]*
    | [-+]?0[xX][0-9a-fA-F][0-9a-fA-F_]*
    | [-+]?0[oO][0-7][0-7_]*)$""", re.X), list("-+0123456789"))
Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
      [-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    | [-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    | [-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    | [-+]?\.(?:inf|Inf|INF)
    | \.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def load_yaml(text: str) -> Any:
    """Parse YAML with `Loader` (safe: plain data only)."""
    return yaml.load(text, Loader=Loader)  # noqa: S506  (Loader is a yaml.SafeLoader)


def read_pipelines_file(path: str | os.PathLike) -> dict[str, Any]:
    """The raw YAML of a pipelines file: {'default': name, 'pipelines': {...}}."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"{p}: pipelines file not found; pass --config PATH or create pipelines.yaml"])
    data = p.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{p}: not a text file (invalid UTF-8 at byte {exc.start}); --config must name a "
                           "YAML pipelines file such as pipelines.yaml"]) from None
    try:
        raw = load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError([f"{p}:{exc.line}: duplicate key '{exc.key}' (first at line {exc.first}); keep one of them"]) from None
    except yaml.YAMLError as exc:
        hint = "; --config must name a YAML pipelines file such as pipelines.yaml" if "\x00" in text else ""
        raise ConfigError([f"{p}: not valid YAML: {exc}{hint}"]) from None
    if not isinstance(raw, dict) or not isinstance(raw.get("pipelines"), dict) or not raw["pipelines"]:
        raise ConfigError([f"{p}: expected a mapping with a non-empty 'pipelines:' mapping of named pipelines"])
    unknown = set(raw) - {"default", "pipelines"}
    if unknown:
        k = sorted(unknown)[0]
        raise ConfigError([f"{k}: unknown top-level key '{k}'; {_suggest(k, ['default', 'pipelines'])}"])
    return raw


def _raw_pipeline(raw: dict, name: str, seen: tuple[str, ...] = ()) -> dict:
    pipes = raw["pipelines"]
    if name not in pipes:
        near = difflib.get_close_matches(name, list(pipes), n=1)
        hint = f" did you mean '{near[0]}'?" if near else ""
        where = f"pipelines.{seen[-1]}.base" if seen else "--pipeline"
        raise ConfigError([f"{where}: no pipeline named '{name}';{hint} defined: {', '.join(sorted(pipes))}"])
    if name in seen:
        raise ConfigError([f"pipelines.{name}.base: circular 'base:' chain {' -> '.join([*seen, name])}; remove one link"])
    body = pipes[name]
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise ConfigError([f"pipelines.{name}: expected a mapping of sections, got {type(body).__name__}"])
    body = dict(body)
    base = body.pop("base", None)
    if base is None:
        return body
    if not isinstance(base, str):
        raise ConfigError([f"pipelines.{name}.base: must be the name of another pipeline, got {base!r}"])
    inherited = _raw_pipeline(raw, base, (*seen, name))
    _replace_budget(inherited, body.get("pretrain"))
    return _deep_merge(inherited, body)


BUDGET_KEYS = ("max_steps", "max_tokens")
"""pretrain's two ways to say how long to train; exactly one is set."""


def _replace_budget(below: dict, above: Any) -> str | None:
    """A layer (`above`: a pipeline's own pretrain section over its base's, or the `--set` values over the
    pipeline) that sets one budget key replaces the other key of the layer below: the run uses the one
    the user named last. Returns the key it cleared, or None. Both keys in one layer stay (an error)."""
    if not isinstance(above, dict) or not isinstance(below.get("pretrain"), dict):
        return None
    named = [k for k in BUDGET_KEYS if above.get(k) is not None]
    if len(named) != 1:
        return None
    other = BUDGET_KEYS[1 - BUDGET_KEYS.index(named[0])]
    if below["pretrain"].get(other) is None or other in above:
        return None
    below["pretrain"] = {k: v for k, v in below["pretrain"].items() if k != other}
    return other


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=VALUE` -> (['a','b','c'], yaml-parsed VALUE)."""
    if "=" not in item:
        raise ConfigError([f"--set {item}: expected dotted.key=VALUE, e.g. --set pretrain.max_steps=100"])
    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError([f"--set {item}: empty key; expected dotted.key=VALUE"])
    try:
        parsed = load_yaml(value) if value.strip() else None
    except DuplicateKeyError as exc:
        raise ConfigError([f"--set {item}: duplicate key '{exc.key}' in VALUE; keep one of them"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([f"--set {item}: VALUE is not valid YAML ({exc})"]) from None
    return parts, parsed


def apply_overrides(body: dict, overrides: list[str] | None) -> dict:
    body = copy.deepcopy(body)
    for item in overrides or []:
        parts, value = parse_override(item)
        node = body
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError([f"--set {item}: '{p}' is a value, not a section"])
            node = nxt
        node[parts[-1]] = value
    return body


def default_pipeline_name(raw: dict, path: str | os.PathLike = "pipelines.yaml") -> str:
    name = raw.get("default")
    if name is None:
        return "demo" if "demo" in raw["pipelines"] else sorted(raw["pipelines"])[0]
    if name not in raw["pipelines"]:
        raise ConfigError([f"default: '{name}' is not a pipeline in {path}; defined: {', '.join(sorted(raw['pipelines']))}"])
    return name


def resolve_pipeline(
    path: str | os.PathLike = "pipelines.yaml",
    name: str | None = None,
    overrides: list[str] | None = None,
    check_files: bool = True,
) -> PipelineConfig:
    """Load, inherit (`base:`), override (`--set`) and validate one pipeline. Raises ConfigError."""
    raw = read_pipelines_file(path)
    name = name or default_pipeline_name(raw, path)
    body = _raw_pipeline(raw, name)
    set_pretrain = apply_overrides({}, overrides).get("pretrain")
    cleared = _replace_budget(body, set_pretrain)
    body = apply_overrides(body, overrides)
    prefix = f"pipelines.{name}"
    notes = []
    if cleared:
        used = next(k for k in BUDGET_KEYS if k != cleared)
        notes.append(f"--set pretrain.{used}={set_pretrain[used]} replaces {prefix}.pretrain.{cleared} of {path}: "
                     f"training stops after {set_pretrain[used]} {'steps' if used == 'max_steps' else 'tokens'}")
    bad_top = [k for k in body if k in _YAML_KEYS_EXCLUDED]
    if bad_top:
        raise ConfigError([f"{prefix}.{bad_top[0]}: '{bad_top[0]}' is set by the loader, not in YAML; remove it"])
    try:
        cfg = PipelineConfig.model_validate(body)
    except ValidationError as exc:
        raise ConfigError(_format_pydantic(prefix, exc)) from None
    cfg.name = name
    cfg.base_dir = str(Path(path).resolve().parent)
    cfg.notes = notes
    errors = check_pipeline(cfg, prefix, check_files=check_files)
    if errors:
        raise ConfigError(errors)
    return cfg


# ----------------------------------------------------------------------------- cross-field rules


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
    for rule in (_layout_rules, _length_rules, _tokenizer_rules, _schedule_rules, _lora_rules):
        errs += rule(cfg, prefix, mc)
    if check_files:
        errs += _file_rules(cfg, prefix)
    return errs


def _model_rules(cfg: PipelineConfig, prefix: str) -> tuple[list[str], ModelConfig | None]:
    """The model name and preset resolve to a ModelConfig (the other rules need it)."""
    errs: list[str] = []
    if cfg.model.name not in BUILTIN_MODELS:
        errs.append(f"{prefix}.model.name: unknown model '{cfg.model.name}'; "
                    f"{_suggest(cfg.model.name, sorted(BUILTIN_MODELS)).replace('valid keys', 'registered models')}")
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
            f"{prefix}.model.num_kv_heads: num_heads={mc.num_heads} is not divisible by num_kv_heads={mc.num_kv_heads}; "
            "choose num_kv_heads that divides num_heads"
        )
    if mc.num_heads % par.tensor_parallel or mc.num_kv_heads % par.tensor_parallel:
        errs.append(
            f"{prefix}.parallel.tensor_parallel: {par.tensor_parallel} must divide num_heads={mc.num_heads} "
            f"and num_kv_heads={mc.num_kv_heads}; pick a divisor of {mc.num_kv_heads}"
        )
    elif mc.intermediate_size % par.tensor_parallel:
        errs.append(
            f"{prefix}.parallel.tensor_parallel: {par.tensor_parallel} must divide intermediate_size={mc.intermediate_size}"
        )
    prod = par.data_parallel * par.tensor_parallel * par.pipeline_parallel
    if prod != par.device_num:
        errs.append(
            f"{prefix}.parallel.device_num: data_parallel×tensor_parallel×pipeline_parallel = "
            f"{par.data_parallel}×{par.tensor_parallel}×{par.pipeline_parallel} = {prod} but device_num = {par.device_num}; "
            f"set device_num: {prod} or change the layout"
        )
    if par.micro_batch_num < par.pipeline_parallel:
        errs.append(
            f"{prefix}.parallel.micro_batch_num: {par.micro_batch_num} < pipeline_parallel={par.pipeline_parallel}; "
            f"set micro_batch_num >= {par.pipeline_parallel} so every stage has work"
        )
    if par.pipeline_parallel > mc.num_layers:
        errs.append(
            f"{prefix}.parallel.pipeline_parallel: {par.pipeline_parallel} stages for {mc.num_layers} layers; "
            f"use at most {mc.num_layers}"
        )
    if par.node_rank >= par.node_num:
        errs.append(f"{prefix}.parallel.node_rank: {par.node_rank} must be < node_num={par.node_num}")
    if par.device_num % par.node_num:
        errs.append(f"{prefix}.parallel.node_num: device_num={par.device_num} does not split evenly over "
                    f"node_num={par.node_num} nodes; make device_num a multiple of node_num")
    if par.pipeline_parallel > 1:
        where = ("MindSpore runs pipeline stages only on Ascend/GPU (semi_auto_parallel)" if par.device_target == "CPU"
                 else "this pipeline does not build pipeline stages yet (untested on Ascend/GPU)")
        errs.append(f"{prefix}.parallel.pipeline_parallel: {par.pipeline_parallel} > 1 is not supported: {where}; "
                    "use data_parallel / tensor_parallel (`msllm plan` still estimates pp layouts)")
    if par.optimizer_shard and par.data_parallel > 1 and par.tensor_parallel > 1:
        errs.append(f"{prefix}.parallel.optimizer_shard: optimizer sharding (ZeRO-1) is built for data parallel "
                    f"only, not with tensor_parallel={par.tensor_parallel}; set tensor_parallel: 1 or "
                    "optimizer_shard: false")
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


def _schedule_rules(cfg: PipelineConfig, prefix: str, mc: ModelConfig) -> list[str]:
    """Training budget, warmup, learning rates and precision."""
    errs: list[str] = []
    par = cfg.parallel
    pt = cfg.pretrain
    if pt.max_steps is None and pt.max_tokens is None:
        errs.append(f"{prefix}.pretrain.max_steps: set max_steps or max_tokens")
    if pt.max_steps is not None and pt.max_tokens is not None:
        errs.append(f"{prefix}.pretrain.max_tokens: both pretrain.max_steps ({pt.max_steps}) and pretrain.max_tokens "
                    f"({pt.max_tokens}) are set; keep one of them (max_steps counts optimizer steps, max_tokens "
                    "training tokens)")
    if pt.max_steps is not None and pt.schedule.warmup_steps > pt.max_steps:
        errs.append(
            f"{prefix}.pretrain.schedule.warmup_steps: {pt.schedule.warmup_steps} > max_steps={pt.max_steps}; "
            "warmup must fit in the run"
        )
    if pt.optimizer.min_lr > pt.optimizer.lr:
        errs.append(f"{prefix}.pretrain.optimizer.min_lr: {pt.optimizer.min_lr} > lr={pt.optimizer.lr}; min_lr must be <= lr")
    if pt.precision == "bf16" and par.device_target == "CPU":
        errs.append(
            f"{prefix}.pretrain.precision: bf16 has no MindSpore CPU kernels for training "
            "(MatMul/Softmax reject bf16); use fp32 on CPU (fp16 also works on CPU, at about half the fp32 speed) "
            "or set parallel.device_target"
        )
    if cfg.continued.warmup_steps > cfg.continued.max_steps:
        errs.append(f"{prefix}.continued.warmup_steps: {cfg.continued.warmup_steps} > max_steps={cfg.continued.max_steps}")
    if pt.replay_ratio > 0 and not pt.init_from:
        errs.append(f"{prefix}.pretrain.replay_ratio: replay needs pretrain.init_from (the model whose data is replayed)")
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
        errs.append(f"{prefix}.data.validation_fraction: 0 leaves no held-out split; set a fraction > 0 or validation_documents")
    return errs


def _file_rules(cfg: PipelineConfig, prefix: str) -> list[str]:
    """Every path the pipeline reads exists (skipped with check_files=False)."""
    errs: list[str] = []
    if not cfg.data.sources:
        errs.append(f"{prefix}.data.sources: empty; list at least one corpus file, directory or glob")
    for i, src in enumerate(cfg.data.sources):
        if not src.startswith("hf:") and not expand_source(cfg, src):
            errs.append(f"{prefix}.data.sources[{i}]: '{src}' matches no file (looked in {cfg.resolve_path(src)}); fix the path")
    for key, val in (
        ("data.tokenizer.path", cfg.data.tokenizer.path),
        ("checkpoint.load_checkpoint", cfg.checkpoint.load_checkpoint),
        ("pretrain.init_from", cfg.pretrain.init_from),
    ):
        if val and not cfg.resolve_path(val).exists():
            fix = ("fetch the model first (bash scripts/fetch_smollm2.sh fetches SmolLM2 for the smollm2 pipeline) or "
                   "fix the path" if str(val).endswith(".gguf") else "fix the path")
            errs.append(f"{prefix}.{key}: '{val}' does not exist (looked in {cfg.resolve_path(val)}); {fix}")
    for i, src in enumerate(cfg.continued.sources):
        if not expand_source(cfg, src):
            errs.append(f"{prefix}.continued.sources[{i}]: '{src}' matches no file (looked in {cfg.resolve_path(src)}); fix the path")
    for i, src in enumerate(cfg.finetune.sources):
        if not expand_source(cfg, src):
            errs.append(f"{prefix}.finetune.sources[{i}]: '{src}' matches no file; fix the path")
    for i, src in enumerate(cfg.eval.perplexity_files):
        if not cfg.resolve_path(src).is_file():
            errs.append(f"{prefix}.eval.perplexity_files[{i}]: '{src}' is not a file; fix the path")
    return errs


def validate_file(path: str | os.PathLike = "pipelines.yaml") -> dict[str, list[str]]:
    """Validate every pipeline of a file; {name: [errors]} (empty lists when fine)."""
    raw = read_pipelines_file(path)
    out = {}
    for name in raw["pipelines"]:
        try:
            resolve_pipeline(path, name)
            out[name] = []
        except ConfigError as exc:
            out[name] = exc.errors
    return out


def to_yaml(cfg: PipelineConfig) -> str:
    data = cfg.model_dump(mode="json", exclude=_YAML_KEYS_EXCLUDED)
    return yaml.safe_dump({cfg.name: data}, sort_keys=False)
