"""The commands: each parses nothing (argparse did), calls one stage or tool, prints, returns an exit code.

Every stage runs through the stage runner the flows share (tasks/stages/runner.py: the config resolved once here,
the machine checked and the key computed once there); the memory plan and the forward check are
tasks/stages/preflight.py's. Stage modules never import this package, and this package imports neither the
training room nor the model (tests/test_imports.py).

The lazy boundary: modules that load numpy or MindSpore (the stage modules the runner finds through the stage
table, tasks.stages.evaluate / export / convert, tasks.modeling.merge, the serving app) are imported inside the
command that uses them, so `msllm --help`, `validate` and `plan` start without them; everything else is imported
here, at the top."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tasks.cli.common import StageError, load, print_metrics, store, upstream
from tasks.config.loader import to_yaml, validate_file
from tasks.stages import runner
from tasks.stages.preflight import forward_check, memory_plan
from tasks.stages.upstream import NoUpstream, choose_model, eval_selection, model_of_eval
from tasks.store.lineage import lineage_data_artifact, lineage_tree, render

STARTER = Path(__file__).resolve().parent / "starter"  # package data: ships in the wheel


def cmd_init(args) -> int:
    """`msllm init [DIR] [--force]`: copy the starter project (tasks/cli/starter/) into DIR; never overwrites
    without --force. Prints the files written, then DIR as the last line."""
    dest = Path(args.directory).resolve()
    files = sorted(p for p in STARTER.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    if not files:
        raise StageError(f"{STARTER}: the starter files are missing from this installation; reinstall msllm")
    clash = [dest / f.relative_to(STARTER) for f in files if (dest / f.relative_to(STARTER)).exists()]
    if clash and not args.force:
        raise StageError(
            f"{clash[0]} exists (and {len(clash) - 1} more); pass --force to overwrite, or choose another directory"
        )
    for f in files:
        out = dest / f.relative_to(STARTER)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(f, out)
        print(f"wrote {out}", file=sys.stderr)
    print(f"next: cd {dest} && msllm validate && msllm data && msllm train && msllm eval", file=sys.stderr)
    print(dest)
    return 0


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
    cfg = load(args)
    runner.check_machine(cfg)
    print(to_yaml(cfg), end="")
    mc = cfg.model.resolve()
    print(f"# model: {cfg.model.name}/{cfg.model.preset}, {mc.num_parameters / 1e6:.2f}M parameters", flush=True)
    if args.forward:
        print(forward_check(cfg))
    print(f"pipeline '{cfg.name}' is valid")
    return 0


# ----------------------------------------------------------------------------- stage commands


def _init_from(cfg, st) -> Path | None:
    """pretrain.init_from as a model artifact (a GGUF file or an HF directory converted first), or None."""
    given = cfg.resolve_path(cfg.pretrain.init_from) if cfg.pretrain.init_from else None
    return runner.resolve_init(st, cfg.name, given)


def cmd_data(args) -> int:
    cfg = load(args)
    st = store(args)
    tok = _init_from(cfg, st)  # continued pretraining keeps the base model's tokenizer
    path = runner.prepare("data", st, cfg, tokenizer_model=tok, refresh=args.refresh).run()
    print_metrics(path)
    print(path)
    return 0


def cmd_train(args) -> int:
    cfg = load(args)
    st = store(args)
    data_art = upstream(args, st, "pretrain", cfg.name)
    call = runner.prepare(
        "pretrain", st, cfg, data_artifact=data_art, init_from=_init_from(cfg, st), refresh=args.refresh
    )
    path = call.run(retries=1)
    print_metrics(path)
    print(path)
    return 0


def cmd_finetune(args) -> int:
    """`msllm finetune`: train (or find) the adapter, merge it; last stdout line = the finetune artifact."""
    from tasks.modeling.merge import merge

    cfg = load(args)
    st = store(args)
    base = upstream(args, st, "finetune", cfg.name)
    path = runner.prepare("finetune", st, cfg, base_artifact=base, refresh=args.refresh).run(retries=1)
    merged = merge(st, path)
    print_metrics(path)
    print(merged)
    print(path)
    return 0


def cmd_eval(args) -> int:
    """`msllm eval [--from MODEL]` runs the stage (default model: the pipeline's newest merged finetune or
    pretrain artifact); `msllm eval compare A B` compares two eval artifacts."""
    from tasks.stages import evaluate

    if args.compare:
        if args.compare[0] != "compare" or len(args.compare) != 3:
            raise StageError(f"unexpected arguments {args.compare}; usage: msllm eval compare EVAL_A EVAL_B")
        st = store(args)
        print(evaluate.compare_table(st.find(args.compare[1]), st.find(args.compare[2])))
        return 0
    cfg = load(args)
    st = store(args)
    choice = choose_model(st, cfg.name, args.from_)  # the rule: tasks/stages/upstream.py
    model = choice.path
    print(f"[eval] {choice.line()}", file=sys.stderr)
    selection = eval_selection(st, cfg.name, choice)
    if "note" in selection:
        print(f"[eval] note: {selection['note']}", file=sys.stderr)
    data = lineage_data_artifact(st, model)
    if data is None:
        print(f"[eval] no data artifact in the lineage of {model}: held-out perplexity skipped", file=sys.stderr)
    call = runner.prepare("eval", st, cfg, model_artifact=model, data_artifact=data, refresh=args.refresh)
    path = call.run(selection=selection)
    print_metrics(path)
    print(path)
    return 0


def _prompts(args) -> list[str]:
    out = []
    for p in args.prompts:
        if p.startswith("@"):  # @FILE: one prompt per line
            out += [ln for ln in Path(p[1:]).read_text(encoding="utf-8").splitlines() if ln.strip()]
        else:
            out.append(p)
    return out


def cmd_predict(args) -> int:
    """`msllm predict [--from MODEL] PROMPT... | @FILE`: completions with the eval section's generation settings."""
    from tasks.stages.evaluate.lm_adapter import MindSporeLM

    cfg = load(args)
    st = store(args)
    prompts = _prompts(args) or list(cfg.eval.prompts)
    if not prompts:
        raise StageError("no prompts: pass them as arguments, as @FILE (one per line), or set eval.prompts")
    choice = choose_model(st, cfg.name, args.from_)
    print(f"[predict] {choice.line()}", file=sys.stderr)
    model = choice.path
    ev = cfg.eval
    lm = MindSporeLM(
        pretrained=model,
        max_gen_toks=ev.max_new_tokens,
        progress=False,
        fused_kernels=ev.fused_kernels,
        weights=ev.weights,
    )
    for i, prompt in enumerate(prompts):
        completion = lm.generate_text(
            prompt,
            until=ev.stop,
            max_gen_toks=ev.max_new_tokens,
            temperature=ev.temperature,
            top_k=ev.top_k,
            top_p=ev.top_p,
            seed=ev.seed,
        )
        if i:
            print("-" * 40)
        print(prompt + completion, flush=True)
    return 0


