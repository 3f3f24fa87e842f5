"""Architecture config for the LLaMA decoder, plus named presets.

Usage:
    cfg = ModelConfig.from_name("tiny")                  # a preset
    cfg = ModelConfig.from_name("small", max_seq_length=256)  # preset + overrides
    cfg = ModelConfig.from_dict(checkpoint_meta["model"])     # round-trip via to_dict()

Only architecture lives here: no trainer, data or parallelism settings.
Derived values (head_dim, num_parameters, flops_per_token) are properties,
never stored, so they cannot drift from the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

SCORING_MAX_BYTES = 1 << 30
"""The activations one eval scoring call may hold (`ModelConfig.scoring_rows`). The dynamic-shape graph's pool
grows to its largest call: with 4 GiB and the whole decoder in one graph, SmolLM2-135M scoring (batch 8, contexts up
to 500) peaked at 6.0 GB and 360M at 7.3 GB, against 3.3 and 3.8 GB for lm-eval hf's forward + log_softmax; one
layer at a time (the scorer's path now) with 1 GiB: 1.66 and 2.91 GB against 3.49 and 4.05 (docs/MEMORY.md)."""


@dataclass
class ModelConfig:
    """Shapes and hyper-parameters of a LLaMA-style decoder-only transformer."""

    vocab_size: int
    """Number of token ids; rows of the embedding table and columns of the logits."""
    hidden_size: int
    """Width of the residual stream (d_model)."""
    intermediate_size: int
    """Inner width of the SwiGLU MLP (gate/up projections output this many features)."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Number of query heads; must divide hidden_size."""
    num_kv_heads: int
    """Number of key/value heads (grouped-query attention); must divide num_heads."""
    max_seq_length: int
    """Longest sequence the model supports; RoPE tables are precomputed up to this length."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    norm_eps: float = 1e-5
    """Epsilon added to the mean square in RMSNorm."""
    tie_embeddings: bool = False
    """If True the output projection reuses the embedding table (no separate lm_head)."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embedding and projection weights."""

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_seq_length",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            # `not value > 0` (not `value <= 0`): NaN compares false both ways; inf is no usable size either
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < float("inf"):
                raise ValueError(f"ModelConfig.{name} must be a positive finite number, got {value!r}")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"ModelConfig.tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        if self.hidden_size % self.num_heads != 0:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads ({self.num_heads}) must be divisible by num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim (hidden_size / num_heads = {self.head_dim}) must be even for RoPE")

    # ---- derived values -------------------------------------------------

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    @property
    def _layer_matmul_params(self) -> int:
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv  # q, o: [h, h]; k, v: [kv, h]
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attn + mlp

    @property
    def num_parameters(self) -> int:
        """Exact number of parameters of `LlamaForCausalLM(self)`."""
        h = self.hidden_size
        layer = self._layer_matmul_params + 2 * h  # + input/post-attention RMSNorm
        embed = self.vocab_size * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return embed + self.num_layers * layer + h + head  # + final norm

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs (forward + backward) per token, PaLM appendix B / Chinchilla style, causal.

        6 * N_matmul + 6 * num_layers * hidden_size * seq_len, where N_matmul counts
        the weights that take part in a matmul: all projections of every layer plus the
        output projection (vocab_size * hidden_size, also when tied). The embedding
        lookup and the norm weights do no matmul and are left out. The second term is
        the attention score and value matmuls (QK^T and PV, forward + backward) over the
        causal half only: PaLM counts the whole square (12 * ...), but the fused attention
        kernel computes only the causal half, and with the square counted the tiny
        whole-model step's MFU came out at 1.01 against a measured 2048^3 sgemm (AMD EPYC
        family 26, AVX-512, 2026-12-05): a figure that cannot be. Counting only the work a
        step must do keeps MFU <= the cores' real utilization. `seq_len` defaults to
        max_seq_length.
        """
        t = self.max_seq_length if seq_len is None else seq_len
        h = self.hidden_size
        n_matmul = self.num_layers * self._layer_matmul_params + self.vocab_size * h
        return 6.0 * n_matmul + 6.0 * self.num_layers * h * t

    def scoring_bytes_per_token(self, t: int, layers: int = 1) -> int:
        """Activation bytes one token of a length-`t` row holds in the eval scorer's decoder graph, which keeps every
        intermediate alive on CPU, when it holds `layers` decoder layers at once (1: the scorer runs one layer at a
        time, model.runtime.layerwise_hidden_states; num_layers: the whole-decoder graph). Per layer the attention
        scores and probabilities over t keys per head, ~10 hidden-sized and 3 intermediate-sized fp32 tensors
        (measured on SmolLM2-135M's whole-decoder graph at t = 500: 1.8 MB over 30 layers; this gives 2.3 MB);
        once per call the causal mask over t keys per head and the layer's input and output. TokenScorer
        (tasks/stages/evaluate/lm_adapter.py) takes fewer rows per call where they would pass SCORING_MAX_BYTES;
        validation refuses an eval.batch_size no call can hold."""
        per_layer = 2 * self.num_heads * t + 10 * self.hidden_size + 3 * self.intermediate_size
        return 4 * (layers * per_layer + self.num_heads * t + 2 * self.hidden_size)

    def scoring_rows(self, t: int, batch_size: int, max_bytes: int | None = None, layers: int = 1) -> int:
        """Rows of length `t` one eval scoring call takes: batch_size, fewer where they would exceed max_bytes
        (default SCORING_MAX_BYTES) with `layers` decoder layers' activations held at once, at least one."""
        budget = SCORING_MAX_BYTES if max_bytes is None else max_bytes
        return max(1, min(batch_size, budget // (t * self.scoring_bytes_per_token(t, layers))))

    # ---- (de)serialisation ------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (JSON/YAML friendly); `from_dict` inverts it."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Build from a dict of fields; unknown keys raise ValueError naming the key."""
        known = {f.name for f in fields(cls)}
        for key in d:
            if key not in known:
                raise ValueError(f"unknown ModelConfig key {key!r}; valid keys: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> ModelConfig:
        """Preset `name` from PRESETS, with fields replaced by `overrides`."""
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; available: {sorted(PRESETS)}")
        return cls.from_dict({**PRESETS[name], **overrides})


PRESETS: dict[str, dict[str, Any]] = {
    # Unit tests: compiles and runs in seconds.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=172,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        max_seq_length=128,
    ),
    # Demo model trained on 2 CPU cores: ~20.8M parameters, the cheapest shape we
    # found inside the 20-50M target (hidden 384 / 6 layers is only ~12.6M).
    "small": dict(
        vocab_size=4096,
        hidden_size=512,
        intermediate_size=1376,
        num_layers=6,
        num_heads=8,
        num_kv_heads=2,
        max_seq_length=512,
    ),
    # Shapes used for the MindSpore vs PyTorch throughput comparison.
    "tiny-llama-bench": dict(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_layers=4,
        num_heads=8,
        num_kv_heads=4,
        max_seq_length=256,
    ),
    # SmolLM2-135M (the `smollm2` pipeline's real model, converted from its GGUF; built and trained on CPU).
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        max_seq_length=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # SmolLM2-360M's shape (random weights here: the memory and speed benches, the slow tier's 360M run).
    "smollm2-360m": dict(
        vocab_size=49152,
        hidden_size=960,
        intermediate_size=2560,
        num_layers=32,
        num_heads=15,
        num_kv_heads=5,
        max_seq_length=8192,
        rope_theta=100000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # Llama-3.2-1B's decoder (16 layers, hidden 2048, MLP 8192, 32 query / 8 kv heads, tied, rope theta 500000) with
    # SmolLM2's 49152-token vocabulary, the benches' tokenizer (Llama-3.2's own 128256 tokens add 0.16 B embedding
    # weights): 1.07 B parameters, random weights for the decode and memory benches (scripts/bench/llamacpp.py).
    "llama-3.2-1b-body": dict(
        vocab_size=49152,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=4096,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # Llama-3.2-1B's shape whole: the decoder above with its own 128256-token vocabulary (1.24 B parameters, 0.26 B of
    # them the tied embedding): the 1B serve, eval and LoRA benches (random weights; scripts/bench/serve_memory.py pads
    # SmolLM2's tokenizer to this vocabulary, `padded_tokenizer`).
    "llama-3.2-1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=4096,
        rope_theta=500000.0,
        norm_eps=1e-5,
        tie_embeddings=True,
    ),
    # Real shapes, for the memory estimator (never built on CPU).
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        max_seq_length=4096,
    ),
    "llama3-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        max_seq_length=8192,
        rope_theta=500000.0,
        norm_eps=1e-5,
    ),
}
