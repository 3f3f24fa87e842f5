"""`msllm`: the command line (a contract, see DESIGN.md).

    msllm validate|data|train|finetune|eval|export|predict|convert|lineage|plan [options]

Common options: --config PATH (default ./pipelines.yaml), --pipeline NAME
(default: the file's default), --set dotted.key=VALUE (repeatable, VALUE parsed
as YAML), --artifacts DIR (default ./artifacts). A stage subcommand takes its
upstream artifact with --from PATH and prints the path of the artifact it wrote
(or found cached) as the last line of stdout. Exit 0 on success, 2 on a config
error (every error listed), 1 on any other failure, with a short message.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Callable

from tasks.config import ConfigError, PipelineConfig, resolve_pipeline, to_yaml, validate_file


class StageError(RuntimeError):
    """A stage failed for a reason the user can fix; the message says how."""


class NotBuiltYet(StageError):
    pass


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="pipelines.yaml", help="pipelines file (default: ./pipelines.yaml)")
    p.add_argument("--pipeline", default=None, help="pipeline name (default: the file's `default:`)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a key, e.g. --set pretrain.max_steps=100 (repeatable; VALUE is YAML)")
    p.add_argument("--artifacts", default=os.environ.get("MSLLM_ARTIFACTS", "artifacts"),
                   help="artifact root (default: ./artifacts)")


def _stage(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument("--from", dest="from_", default=None, metavar="PATH",
                   help="upstream artifact (default: the newest one of this pipeline)")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msllm", description="LLaMA-style LLM pipeline on MindSpore + Prefect")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("validate", help="validate pipelines.yaml and print the resolved pipeline")
    _common(p)
    p.add_argument("--all", action="store_true", help="validate every pipeline of the file")
    p.add_argument("--forward", action="store_true", help="also build the model and run one forward pass")

    for name, help_ in (
        ("data", "corpora → tokenizer → packed MindRecord shards"),
        ("train", "pretrain (from scratch or continued)"),
        ("finetune", "LoRA or full fine-tuning"),
        ("eval", "perplexity, lm-eval tasks, sample generations"),
        ("export", "MindIR and ONNX, verified"),
    ):
        p = sub.add_parser(name, help=help_)
        _stage(p)
        if name == "eval":
            p.add_argument("compare", nargs="*", metavar="compare A B", help="compare two eval artifacts side by side")

    p = sub.add_parser("predict", help="generate completions")
    _stage(p)
    p.add_argument("prompts", nargs="*")

    p = sub.add_parser("convert", help="HF LLaMA ⇄ native checkpoints")
    _common(p)
    p.add_argument("--from-hf", default=None)
    p.add_argument("--to-hf", nargs=2, default=None, metavar=("ARTIFACT", "DIR"))

    p = sub.add_parser("lineage", help="where an artifact came from, down to raw corpus bytes")
    _common(p)
    p.add_argument("artifact")
    p.add_argument("--format", choices=["text", "json", "mermaid", "dot"], default="text")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    _common(p)
    p.add_argument("artifact", nargs="?", help="export or model artifact (default: the pipeline's newest export)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="model id clients send (default: <stage>/<key>)")
    p.add_argument("--max-active", type=int, default=32, help="sequences decoded in turn; the rest queue")
    p.add_argument("--max-queue", type=int, default=256, help="queued requests before 503")
    p.add_argument("--drain-timeout", type=float, default=8.0, help="seconds SIGTERM waits for requests in flight")
    p.add_argument("--no-batching", dest="batching", action="store_false",
                   help="onnxruntime: decode the active sequences one call each instead of one batched call")

    p = sub.add_parser("plan", help="memory estimate and parallel layout")
    _common(p)
    p.add_argument("--device-memory", type=_device_memory, default="32GiB",
                   help="memory per device, e.g. 32GiB, 80GB, 512MiB (default: 32GiB)")
    p.add_argument("--devices", type=_device_count, default=None,
                   help="devices to plan for (default: parallel.device_num)")
    return ap


def _device_count(text: str) -> int:
    """argparse type of `plan --devices`: a positive integer (bad values exit 2 naming the argument)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device count; give a positive whole number, e.g. --devices 8")
    return n


