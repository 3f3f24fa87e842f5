"""Prefect tasks: thin wrappers around the stage runner (tasks/stages/runner.py), cached by content.

    cfg = resolve_pipeline(config, pipeline, overrides)        # once per flow run
    path = run_stage(data_task, prepare("data", store, cfg))   # checks + the key (once), then the task

A flow prepares each stage with the runner the CLI uses (`prepare`: the machine checked and the stage key
computed once) and hands the StageCall to the stage's task. The task's Prefect cache key IS that call's key,
the artifact store's content key (stage + resolved config section + input digests + code version), read from
the parameter, never computed again; so a hit in one is a hit in the other: when the store holds the artifact
the task shows Cached; when the store has lost it, the task's cache record is refreshed and it reruns. Results
are file paths, persisted as JSON (never pickle). A StageCall is a task parameter, never a result: tasks run in
the flow's process, so it is passed as is (no parameter is persisted: the cache key comes from `cache_key_fn`).

The stages: convert (a GGUF file or HF directory that `init_from` names, as a model artifact: `resolve_init`),
data, pretrain, finetune (+ merge), eval, export.

Cancelling a flow run (the UI, `prefect flow-run cancel`) ends the running task Cancelled, its child processes
stopped, and the flow run Cancelled, in its states and in its log lines (`_stage_body`, `cancellable`); a
SIGTERM that is no cancellation (serve.py stopping, a worker killed) stays Prefect's Crashed.

What the UI shows: every stage publishes its manifest metrics as a table artifact, also when
Prefect reports it Cached (then with a short `<stage>-cached` markdown artifact naming the
cached artifact: stage, key, path, metrics); eval publishes `eval-report-<pipeline>` with the
model it evaluated and why; flows publish the lineage as a markdown tree and table.

Prints inside a task go to the Prefect log (the flows use log_prints), except prints into a
redirected stdout: those stay where the redirect sends them. dill (under datasets and lm-eval)
finds a function's globals by capturing `dis.dis` output through a swapped sys.stdout;
Prefect's print patch logs every print whose file is None, so the disassembly (88 lines per
function) landed in the log and dill saw no globals (`redirected_prints_stay`).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import logging
import signal
import sys
from pathlib import Path
from typing import Any

import psutil
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.exceptions import TerminationSignal
from prefect.states import Cancelled

from tasks.config.schema import PipelineConfig
from tasks.modeling.merge import merge
from tasks.runtime.interrupts import stop_descendants
from tasks.runtime.supervise import is_permanent
from tasks.stages import runner
from tasks.stages.evaluate import selection_lines
from tasks.stages.runner import StageCall, prepare
from tasks.stages.upstream import eval_selection
from tasks.store.artifacts import ArtifactStore
from tasks.store.lineage import lineage_tree, render


def _cache_key(context, params: dict[str, Any]) -> str:
    """A stage task's Prefect cache key: the store's content key its StageCall carries (computed by `prepare`)."""
    call: StageCall = params["call"]
    return f"{call.stage}-{call.key}"


_BUILTIN_PRINT = builtins.print  # the interpreter's own print (this module is imported outside any run)


@contextlib.contextmanager
def redirected_prints_stay():
    """Inside a task: a print into a redirected sys.stdout (dill's `capture`, contextlib.redirect_stdout)
    goes to that redirect, not to Prefect's log; every other print is logged as before."""
    logged, stdout = builtins.print, sys.stdout

    def print_(*args, **kwargs):
        if kwargs.get("file") is None and sys.stdout is not stdout:
            return _BUILTIN_PRINT(*args, **kwargs)
        return logged(*args, **kwargs)

    builtins.print = print_
    try:
        yield
    finally:
        builtins.print = logged


def _stage_body(fn):
    """A stage task's body: prints stay where a redirect sends them (redirected_prints_stay), and a flow-run
    cancellation ends the task Cancelled, its child processes stopped (see `cancelled_run`)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        before = {c.pid for c in psutil.Process().children()}
        with redirected_prints_stay():
            try:
                return fn(*args, **kwargs)
            except TerminationSignal:
                why = cancelled_run()
                if why is None:  # not a cancellation (serve.py stopping, a worker's SIGTERM): Prefect's Crashed
                    raise
                stopped = stop_children(before)
                stage = fn.__name__.removesuffix("_task")
                print(f"{stage}: stopped, {why}" + (f" ({stopped} child process(es) stopped)" if stopped else ""))
                return Cancelled(message=f"{stage} stopped: {why}")

    return wrapper


class CancelledIsNoError(logging.Filter):
    """Prefect's task engine logs every final state but Completed at ERROR: a stage the user cancelled ("Finished in
    state Cancelled(...)") would read as a failure in the run's log, after the stage's own "stopped" line. This
    logs it at INFO, as the flow engine logs the flow's own final state; Failed and Crashed stay errors."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.ERROR and str(record.msg).startswith("Finished in state Cancelled"):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


if not any(isinstance(f, CancelledIsNoError) for f in logging.getLogger("prefect.task_runs").filters):
    logging.getLogger("prefect.task_runs").addFilter(CancelledIsNoError())  # where the task engine logs it


class RunCancelled(Exception):
    """A stage task ended Cancelled: its flow run is being cancelled (flows end Cancelled on it, `cancellable`)."""


def cancelled_run() -> str | None:
    """Why this process got SIGTERM, when it is its flow run's cancellation: the server holds the run in
    Cancelling (a runner or worker sets that, then signals the process); None otherwise (or when unknown)."""
    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    try:
        with get_client(sync_client=True) as client:
            state = client.read_flow_run(ctx.flow_run.id).state
    except Exception:  # noqa: BLE001  (the server unreachable: not known to be a cancellation)
        return None
    if state is None or not (state.is_cancelling() or state.is_cancelled()):
        return None
    return "the flow run was cancelled"


def stop_children(before: set[int], grace: float = 10.0) -> int:
    """SIGTERM to the processes this one started since `before` (its children's pids then) and theirs: a stage's
    training or export child, msrun and its ranks, the data stage's pool; SIGKILL to those left after `grace` s.
    Returns how many there were. (A runner's cancellation signals only the flow process where it does not
    isolate a process group; a child left running would go on training, holding the stage's lock.)"""
    return stop_descendants(grace, before=before)


def cancellable(fn):
    """A flow body whose cancelled run ends Cancelled in its logs as in its states.

    A runner (scripts/serve.py, a worker) cancels a flow run by putting it in Cancelling and sending SIGTERM;
    the task running then ends Cancelled (`_stage_body`; Prefect would say Crashed) and the flow goes down
    Prefect's cancellation path (a TerminationSignal): "Flow run was cancelled.", then the runner records
    Cancelled once the process is gone. Prefect's engine leaves that state to the runner and so logged
    "Finished in state Running()"; it logs the Cancelled state this sets on the run it holds instead.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (RunCancelled, TerminationSignal) as exc:
            why = str(exc) if isinstance(exc, RunCancelled) else cancelled_run()
            if why is None:  # a SIGTERM that is no cancellation: Prefect's crash path
                raise
            print(f"cancelled: {why}")
            ctx = FlowRunContext.get()
            if ctx is not None and ctx.flow_run is not None:
                ctx.flow_run.state = Cancelled(message=why)
            if isinstance(exc, TerminationSignal):
                raise
            raise TerminationSignal(signal.SIGTERM) from None

    return wrapper


def run_stage(task_obj, call: StageCall, **options):
    """Run `call` through its stage task so that Prefect's cache agrees with the artifact store; returns the
    task's result. `options` go to the task (eval: selection).

    When the store lacks the artifact (never built, or deleted), Prefect's cache record for
    the key is refreshed (the task runs); when the store has it, Prefect reports Cached, and
    the cached artifact's metrics are published all the same (publish_cached).
    """
    state = task_obj.with_options(refresh_cache=call.cached() is None)(call, **options, return_state=True)
    if state.is_cancelled():  # the flow run is being cancelled (_stage_body): end the flow Cancelled too
        raise RunCancelled(state.message or f"{call.stage} was cancelled")
    result = state.result()  # raises the task's own error when it failed
    if state.name == "Cached":
        for path in result.values() if isinstance(result, dict) else [result]:
            publish_cached(path)
    return result


def _built(call: StageCall, **options) -> str:
    """A stage task's body: the stage's artifact (built, or found by the stage), its metrics published."""
    path = call.run(**options)
    publish_metrics(call.stage, path)
    return str(path)


_CACHED_BY_KEY = dict(cache_key_fn=_cache_key, persist_result=True, result_serializer="json")


def _retry_helps(task, task_run, state) -> bool:
    """Prefect retries a training task only when a rerun could succeed (tasks/runtime/supervise.is_permanent):
    a bad config, a corrupt or foreign artifact, or a non-finite run fails the same way every time."""
    exc = state.data
    return not (isinstance(exc, BaseException) and is_permanent(exc))


_RETRIED = dict(retries=1, retry_delay_seconds=2, retry_condition_fn=_retry_helps)


# ----------------------------------------------------------------------------- the stages


@task(name="convert", **_CACHED_BY_KEY)
@_stage_body
def convert_task(call: StageCall) -> str:
    """A GGUF file or a Hugging Face directory as a model artifact (dequantized to float32)."""
    return _built(call)


def resolve_init(store: ArtifactStore, pipeline: str, init_from: str | None) -> str | None:
    """The model artifact pretraining starts from: a GGUF file or an HF directory through the convert task
    (cached like every stage), anything else looked up in the store (a path, stage/key or key)."""
    path = runner.resolve_init(store, pipeline, init_from, run=lambda call: run_stage(convert_task, call))
    return str(path) if path else None


@task(name="data", **_CACHED_BY_KEY)
@_stage_body
def data_task(call: StageCall) -> str:
    return _built(call)


@task(name="pretrain", **_CACHED_BY_KEY, **_RETRIED)
@_stage_body
def pretrain_task(call: StageCall) -> str:
    """Trains in a supervised child process; a Prefect retry resumes from the newest checkpoint."""
    return _built(call)


@task(name="finetune", **_CACHED_BY_KEY, **_RETRIED)
@_stage_body
def finetune_task(call: StageCall) -> dict[str, str]:
    """LoRA/full fine-tuning in a supervised child, then the merge eval and export consume."""
    path = _built(call)
    return {"finetune": path, "merged": str(merge(call.store, Path(path)))}


@task(name="eval", **_CACHED_BY_KEY)
@_stage_body
def eval_task(call: StageCall, selection: dict[str, str] | None = None) -> str:
    """Perplexity on the held-out split, lm-eval tasks, sample generations.

    selection: which model and why (recorded in the manifest; not part of the cache key)."""
    return _built(call, selection=selection)


def run_eval(
    store: ArtifactStore, cfg: PipelineConfig, choice, data_artifact: str | None, refresh: bool = False
) -> str:
    """The eval task on the model `choice` names (tasks.stages.upstream.ModelChoice): prints which model and why,
    notes when it is not the model of the pipeline's previous eval report, and publishes `eval-report-<pipeline>`
    (also when the eval was cached)."""
    selection = eval_selection(store, cfg.name, choice)
    print(f"eval: {choice.line()}")
    if "note" in selection:
        print(f"eval: note: {selection['note']}")
    call = prepare("eval", store, cfg, model_artifact=choice.path, data_artifact=data_artifact, refresh=refresh)
    path = run_stage(eval_task, call, selection=selection)
    publish_eval_report(path, cfg.name, selection)
    return path


@task(name="export", **_CACHED_BY_KEY)
@_stage_body
def export_task(call: StageCall) -> str:
    """MindIR + ONNX, each verified by reloading and comparing logits (in a child process)."""
    return _built(call)


# ----------------------------------------------------------------------------- UI artifacts


def _slug(s: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in s.lower()).strip("-")[:60]


def publish_metrics(stage: str, path: str | Path) -> None:
    """The stage's manifest metrics as a Prefect table artifact."""
    m = ArtifactStore.read_manifest(path)
    rows = _metrics_table(m)
    create_table_artifact(
        key=_slug(f"{stage}-metrics"), table=rows, description=f"{stage} artifact {m['key']} ({path})"
    )


def _metrics_table(m: dict[str, Any]) -> list[dict[str, str]]:
    return [
        {"metric": k, "value": (f"{v:.6g}" if isinstance(v, float) else str(v))}
        for k, v in m.get("metrics", {}).items()
        if not isinstance(v, (dict, list))
    ]


def publish_cached(path: str | Path) -> None:
    """A Cached stage: its metrics table, and a short markdown artifact naming the cached artifact."""
    m = ArtifactStore.read_manifest(path)
    publish_metrics(m["stage"], path)
    rows = "\n".join(f"| {r['metric']} | {r['value']} |" for r in _metrics_table(m))
    md = (
        f"# {m['stage']}: cached\n\nNothing ran: the artifact for this stage's inputs already exists.\n\n"
        f"- stage: `{m['stage']}`\n- key: `{m['key']}`\n- artifact: [{path}]({Path(path).resolve().as_uri()})\n"
        f"- created: {m.get('created')}\n\n| metric | value |\n|---|---|\n{rows}\n"
    )
    create_markdown_artifact(
        key=_slug(f"{m['stage']}-cached"), markdown=md, description=f"cached {m['stage']} artifact {m['key']}"
    )


def publish_eval_report(path: str | Path, pipeline: str, selection: dict[str, str] | None) -> None:
    """`eval-report-<pipeline>`: which model and why (this run's choice), then the artifact's report.md."""
    report = Path(path) / "report.md"
    body = report.read_text(encoding="utf-8") if report.is_file() else f"# Evaluation {Path(path).name}\n"
    head, _, rest = body.partition("\n")
    rest = "\n".join(ln for ln in rest.splitlines() if not ln.startswith(("Model: `", "**Note: the model changed")))
    md = "\n".join([head, "", *selection_lines(selection), f"Eval artifact: `{path}`", "", rest.lstrip("\n")])
    model = (selection or {}).get("artifact", "?")
    create_markdown_artifact(key=_slug(f"eval-report-{pipeline}"), markdown=md, description=f"eval of {model}")


def publish_lineage(store: ArtifactStore, path: str | Path) -> str:
    """The lineage of an artifact as a Prefect markdown artifact (a nested list and tables; Prefect's markdown
    renders no mermaid); returns the text tree."""
    tree = lineage_tree(store, path)
    create_markdown_artifact(
        key=_slug(f"lineage-{tree['stage']}"), markdown=render(tree, "markdown"), description=f"lineage of {path}"
    )
    return render(tree, "text")
