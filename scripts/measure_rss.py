"""Peak RSS of real jit training steps for a preset (used by tests/test_memory.py). Prints one JSON line.

    python scripts/measure_rss.py --preset tiny --batch 8 --seq 64 [--steps 3] [--recompute] [--layerwise]
        [--no-fused] [--set num_layers=15] [--validate start|later]

`phases` in the line: the peak of each phase on its own (the build; the first step, which compiles the graphs; the
steps after it; with --validate, the trainer's validation loss on the same batch, where the trainer runs it: `start`
before the first step, as a fresh run does at step 0, or `later` after the steps, as a resumed run first does, then
one more step), the high-water mark reset between them (`/proc/self/clear_refs`, Linux; `phase_reset` false where it
could not be, and each phase's peak is then the process's so far), and the resident memory at each phase's end.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--layerwise", action="store_true", help="the step one decoder layer at a time (train.layerwise)")
    ap.add_argument(
        "--validate",
        choices=["start", "later"],
        help="the trainer's validation loss (tasks/training/step.py validation_fn) before the first step "
        "(a fresh run's step 0) or after the steps (a resumed run's first)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=INT",
        help="a ModelConfig field of the preset replaced, e.g. --set num_layers=15",
    )
    ap.add_argument(
        "--no-fused", action="store_true", help="MindSpore's own ops only (pretrain.train.fused_kernels: false)"
    )
    a = ap.parse_args()
    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore(host_blocking=True)  # as the trainer
    from model.config import ModelConfig
    from tasks.modeling.build import build_network
    from tasks.training.hardware import peak_rss_bytes, reset_peak_rss, rss_bytes
    from tasks.training.layerwise import causal_lm_train_step
    from tasks.training.step import causal_lm_loss_fn, validation_fn

    phases, reset = {}, []

    def phase(name: str) -> None:
        phases[name] = {"peak_bytes": peak_rss_bytes(), "rss_bytes": rss_bytes()}
        reset.append(reset_peak_rss())

    def validate() -> None:
        import mindspore as ms

        validation_fn(step, causal_lm_loss_fn(net))(ms.Tensor(ids[:, :-1]), ms.Tensor(ids[:, 1:])).asnumpy()
        phase("validation")

    phase("import")
    cfg = ModelConfig.from_name(a.preset, **{k: int(v) for k, v in (kv.split("=", 1) for kv in a.set)})
    built = build_network("llama", cfg, seed=0, fused_kernels=not a.no_fused)  # as the trainer builds it
    net = built.net
    if a.recompute:
        net.enable_recompute()
    step = causal_lm_train_step(net, net.trainable_params(), in_place=built.kernels.optimizer, layerwise=a.layerwise)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (a.batch, a.seq + 1)).astype(np.int32)
    phase("build")
    if a.validate == "start":
        validate()
    for s in range(a.steps):
        step([(ids[:, :-1], ids[:, 1:])], 1e-4, s + 1)
        if s == 0:
            phase("first_step")
    if a.steps > 1:
        phase("later_steps")
    if a.validate == "later":
        validate()
        step([(ids[:, :-1], ids[:, 1:])], 1e-4, a.steps + 1)
        phase("step_after_validation")
    top = max(v["peak_bytes"] for v in phases.values())
    print(
        json.dumps(
            {
                "preset": a.preset,
                "set": a.set,
                "batch": a.batch,
                "seq": a.seq,
                "recompute": a.recompute,
                "layerwise": a.layerwise,
                "peak_rss_bytes": top,
                "phases": phases,
                "phase_reset": all(reset),
            }
        )
    )


if __name__ == "__main__":
    main()
