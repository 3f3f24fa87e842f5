"""The LLaMA model package: config + presets, the MindSpore model, and an explicit registry.

    from model import ModelConfig, build_model
    model = build_model("llama", ModelConfig.from_name("tiny"), seed=0)

`model.config` and `model.registry` import without MindSpore (the pipeline config
validates presets in milliseconds); the MindSpore names below load on first access.
"""

from model.config import PRESETS, ModelConfig
from model.registry import ModelRegistry, build_model, default_registry

_LAZY = {"LlamaForCausalLM": "model.llama", "causal_lm_loss": "model.llama"}

__all__ = ["PRESETS", "ModelConfig", "ModelRegistry", "build_model", "default_registry", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:  # importing model.llama pulls in MindSpore (seconds), so only on demand
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'model' has no attribute {name!r}")
