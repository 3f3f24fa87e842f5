"""What runs the model behind `msllm serve`: one backend per artifact kind, one interface.

    backend = load_backend(path)       # export artifact -> onnxruntime, model artifact -> MindSpore
    backend.kind, backend.context_length, backend.vocab_size, backend.eos_id, backend.tokenizer
    backend.warmup()                   # compile / run once so the first request is not the slow one
    steps = backend.steps(prompt_ids)  # a coroutine: yields the logits [V] for the next position
    logits = next(steps)               # prefill (the whole prompt in one call)
    logits = steps.send(token)         # one decode step through the KV cache
    steps.close()

Each `steps` coroutine owns its KV cache, so any number of them can be interleaved (the
engine does, one token each per round) and each yields what it would yield alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Generator

import numpy as np


def artifact_kind(path: str | Path) -> str:
    """'export' or 'model' by the files of the directory; ValueError naming what is missing."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{path}: not a directory; pass an export artifact or a model artifact (pretrain, merged, convert)")
    if (p / "export.json").is_file() or (p / "model.onnx").is_file():
        return "export"
    if (p / "model.json").is_file() and (p / "model.safetensors").is_file():
        return "model"
    if (p / "adapter.json").is_file():
        raise ValueError(f"{path}: a finetune artifact holds only the LoRA adapter; serve its merged artifact "
                         f"(`msllm finetune` prints it) or an export of it")
    raise ValueError(f"{path}: neither an export artifact (export.json, model.onnx) nor a model artifact "
                     f"(model.json, model.safetensors)")


class MindSporeBackend:
    """A model artifact on MindSpore: `model.generate.Generator`'s jit-compiled prefill and KV-cache decode step."""

    kind = "mindspore"

    def __init__(self, path: str | Path):
        from model.runtime import setup_mindspore

        setup_mindspore()
        from model.generate import Generator
        from tasks.model_artifact import load_model, load_tokenizer

        self.path = Path(path)
        net, self.info = load_model(path)
        self.tokenizer = load_tokenizer(path)
        self.generator = Generator(net)
        self.context_length = int(self.generator.max_len)
        self.vocab_size = int(net.config.vocab_size)
        self.eos_id = int(self.tokenizer.eos_id())

    def steps(self, prompt_ids: list[int]) -> Generator[np.ndarray, int, None]:
        # Generator.generate's own coroutine (prompt right-padded to a 32-token bucket, one compiled
        # prefill per bucket, one compiled decode step): the same arithmetic as `msllm predict`.
        return self.generator._cached_steps([int(t) for t in prompt_ids])

    def warmup(self) -> None:
        """Compile the decode step and the first prefill bucket (prompts up to 32 tokens)."""
        s = self.steps([self.eos_id])
        next(s)
        s.send(self.eos_id)
        s.close()


def load_backend(path: str | Path):
    """The backend for an artifact directory (see `artifact_kind`)."""
    kind = artifact_kind(path)
    if kind == "model":
        return MindSporeBackend(path)
    return OnnxBackend(path)


class OnnxBackend:
    """An export artifact on onnxruntime alone (numpy, onnxruntime, sentencepiece)."""

    kind = "onnxruntime"

    def __init__(self, path: str | Path):
        raise ValueError(f"{path}: serving an export artifact needs its KV-cache ONNX decoder, which this export "
                         f"does not have; serve the model artifact it was exported from instead")
