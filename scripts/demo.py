"""The README's demo: validate the `demo` pipeline, run the full-pipeline flow on Prefect's
embedded server, and show what it made (loss falling, artifacts, lineage).

    .venv/bin/python scripts/demo.py [--pipeline demo] [--artifacts artifacts] [--set key=VALUE ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.chdir(REPO)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("GLOG_v", "3")


def _du(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pipeline", default="demo")
    ap.add_argument("--artifacts", default="artifacts")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    a = ap.parse_args()
    from tasks.runtime.interrupts import exit_on_interrupt

    exit_on_interrupt("the demo")  # Ctrl-C / SIGTERM: every child stopped within seconds, exit 130; a rerun resumes

    from tasks.config.loader import resolve_pipeline
    from tasks.config.schema import ConfigError

    try:
        cfg = resolve_pipeline("pipelines.yaml", a.pipeline, a.overrides)
    except ConfigError as exc:
        print("error: invalid pipeline:\n  " + "\n  ".join(exc.errors), file=sys.stderr)
        return 2
    mc = cfg.model.resolve()
    print(f"== pipeline '{cfg.name}': {cfg.description}")
    print(
        f"   model {cfg.model.preset}: {mc.num_parameters / 1e6:.1f}M parameters, vocab {mc.vocab_size}, "
        f"{mc.num_layers} layers; data {cfg.data.sources} → seq {cfg.data.seq_length}; "
        f"pretrain {cfg.pretrain.train.loop.max_steps} steps; continued on {cfg.continued.sources or '-'} "
        f"({cfg.continued.train.loop.max_steps} steps)"
    )

    from flows.full_pipeline import full_pipeline

    t0 = time.perf_counter()
    out = full_pipeline(pipeline=cfg.name, config="pipelines.yaml", overrides=a.overrides, artifacts=a.artifacts)
    wall = time.perf_counter() - t0

    from tasks.store.artifacts import ArtifactStore

    print(f"\n== full-pipeline '{cfg.name}' finished in {wall / 60:.1f} min; artifacts:")
    for stage, path in out.items():
        m = ArtifactStore.read_manifest(path)
        print(
            f"   {stage:<20} "
            f"{Path(path).relative_to(Path(a.artifacts).resolve().parent) if Path(path).is_absolute() else path}"
            f"  ({_du(Path(path)) / 1e6:.1f} MB)"
        )
        met = m.get("metrics", {})
        if "val_loss" in met and (Path(path) / "metrics.jsonl").is_file():
            before = met.get("initial_val_loss")
            what = "response-only val loss" if m["stage"] == "finetune" else "val loss"
            ent = f" (unigram entropy of the corpus {met['unigram_entropy']:.3f})" if "unigram_entropy" in met else ""
            print(
                f"   {'':<20} {what} {before:.3f} → {met['val_loss']:.3f} nats/token{ent}; "
                f"loss curve: {Path(path) / 'loss_curve.png'}"
            )
            rows = [json.loads(x) for x in (Path(path) / "metrics.jsonl").read_text().splitlines()]
            curve = [f"{r['step']}:{r['loss']:.2f}" for r in rows if "grad_norm" in r]
            if curve:
                step = max(1, len(curve) // 8)
                print(
                    f"   {'':<20} train loss by step: "
                    f"{' '.join(curve[::step] + ([curve[-1]] if (len(curve) - 1) % step else []))}"
                )
        if m["stage"] == "eval":
            tasks = ", ".join(
                f"{k.removeprefix('local_').split('.')[0]} {v:.2f}" for k, v in met.items() if k.endswith(".acc")
            )
            print(
                f"   {'':<20} held-out perplexity {met.get('perplexity', float('nan')):.1f}, "
                f"bits/byte {met.get('bits_per_byte', float('nan')):.3f}; acc: {tasks}; report: "
                f"{Path(path) / 'report.md'}"
            )
        if m["stage"] == "export":
            v = m.get("verification", {})
            print(
                f"   {'':<20} MindIR max |Δlogit| {v.get('mindir_max_abs_diff')}, ONNX "
                f"{v.get('onnx_max_abs_diff'):.2e}, "
                f"greedy tokens match: {v.get('greedy_tokens_match')}; model card: {Path(path) / 'MODEL_CARD.md'}"
            )
    print(f"\nfinal artifact: {list(out.values())[-1]}")
    print(f"lineage of it:  .venv/bin/msllm lineage {list(out.values())[-1]} --format text|json|mermaid|dot")
    runs = Path(a.artifacts).resolve() / "runs"
    print(
        f"training curves: .venv/bin/tensorboard --logdir {os.path.relpath(runs)}   "
        f"(every pretrain/finetune/eval run of every pipeline; http://localhost:6006)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