def _device_memory(text: str) -> int:
    """argparse type of `plan --device-memory`: a positive, finite size in bytes."""
    from tasks.memory import parse_bytes

    try:
        n = parse_bytes(text)
    except (ValueError, OverflowError):
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a memory size; give a positive size with a unit, "
                                         "e.g. 32GiB, 80GB or 512MiB")
    return n


def _load(args) -> PipelineConfig:
    return resolve_pipeline(args.config, args.pipeline, args.overrides)


def cmd_validate(args) -> int:
    if args.all:
        results = validate_file(args.config)
        bad = 0
        for name, errs in results.items():
            print(f"{name}: {'ok' if not errs else 'INVALID'}")
            for e in errs:
                print(f"  {e}", file=sys.stderr)
            bad += bool(errs)
        return 2 if bad else 0
    cfg = _load(args)
    print(to_yaml(cfg), end="")
    mc = cfg.model.resolve()
    print(f"# model: {cfg.model.name}/{cfg.model.preset}, {mc.num_parameters / 1e6:.2f}M parameters", flush=True)
    if args.forward:
        _forward_check(cfg)
    print(f"pipeline '{cfg.name}' is valid")
    return 0


def _forward_check(cfg: PipelineConfig) -> None:
    import time

    import numpy as np

    from model.runtime import setup_mindspore

    setup_mindspore()
    import mindspore as ms

    from model.registry import build_model

    mc = cfg.model.resolve()
    t0 = time.perf_counter()
    net = build_model(cfg.model.name, mc, seed=cfg.pretrain.seed)
    ids = np.random.default_rng(0).integers(0, mc.vocab_size, size=(2, min(32, cfg.data.seq_length)), dtype=np.int32)
    logits = net(ms.Tensor(ids)).asnumpy()
    print(
        f"# forward pass: input_ids {list(ids.shape)} -> logits {list(logits.shape)}, "
        f"finite={bool(np.isfinite(logits).all())}, mean={logits.mean():.4f}, std={logits.std():.4f}, "
        f"{time.perf_counter() - t0:.1f}s"
    )


def _not_built(what: str, issue: str) -> Callable:
    def run(args) -> int:
        _load(args) if hasattr(args, "pipeline") else None
        raise NotBuiltYet(f"'{args.command}' is not built yet ({what}; tracked in issue {issue})")

    return run


def _store(args):
    from tasks.artifacts import ArtifactStore

    return ArtifactStore(args.artifacts)


def _upstream(args, store, stage: str, pipeline: str, hint: str) -> Path:
    if args.from_:
        return store.find(args.from_)
    p = store.newest(stage, pipeline)
    if p is None:
        raise StageError(f"no {stage} artifact for pipeline '{pipeline}' under {store.root}; run `{hint}` first or pass --from PATH")
    return p


def cmd_data(args) -> int:
    from tasks import data

    cfg = _load(args)
    store = _store(args)
    tok = None
    if cfg.pretrain.init_from:  # continued pretraining keeps the base model's tokenizer
        tok = store.find(str(cfg.resolve_path(cfg.pretrain.init_from))) / "tokenizer.model"
    path = data.run(cfg, store, tokenizer_model=tok)
    _print_metrics(path)
    print(path)
    return 0


def cmd_train(args) -> int:
    from tasks import pretrain

    cfg = _load(args)
    store = _store(args)
    data_art = _upstream(args, store, "data", cfg.name, f"msllm data --pipeline {cfg.name}")
    init = store.find(str(cfg.resolve_path(cfg.pretrain.init_from))) if cfg.pretrain.init_from else None
    path = pretrain.run(cfg, store, data_art, init_from=init, retries=1)
    _print_metrics(path)
    print(path)
    return 0