def cmd_export(args) -> int:
    """`msllm export [--from MODEL]`: default model = the pipeline's newest merged or pretrain artifact.

    The newest eval artifact of that model (when there is one) goes into the model card.
    """
    from tasks.stages import export

    cfg = load(args)
    st = store(args)
    choice = choose_model(st, cfg.name, args.from_)  # the rule: tasks/stages/upstream.py
    model = choice.path
    ev = export.matching_eval(st, model, cfg.name)
    print(
        f"[export] {choice.line()}" + (f"; eval {ev}" if ev else " (no eval artifact: card without results)"),
        file=sys.stderr,
    )
    path = runner.prepare("export", st, cfg, model_artifact=model, eval_artifact=ev, refresh=args.refresh).run()
    print_metrics(path)
    print(path)
    return 0


def cmd_convert(args) -> int:
    """`msllm convert --from-hf DIR` | `--from-gguf FILE` | `--to-hf ARTIFACT DIR`; prints the written path last."""
    from tasks.stages import convert

    if sum(map(bool, (args.from_hf, args.from_gguf, args.to_hf))) != 1:
        raise StageError("convert: pass exactly one of --from-hf DIR, --from-gguf FILE or --to-hf ARTIFACT DIR")
    st = store(args)
    if args.from_hf or args.from_gguf:
        source, kind = (args.from_hf, "hf") if args.from_hf else (args.from_gguf, "gguf")
        call = runner.prepare("convert", st, source=source, pipeline=args.pipeline, kind=kind)
        path = call.run(progress=False)  # stderr: one line, the error, when it fails
        print_metrics(path)
    else:
        artifact, out = args.to_hf
        path = convert.to_hf(st.find(artifact), out)
        print(f"# wrote {', '.join(sorted(p.name for p in path.iterdir()))}", file=sys.stderr)
    print(path)
    return 0


