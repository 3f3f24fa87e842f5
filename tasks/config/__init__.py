"""The `pipelines.yaml` schema, validated before any compute: the public entry (`tasks.config`).

Importable without MindSpore, so the CLI and the flows validate a pipeline in milliseconds:

    cfg = resolve_pipeline("pipelines.yaml", "demo", overrides=["pretrain.train.loop.max_steps=10"])
    cfg.pretrain.train.loop.max_steps  -> 10

Rooms: `schema` (one pydantic model per section, a docstring per field), `yaml12` (YAML 1.2 scalars),
`loader` (the file, `base:`, `--set`, the `train` inheritance, old-key migration errors), `rules` (the
cross-key rules). Every error names its YAML path and a fix; all errors are reported together.
"""

from tasks.config.loader import (BUDGET_KEYS, FINETUNE_DEFAULTS, FINETUNE_INHERITS, MOVED, apply_overrides,
                                 default_pipeline_name, inherit_train, parse_override, read_pipelines_file,
                                 resolve_pipeline, to_yaml, validate_file)
from tasks.config.rules import expand_source, check_pipeline, train_errors
from tasks.config.schema import (LAYOUT_KEYS, CheckpointSection, CleanSection, ConfigError, ContinuedSection,
                                 DataSection, EvalSection, ExportSection, FinetuneSection, LoopSection, LoraSection,
                                 ModelSection, OptimizerSection, ParallelSection, PipelineConfig, PlanSection,
                                 PrecisionSection, PretrainSection, ScheduleSection, TokenizerSection, TrainSection)
from tasks.config.yaml12 import DuplicateKeyError, Loader, load_yaml

__all__ = [
    "BUDGET_KEYS", "FINETUNE_DEFAULTS", "FINETUNE_INHERITS", "LAYOUT_KEYS", "MOVED", "CheckpointSection",
    "CleanSection", "ConfigError", "ContinuedSection", "DataSection", "DuplicateKeyError", "EvalSection",
    "ExportSection", "FinetuneSection", "Loader", "LoopSection", "LoraSection", "ModelSection", "OptimizerSection",
    "ParallelSection", "PipelineConfig", "PlanSection", "PrecisionSection", "PretrainSection", "ScheduleSection",
    "TokenizerSection", "TrainSection", "expand_source", "apply_overrides", "check_pipeline",
    "default_pipeline_name", "inherit_train", "load_yaml", "parse_override", "read_pipelines_file",
    "resolve_pipeline", "to_yaml", "train_errors", "validate_file",
]
