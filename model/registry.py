"""Explicit name -> model class registry.

Nothing registers itself on import: `default_registry()` lists every built-in
model in one place, so a name in pipelines.yaml greps straight to its class.

    model = build_model("llama", ModelConfig.from_name("tiny"), seed=0)
"""

from __future__ import annotations

from typing import Any


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class ModelRegistry:
    """Maps model names (as written in configs) to model classes."""

    def __init__(self) -> None:
        self._models: dict[str, type] = {}

    def register(self, name: str, cls: type) -> None:
        """Register `cls` under `name`; a name can be used only once."""
        if name in self._models:
            raise ValueError(f"'{name}' is already used by {_qualname(self._models[name])}, pick another name.")
        self._models[name] = cls

    def get(self, name: str) -> type:
        """The class registered under `name`; KeyError listing the known names otherwise."""
        if name not in self._models:
            raise KeyError(f"unknown model {name!r}; registered models: {self.names()}")
        return self._models[name]

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._models)

    def __contains__(self, name: object) -> bool:
        return name in self._models


BUILTIN_MODELS = ("llama",)
"""Every built-in model name; importable without MindSpore, so the config schema checks `model.name`
before any compute (tests/test_model.py keeps it equal to `default_registry().names()`)."""


def default_registry() -> ModelRegistry:
    """A fresh registry holding the built-in models."""
    from model.llama import LlamaForCausalLM  # lazy: MindSpore; this module imports without it (BUILTIN_MODELS)

    registry = ModelRegistry()
    registry.register("llama", LlamaForCausalLM)
    return registry


def build_model(name: str, config: Any, registry: ModelRegistry | None = None, **kwargs: Any):
    """Instantiate model `name` with `config` (extra kwargs, e.g. seed, go to the class)."""
    registry = default_registry() if registry is None else registry
    return registry.get(name)(config, **kwargs)