# ----------------------------------------------------------------------------- tools


def cmd_serve(args) -> int:
    """`msllm serve [ARTIFACT] [--adapter NAME=FINETUNE ...]`: ARTIFACT as given (a directory, `stage/key` or a key
    prefix), else the pipeline's newest export; each FINETUNE likewise (checked against ARTIFACT before loading)."""
    from tasks.serving.app import MAX_BODY, serve

    if args.artifact:
        p = Path(args.artifact)
        artifact = p.resolve() if p.is_dir() else store(args).find(args.artifact)
    else:
        cfg = load(args)
        st = store(args)
        artifact = export_of_choice(st, cfg.name)
        if artifact is None:
            raise StageError(
                f"no export artifact for pipeline '{cfg.name}' under {st.root}; run `msllm export "
                f"--pipeline {cfg.name}` first, or pass an artifact: msllm serve artifacts/merged/<key>"
            )
    return serve(
        artifact,
        args.host,
        args.port,
        model_name=args.model_name,
        max_active=args.max_active,
        max_queue=args.max_queue,
        drain_timeout=args.drain_timeout,
        batching=args.batching,
        adapters=args.adapters,
        store=store(args),
        max_body=args.max_body_size or MAX_BODY,
        weights=args.weights,
        head_timeout=args.head_timeout,
        parallel=args.parallel,
    )


def export_of_choice(st, pipeline: str) -> Path | None:
    """The export `msllm serve` runs by default: the newest export of the model the rule names (choose_model);
    without one, the pipeline's newest export, saying that it is of another model. Prints which and why."""
    exports = st.list("export", pipeline)
    try:
        choice = choose_model(st, pipeline)
    except NoUpstream:
        choice = None
    if choice is not None:
        mine = [p for p, m in exports if any(i.get("key") == choice.key for i in m.get("inputs", []))]
        if mine:
            print(f"[serve] export/{mine[-1].name} of {choice.line()}", file=sys.stderr)
            return mine[-1]
    if not exports:
        return None
    p, m = exports[-1]
    what = f"{choice.ref} ({choice.reason})" if choice else "the pipeline's model"
    print(
        f"[serve] note: no export of {what}; serving the pipeline's newest export export/{p.name} "
        f"(of {model_of_eval(m)}); run `msllm export --pipeline {pipeline}` to export the chosen model",
        file=sys.stderr,
    )
    return p


def cmd_lineage(args) -> int:
    st = store(args)
    print(render(lineage_tree(st, st.find(args.artifact)), args.format))
    return 0


def cmd_plan(args) -> int:
    """`msllm plan [--device-memory SIZE] [--devices N]`: the memory estimate and the ranked layouts; exit 1 when
    no layout both fits and runs here."""
    report = memory_plan(load(args), device_memory=args.device_memory, devices=args.devices)  # sizes: argparse's
    print("\n".join(report.lines))
    return 0 if report.runnable else 1
