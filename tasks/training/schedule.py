"""The learning-rate schedule: linear warmup, then cosine / linear decay to min_lr, or constant.

Pure Python (no MindSpore): the loop feeds the rate to the compiled step as a tensor each step.
"""

from __future__ import annotations

import math


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int, decay: str) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, then decay to min_lr."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if decay == "constant" or max_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if decay == "linear":
        return lr + (min_lr - lr) * progress
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))  # cosine


def lr_schedule(train, max_steps: int):
    """`step -> lr` of a `train` section (tasks.config.schema.TrainSection) over a run of `max_steps`."""
    o, s = train.optimizer, train.schedule

    def at(step: int) -> float:
        return lr_at(step, lr=o.lr, min_lr=o.final_lr, warmup_steps=s.warmup_steps, max_steps=max_steps, decay=s.decay)

    return at


def training_steps(loop, tokens_per_sample: int) -> int:
    """Optimizer steps of a run: loop.max_steps, or loop.max_tokens over the tokens of one step on one rank
    (micro_batch_size × gradient_accumulation × tokens_per_sample); validation guarantees exactly one is set."""
    if loop.max_steps is not None:
        return loop.max_steps
    return max(1, loop.max_tokens // (loop.micro_batch_size * loop.gradient_accumulation * tokens_per_sample))


def budget_line(loop, tokens_per_sample: int, where: str = "pretrain.train.loop") -> str:
    """Which budget the run uses, in words (printed at the start of every run)."""
    steps = training_steps(loop, tokens_per_sample)
    if loop.max_steps is not None:
        return f"training budget: {where}.max_steps = {steps} steps"
    return (
        f"training budget: {where}.max_tokens = {loop.max_tokens} tokens = {steps} steps of "
        f"{loop.micro_batch_size * loop.gradient_accumulation} × {tokens_per_sample} tokens"
    )