def _print_metrics(path: Path) -> None:
    import json

    m = json.loads((Path(path) / "manifest.json").read_text())
    shown = {k: v for k, v in m.get("metrics", {}).items() if not isinstance(v, (dict, list))}
    print(f"# {m['stage']} artifact {m['key']}: " + ", ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items()))


def cmd_lineage(args) -> int:
    from tasks.lineage import lineage_tree, render

    store = _store(args)
    print(render(lineage_tree(store, store.find(args.artifact)), args.format))
    return 0


def cmd_plan(args) -> int:
    from tasks.memory import GiB, Layout, estimate, plan, unsupported

    cfg = _load(args)
    mc = cfg.model.resolve()
    par, pt = cfg.parallel, cfg.pretrain
    seq = pt.seq_length or cfg.data.seq_length
    lay = Layout(dp=par.data_parallel, tp=par.tensor_parallel, pp=par.pipeline_parallel,
                 micro_batch_num=par.micro_batch_num, optimizer_shard=par.optimizer_shard)
    mem = args.device_memory  # bytes (parsed and checked by argparse)
    est = estimate(mc, micro_batch=pt.micro_batch_size, seq=seq, precision=pt.precision, recompute=pt.recompute,
                   layout=lay, backend=par.device_target)
    print(f"model {cfg.model.preset}: {mc.num_parameters / 1e9:.3f}B parameters; micro batch {pt.micro_batch_size}, "
          f"seq {seq}, {pt.precision}, recompute {'on' if pt.recompute else 'off'}, backend {par.device_target}")
    print(f"configured layout dp={lay.dp} tp={lay.tp} pp={lay.pp} (micro_batch_num={lay.micro_batch_num}, "
          f"optimizer_shard={lay.optimizer_shard}): estimate per rank (each of {lay.devices} process(es))")
    print(est.table())
    fits = est.total <= mem
    print(f"  -> {'fits' if fits else 'DOES NOT FIT'} in {mem / GiB:.1f} GiB per device")
    why = unsupported(lay, par.device_target)
    if why:
        print(f"  -> this layout does not run here ({why})")
    devices = args.devices or par.device_num
    rows = plan(mc, devices=devices, device_memory=mem, micro_batch=pt.micro_batch_size, seq=seq,
                precision=pt.precision, backend=par.device_target)
    print(f"\nlayouts for {devices} device(s) × {mem / GiB:.1f} GiB (best first):")
    for lay2, rc, e2, ok in rows[:8]:
        why = unsupported(lay2, par.device_target)
        print(f"  {'fits ' if ok else 'no   '} dp={lay2.dp} tp={lay2.tp} pp={lay2.pp} micro_batch_num={lay2.micro_batch_num} "
              f"optimizer_shard={str(lay2.optimizer_shard).lower():5} recompute={'on ' if rc else 'off'} "
              f"{e2.total / GiB:8.2f} GiB{'   (not runnable here: ' + why + ')' if why else ''}")
    best = next((r for r in rows if r[3] and unsupported(r[0], par.device_target) is None), None)
    if best is None:
        other = next((r for r in rows if r[3]), None)
        hint = (f" (dp={other[0].dp} tp={other[0].tp} pp={other[0].pp} would fit but: "
                f"{unsupported(other[0], par.device_target)})" if other else "")
        print(f"recommendation: no runnable layout fits{hint}; add devices, lower micro_batch_size or seq_length")
        return 1
    lay2, rc, e2, _ = best
    print(f"recommendation: parallel: {{data_parallel: {lay2.dp}, tensor_parallel: {lay2.tp}, pipeline_parallel: {lay2.pp}, "
          f"micro_batch_num: {lay2.micro_batch_num}, optimizer_shard: {str(lay2.optimizer_shard).lower()}, "
          f"device_num: {lay2.devices}}}, pretrain.recompute: {str(rc).lower()}  ({e2.total / GiB:.2f} GiB per device)")
    return 0


COMMANDS: dict[str, Callable] = {
    "validate": cmd_validate,
    "data": cmd_data,
    "train": cmd_train,
    "finetune": lambda args: __import__("tasks.finetune", fromlist=["cli_finetune"]).cli_finetune(args),
    "eval": lambda args: __import__("tasks.evaluate", fromlist=["cli_eval"]).cli_eval(args),
    "export": lambda args: __import__("tasks.export", fromlist=["cli_export"]).cli_export(args),
    "predict": lambda args: __import__("tasks.evaluate", fromlist=["cli_predict"]).cli_predict(args),
    "convert": lambda args: __import__("tasks.convert", fromlist=["cli_convert"]).cli_convert(args),
    "lineage": cmd_lineage,
    "plan": cmd_plan,
    "serve": lambda args: __import__("tasks.serving.app", fromlist=["cli_serve"]).cli_serve(args),
}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args) or 0
    except ConfigError as exc:
        print(f"error: {len(exc.errors)} problem(s) in {args.config}:", file=sys.stderr)
        for e in exc.errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    except NotBuiltYet as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (StageError, OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
