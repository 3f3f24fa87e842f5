"""`msllm`: the command line (a contract, see docs/ARCHITECTURE.md). Parsing here, the commands in
`tasks/cli/commands.py`; stage modules never import this package.

    msllm init|validate|data|train|finetune|eval|export|predict|convert|lineage|plan|serve [options]

`msllm init DIR` writes a starter project (pipelines.yaml with a `tiny` pipeline, small corpora)
from the package, so the commands run from any directory after `pip install`.
Common options: --config PATH (default ./pipelines.yaml), --pipeline NAME
(default: the file's default), --set dotted.key=VALUE (repeatable, VALUE parsed
as YAML), --artifacts DIR (default ./artifacts). A stage subcommand takes its
upstream artifact with --from PATH and prints the path of the artifact it wrote
(or found cached) as the last line of stdout. Exit 0 on success, 2 on a config
error (every error listed), 1 on any other failure, with a short message; 141, silently, when
the reader of stdout has gone (`msllm lineage … | head`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

from tasks.cli import commands
from tasks.cli.common import StageError
from tasks.config.schema import ConfigError
from tasks.config.units import parse_bytes
from tasks.runtime.interrupts import sigterm_interrupts
from tasks.runtime.supervise import StageInterrupted
from tasks.serving.adapters import parse_adapter_flag


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default="pipelines.yaml", help="pipelines file (default: ./pipelines.yaml)")
    p.add_argument("--pipeline", default=None, help="pipeline name (default: the file's `default:`)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, e.g. --set pretrain.train.loop.max_steps=100 (repeatable; VALUE is YAML)",
    )
    p.add_argument(
        "--artifacts",
        default=os.environ.get("MSLLM_ARTIFACTS", "artifacts"),
        type=_artifact_root,
        help="artifact root (default: ./artifacts)",
    )


def _artifact_root(text: str) -> str:
    """argparse type of `--artifacts`: a directory, or a path whose nearest existing part is one (created on the
    first build). A file there is refused naming it, before any compute (the store would only fail at its first
    write, or find nothing "under" it)."""
    p = Path(text).expanduser()
    probe = next((q for q in (p, *p.parents) if q.exists()), None)
    if probe is not None and not probe.is_dir():
        what = "is a file" if probe == p else f"lies under {probe}, a file"
        raise argparse.ArgumentTypeError(
            f"{text}: not a directory ({what}); pass --artifacts DIR naming a "
            "directory (created if missing), e.g. --artifacts artifacts"
        )
    return text


def _stage(p: argparse.ArgumentParser) -> None:
    _common(p)
    p.add_argument(
        "--from",
        dest="from_",
        default=None,
        metavar="PATH",
        help="upstream artifact (default: the newest one of this pipeline)",
    )


def _serve_parser(sub) -> None:
    """`msllm serve`'s flags (docs/SERVING.md)."""
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (completions, chat, streaming)")
    _common(p)
    p.add_argument("artifact", nargs="?", help="export or model artifact (default: the pipeline's newest export)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default=None, help="model id clients send (default: <stage>/<key>)")
    p.add_argument("--max-active", type=int, default=32, help="sequences decoded in turn; the rest queue")
    p.add_argument(
        "--max-queue",
        type=int,
        default=256,
        help="sequences waiting before 503 (a request of more prompts × n than this is a 400)",
    )
    p.add_argument(
        "--max-body-size",
        type=_body_size,
        default=None,
        metavar="SIZE",
        help="largest request body read, e.g. 8MiB, 512MB or bytes; larger is a 413 (default: 8MiB)",
    )
    p.add_argument("--drain-timeout", type=float, default=8.0, help="seconds SIGTERM waits for requests in flight")
    p.add_argument(
        "--head-timeout",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="seconds a client has to send a complete request head (line and headers) after connecting or after "
        "its previous response; past it the connection is closed (slow-loris clients hold no socket)",
    )
    p.add_argument(
        "--no-batching",
        dest="batching",
        action="store_false",
        help="decode the active sequences one call each instead of one batched call",
    )
    p.add_argument(
        "--parallel",
        type=_positive_int,
        default=4,
        metavar="N",
        help="a model artifact on MindSpore: KV cache slots whose sequences are decoded together in one batched step "
        "(continuous batching; more wait in the queue). A slot's cache is resident as its positions fill: "
        "layers x 2 x kv heads x head dim x 4 bytes a token (46 KB at SmolLM2-135M). 1: one sequence's caches, "
        "sequences interleaved (default: 4)",
    )
    p.add_argument(
        "--weights",
        choices=["fp32", "fp16", "q8_0"],
        default="fp32",
        help="a model artifact's decode weights (MindSpore's fused decode and prefill steps): fp32, fp16 (IEEE "
        "binary16, as GGUF F16) or q8_0 (GGUF's Q8_0 blocks); in fp16 / q8_0 without adapters the process holds only "
        "those matrices (SmolLM2-135M: ~1.5x / ~2.5x fp32's decode speed); the weights stay fp32 where the fused "
        "kernel does not run. docs/SERVING.md, 'Weight formats'",
    )
    p.add_argument(
        "--adapter",
        dest="adapters",
        action="append",
        default=[],
        type=_adapter,
        metavar="NAME=FINETUNE",
        help="also serve a LoRA finetune of ARTIFACT as model NAME (repeatable; FINETUNE: the finetune "
        "artifact's directory or stage/key). On a model artifact (MindSpore) unmerged: one copy of "
        "the base weights, each adapter's A/B applied per request; on an export (onnxruntime), and "
        "for a full finetune, merged into a copy of the base weights",
    )


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="msllm", description="LLaMA-style LLM pipeline on MindSpore + Prefect")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="write a starter project: pipelines.yaml (a tiny pipeline) and small corpora")
    p.add_argument("directory", nargs="?", default=".", help="where to write it (default: here)")
    p.add_argument("--force", action="store_true", help="overwrite files that exist")

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
        p.add_argument(
            "--refresh",
            action="store_true",
            help="compute again although this stage's artifact is stored (a forced rerun under the same key; the "
            "previous artifact is kept and named in the new manifest's 'replaces')",
        )
        if name == "eval":
            p.add_argument("compare", nargs="*", metavar="compare A B", help="compare two eval artifacts side by side")

    p = sub.add_parser("predict", help="generate completions")
    _stage(p)
    p.add_argument("prompts", nargs="*")

    p = sub.add_parser("convert", help="HF LLaMA directory or GGUF file ⇄ model artifact")
    _common(p)
    p.add_argument(
        "--from-hf",
        default=None,
        metavar="DIR",
        help="a Hugging Face LlamaForCausalLM directory (tokenizer.model or tokenizer.json)",
    )
    p.add_argument("--from-gguf", default=None, metavar="FILE", help="a llama GGUF file (dequantized to float32)")
    p.add_argument("--to-hf", nargs=2, default=None, metavar=("ARTIFACT", "DIR"))

    p = sub.add_parser("lineage", help="where an artifact came from, down to raw corpus bytes")
    _common(p)
    p.add_argument("artifact")
    p.add_argument("--format", choices=["text", "markdown", "json", "mermaid", "dot"], default="text")

    _serve_parser(sub)

    p = sub.add_parser("plan", help="memory estimate and parallel layout")
    _common(p)
    p.add_argument(
        "--device-memory",
        type=_device_memory,
        default="32GiB",
        help="memory per device, e.g. 32GiB, 80GB, 512MiB (default: 32GiB)",
    )
    p.add_argument(
        "--devices", type=_device_count, default=None, help="devices to plan for (default: parallel.device_num)"
    )
    return ap


def _adapter(text: str):
    """argparse type of `serve --adapter`: NAME=FINETUNE (bad values exit 2 naming the flag)."""
    try:
        return parse_adapter_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_bytes(text: str, what: str) -> int:
    """A positive, finite size in bytes (`parse_bytes`), else an argparse error: `text` is not <what>."""
    try:
        n = parse_bytes(text)
    except (ValueError, OverflowError):
        n = 0
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return n


def _body_size(text: str) -> int:
    """argparse type of `serve --max-body-size`: a positive size in bytes (bad values exit 2 naming the flag)."""
    return _positive_bytes(text, "a size; give a positive size in bytes or with a unit, e.g. --max-body-size 8MiB")


def _positive_int(text: str) -> int:
    """argparse type of `serve --parallel`: a whole number of at least 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1, e.g. 4")
    return int(text)


def _seconds(text: str) -> float:
    """argparse type of `serve --head-timeout`: a positive, finite number of seconds."""
    try:
        x = float(text)
    except ValueError:
        x = 0.0
    if not 0 < x < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds; give a positive one, e.g. 10")
    return x


def _device_count(text: str) -> int:
    """argparse type of `plan --devices`: a positive integer (bad values exit 2 naming the argument)."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a device count; give a positive whole number, e.g. --devices 8"
        )
    return n


def _device_memory(text: str) -> int:
    """argparse type of `plan --device-memory`: a positive, finite size in bytes."""
    return _positive_bytes(text, "a memory size; give a positive size with a unit, e.g. 32GiB, 80GB or 512MiB")


COMMANDS: dict[str, Callable] = {
    "init": commands.cmd_init,
    "validate": commands.cmd_validate,
    "data": commands.cmd_data,
    "train": commands.cmd_train,
    "finetune": commands.cmd_finetune,
    "eval": commands.cmd_eval,
    "export": commands.cmd_export,
    "predict": commands.cmd_predict,
    "convert": commands.cmd_convert,
    "lineage": commands.cmd_lineage,
    "plan": commands.cmd_plan,
    "serve": commands.cmd_serve,
}


def _stdout_closed() -> int:
    """The reader of our stdout went away (`msllm lineage … | head`): stop quietly, as Unix tools do on SIGPIPE.
    stdout is pointed at /dev/null so the interpreter's final flush cannot raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141  # 128 + SIGPIPE, what a shell reports for `head`'s writer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None:  # the `msllm` command itself (not a test calling main): SIGTERM stops it as Ctrl-C does
        sigterm_interrupts()
    try:
        rc = COMMANDS[args.command](args) or 0
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return rc
    except BrokenPipeError:
        return _stdout_closed()
    except ConfigError as exc:
        print(f"error: {len(exc.errors)} problem(s) in {args.config}:", file=sys.stderr)
        for e in exc.errors:
            print(f"  {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, StageInterrupted) as exc:
        print(f"interrupted{f': {exc}' if isinstance(exc, StageInterrupted) else ''}", file=sys.stderr)
        return 130
    except (StageError, OSError, ValueError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
