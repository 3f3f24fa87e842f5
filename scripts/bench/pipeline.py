"""Each stage's wall time of a pipeline run end to end through Prefect's `full-pipeline` flow, as a user runs it.

    .venv/bin/python scripts/bench/pipeline.py                       # smollm2 as shipped (15-40 min: a quiet machine)
    .venv/bin/python scripts/bench/pipeline.py --set eval.limit=null # the same with the full eval budget
    .venv/bin/python scripts/bench/pipeline.py --pipeline tiny --tag smoke --results /tmp/pipeline_smoke.jsonl
    .venv/bin/python scripts/bench/pipeline.py --prefect both        # alone, then beside `prefect server start`

What runs: the README's command, `python -m flows.full_pipeline --pipeline X --artifacts FRESH [--set K=V ...]
[--init-from SRC]`, in a subprocess from the repo root, on Prefect's embedded (ephemeral) server:

- a fresh artifact root (a temp dir, or `--artifacts DIR`, which must be empty): nothing is cached, every stage
  really runs (the line records each task run's final state; `all_ran` is false when one was Cached);
- a fresh PREFECT_HOME (PREFECT_API_URL unset), so the embedded server's database holds this flow run only and the
  user's own Prefect database is not touched; PREFECT_SERVER_ANALYTICS_ENABLED=false (../shared/PREFECT_NOTES.md);
  HF_DATASETS_OFFLINE / HF_HUB_OFFLINE default to 1 as in scripts/demo.py (the pipelines read nothing from the hub).

What it reads afterwards, with the Prefect client in a second process on the same PREFECT_HOME (the embedded server
is process-global, so the reading process starts its own on that database): the flow run and its task runs. A
stage's seconds are its task run's end_time - start_time (retries included): the artifacts' manifests record only
when an artifact was published (`created`), not when its build started, so Prefect's task runs are the source of
truth. `total_s` is the flow run's own wall time; `process_s` the subprocess's (adds interpreter start, imports and
the embedded server's first start on a fresh database, ~16 s on 2 cores: docs/PIPELINE.md); `outside_tasks_s` is
total_s less the task runs (config resolution, stage keys (hashing the inputs), the lineage). The merge of LoRA
into the base model runs inside the finetune task, so its time is finetune's. `convert_task_run`: a `convert` task
run exists; `convert_artifact`: that task run has the `convert-metrics` table artifact every stage publishes
(flows/stages.py publish_metrics). A pipeline without `pretrain.init_from` (tiny) has no convert (both false).

`--prefect server` starts `prefect server start` (a free loopback port, the run's PREFECT_HOME) before the flow and
points the flow and the reader at it (PREFECT_API_URL), as a user with a server runs the pipeline; `server_cpu_s` is
the CPU the server's processes used during the run (on 2 cores, taken from the stages). `--prefect both` runs the
pipeline with the embedded server, then beside the standalone one, and puts each stage's slowdown (percent) into the
second line (`slowdown_vs_embedded`).

Peak RSS: the summed RSS of the flow process and all its descendants (training/export children, the data pool,
the embedded server), sampled with psutil every 0.5 s; what the machine must hold at once. Not
resource.getrusage(RUSAGE_CHILDREN).ru_maxrss: that is the largest single descendant's peak, not the tree's sum,
and a child forked from a large parent (pytest with MindSpore loaded) starts with the parent's image folded in
(tasks.training.hardware.peak_rss_bytes). Sampling can miss a spike shorter than 0.5 s.

Prints one JSON line (scripts/bench/host.py labels: date, CPU, ISA; `threads`: the CPUs the run may use, which
MindSpore's defaults take) and appends it to docs/bench/results.jsonl (`--results`, `--tag`); then
`scripts/bench/report.py` writes docs/BENCHMARKS.md and the smollm2 stage-time table in docs/REAL_MODELS.md.
Whether a run fits the documented time is judged here, by this bench, not by a timed test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

FLOW = "full-pipeline"
SAMPLE_S = 0.5
FETCH = {"smollm2": "bash scripts/fetch_smollm2.sh"}  # what provides a pipeline's init_from file


class BenchError(RuntimeError):
    """The run could not be measured: one line saying why (and where its log is)."""


def pipeline_config(pipeline: str, config: str | Path = "pipelines.yaml", overrides: list[str] | tuple = ()):
    from tasks.config.loader import resolve_pipeline

    return resolve_pipeline(str((REPO / config).resolve()), pipeline, list(overrides))


def missing_input(
    pipeline: str,
    config: str | Path = "pipelines.yaml",
    overrides: list[str] | tuple = (),
    init_from: str | None = None,
) -> str | None:
    """One line when the file the pipeline starts from (init_from, e.g. smollm2's GGUF) is missing; else None.
    A fresh artifact root holds no artifact, so init_from can only be a file or directory here. Another invalid
    setting raises the loader's ConfigError."""
    from tasks.config.schema import ConfigError

    try:
        pipeline_config(pipeline, config, overrides)
    except ConfigError as exc:  # the loader checks pretrain.init_from's file itself, naming the fetch script
        if missing := [e for e in exc.errors if ".init_from:" in e and "does not exist" in e]:
            return missing[0]
        raise
    src = Path(init_from) if init_from else None
    if src is None or src.exists():
        return None
    how = FETCH.get(pipeline)
    return f"{src} is missing" + (f": run `{how}` first" if how else "") + f" (pipeline {pipeline}'s init_from)"


class TreeRSS(threading.Thread):
    """The peak of the summed RSS of a process and its descendants, sampled every SAMPLE_S s (see the docstring)."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self.stop.is_set():
            total = 0
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            for p in procs:
                try:
                    total += p.memory_info().rss
                except psutil.Error:  # ended between the listing and the read
                    pass
            self.peak = max(self.peak, total)
            self.stop.wait(SAMPLE_S)


def _env(prefect_home: Path, api_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PREFECT_HOME=str(prefect_home), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    env.pop("PREFECT_API_URL", None)  # the embedded server, never one this shell points at ...
    if api_url:  # ... unless the bench started a server of its own beside the flow (--prefect server)
        env["PREFECT_API_URL"] = api_url
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


class PrefectServer:
    """`prefect server start` on a free loopback port with the run's own PREFECT_HOME, as the README's "Using it with
    Prefect" starts one: a separate process (uvicorn, the API, its database and background services) beside the
    flow, which talks to it through PREFECT_API_URL. `cpu_s()`: the CPU seconds its process tree has used."""

    def __init__(self, home: Path, log: Path, timeout: float = 120):
        import socket
        import urllib.request

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}/api"
        env = dict(_env(home), PREFECT_SERVER_API_HOST="127.0.0.1", PREFECT_SERVER_API_PORT=str(port))
        prefect = str(Path(sys.executable).with_name("prefect"))
        cmd = [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise BenchError(f"`prefect server start` exited {self.proc.returncode}; log: {log}\n{_tail(log)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(1)
        self.stop()
        raise BenchError(f"the Prefect server at {self.url} did not answer /health in {timeout:g} s; log: {log}")

    def cpu_s(self) -> float:
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            total = 0.0
            for p in [root, *root.children(recursive=True)]:
                try:
                    t = p.cpu_times()
                    total += t.user + t.system
                except psutil.Error:
                    pass
            return total
        except psutil.Error:
            return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


def _tail(log: Path, n: int = 40) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _run_flow(cmd: list[str], env: dict, log: Path, timeout: float | None) -> tuple[int, float, int]:
    """The flow subprocess (its own session, so a timeout stops its whole group): (returncode, seconds, peak RSS)."""
    t0 = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        rss = TreeRSS(proc.pid)
        rss.start()
        try:
            rc = proc.wait(timeout=timeout)
        except BaseException:  # a timeout or Ctrl-C: stop the flow and everything it started (its process group)
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                os.killpg(proc.pid, signal.SIGKILL)
            raise
        finally:
            rss.stop.set()
            rss.join(timeout=5)
    return rc, time.perf_counter() - t0, rss.peak


def read_runs(prefect_home: Path, timeout: float = 300, api_url: str | None = None) -> dict:
    """The flow run and its task runs and artifacts, as the Prefect client reads them from that PREFECT_HOME's
    embedded server, or from the server at `api_url` (in a child process: `--read-prefect`)."""
    r = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--read-prefect", str(prefect_home)],
        cwd=REPO,
        env=_env(prefect_home, api_url),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RUNS ")), None)
    if r.returncode or line is None:
        raise BenchError(f"reading the flow run from {prefect_home} failed: {(r.stderr or r.stdout).strip()[-800:]}")
    return json.loads(line[len("RUNS ") :])


def _read_prefect() -> dict:
    """In the reading process: the newest `full-pipeline` flow run, its task runs (by start) and its artifacts."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    import flows  # noqa: F401  (the embedded server's startup timeout, before Prefect loads)

    def span(run) -> dict:
        s = (run.end_time - run.start_time).total_seconds() if run.start_time and run.end_time else None
        return {"state": run.state.name if run.state else None, "start": str(run.start_time), "s": s}

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=[FLOW])), sort=FlowRunSort.START_TIME_DESC, limit=1
        )
        if not runs:
            raise SystemExit(f"no {FLOW} flow run in this PREFECT_HOME")
        fr = runs[0]
        only = FlowRunFilter(id=FlowRunFilterId(any_=[fr.id]))
        trs = sorted(c.read_task_runs(flow_run_filter=only), key=lambda t: t.start_time or t.expected_start_time)
        arts = c.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[fr.id])))
    tasks = [{"id": str(t.id), "name": t.name.rsplit("-", 1)[0], **span(t)} for t in trs]
    return {
        "flow": {"id": str(fr.id), **span(fr)},
        "tasks": tasks,
        "artifacts": [
            {"key": a.key, "type": a.type, "task_run_id": str(a.task_run_id) if a.task_run_id else None} for a in arts
        ],
    }


def stage_times(runs: dict) -> tuple[dict[str, float], dict[str, str]]:
    """{stage: seconds} and {stage: final state} from the task runs, in the order they started; a stage that runs
    twice (a continued pipeline's data and pretrain) is `name`, then `name_2`."""
    times: dict[str, float] = {}
    states: dict[str, str] = {}
    for t in runs["tasks"]:
        name, i = t["name"], 2
        while name in times:
            name, i = f"{t['name']}_{i}", i + 1
        times[name] = round(t["s"], 1) if t["s"] is not None else None
        states[name] = t["state"]
    return times, states


def convert_checks(runs: dict) -> dict[str, bool]:
    """convert_task_run: a `convert` task run exists; convert_artifact: one of them has the `convert-metrics` table."""
    ids = {t["id"] for t in runs["tasks"] if t["name"] == "convert"}
    art = any(a["task_run_id"] in ids and a["key"] == "convert-metrics" for a in runs["artifacts"])
    return {"convert_task_run": bool(ids), "convert_artifact": art}


def measure(
    pipeline: str = "smollm2",
    *,
    config: str = "pipelines.yaml",
    overrides: list[str] | tuple = (),
    artifacts: str | Path | None = None,
    init_from: str | None = None,
    keep: bool = False,
    timeout: float | None = None,
    prefect: str = "embedded",
) -> dict:
    """Run `pipeline` through `python -m flows.full_pipeline` in a fresh artifact root and PREFECT_HOME; returns the
    figures of the bench's JSON line (without the host labels). `prefect`: "embedded" (the README's command: the
    flow starts Prefect's embedded server in its own process) or "server" (a `prefect server start` process beside
    the flow, which talks to it over HTTP, as a user with a server runs it; its CPU seconds over the run are
    `server_cpu_s`). Raises BenchError with one line on a missing input or an invalid pipeline, an artifact root
    that is not empty, or a failed or timed-out run (the flow's log is kept then, its path in the message)."""
    from tasks.config.schema import ConfigError

    overrides = list(overrides)
    try:
        if why := missing_input(pipeline, config, overrides, init_from):
            raise BenchError(why)
    except ConfigError as exc:
        raise BenchError("invalid pipeline: " + "; ".join(exc.errors)) from None
    cfg = pipeline_config(pipeline, config, overrides)
    work = Path(tempfile.mkdtemp(prefix=f"msllm-pipeline-{pipeline}-"))
    art = Path(artifacts).resolve() if artifacts else work / "artifacts"
    if art.exists() and any(art.iterdir()):
        shutil.rmtree(work)
        raise BenchError(f"--artifacts {art} is not empty: its artifacts would be cached; name a new directory")
    log, home = work / "flow.log", work / "prefect_home"
    cmd = [
        sys.executable,
        "-m",
        "flows.full_pipeline",
        "--pipeline",
        pipeline,
        "--config",
        str((REPO / config).resolve()),
        "--artifacts",
        str(art),
        *[x for o in overrides for x in ("--set", o)],
        *(["--init-from", str(Path(init_from).resolve())] if init_from else []),
    ]
    print(f"[pipeline bench] {' '.join(cmd[1:])}\n[pipeline bench] log: {log}", file=sys.stderr, flush=True)
    if prefect not in ("embedded", "server"):
        raise BenchError(f"--prefect {prefect}: embedded or server")
    server = PrefectServer(home, work / "server.log") if prefect == "server" else None
    try:
        load = os.getloadavg()[0]
        cpu0 = server.cpu_s() if server else 0.0
        try:
            rc, process_s, peak = _run_flow(cmd, _env(home, server and server.url), log, timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"the run took over {timeout:g} s and was stopped; log kept: {log}") from None
        server_cpu = server.cpu_s() - cpu0 if server else None
        if rc != 0:
            raise BenchError(f"the flow exited {rc}; log kept: {log}\n{_tail(log)}")
        runs = read_runs(home, api_url=server and server.url)
    finally:
        if server:
            server.stop()
    if runs["flow"]["state"] != "Completed":
        raise BenchError(f"the flow run ended {runs['flow']['state']}; log kept: {log}")
    times, states = stage_times(runs)
    total = runs["flow"]["s"]
    res = {
        "bench": "pipeline",
        "pipeline": pipeline,
        "overrides": overrides,
        "init_from": init_from,
        "eval": {"limit": cfg.eval.limit, "tasks": list(cfg.eval.tasks), "heldout_blocks": cfg.eval.heldout_blocks},
        "total_s": round(total, 1),
        "process_s": round(process_s, 1),
        "stages": times,
        "outside_tasks_s": round(total - sum(v for v in times.values() if v), 1),
        "states": states,
        "all_ran": all(s == "Completed" for s in states.values()),
        **convert_checks(runs),
        "peak_rss_gb": round(peak / 1e9, 2),
        "loadavg_before": round(load, 2),
        "prefect": "embedded" if server is None else "server beside (prefect server start)",
        "server_cpu_s": None if server_cpu is None else round(server_cpu, 1),
    }
    if keep:
        res["kept"] = str(work)
    else:  # the temp dir (with its artifacts, PREFECT_HOME and log); an --artifacts DIR stays where it was named
        shutil.rmtree(work, ignore_errors=True)
    return res


def slowdowns(alone: dict, beside: dict) -> dict[str, float]:
    """Each stage's (and the flow run's) time beside the server over its time with the embedded one, less 1, in
    percent: what the server process costs the stages on the same cores."""
    out = {
        k: round(100 * (beside["stages"][k] / v - 1), 1)
        for k, v in alone["stages"].items()
        if v and beside["stages"].get(k)
    }
    out["total"] = round(100 * (beside["total_s"] / alone["total_s"] - 1), 1)
    return out


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--read-prefect":  # the reading child (read_runs)
        print("RUNS " + json.dumps(_read_prefect()), flush=True)
        return
    from host import add_isa_arg, apply_isa, describe  # scripts/bench/ (this script's directory is sys.path[0])
    from report import add_record_args, record

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", default="smollm2")
    ap.add_argument("--config", default="pipelines.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="passed to the flow (--set K=V)")
    ap.add_argument("--init-from", default=None, help="passed to the flow")
    ap.add_argument(
        "--artifacts",
        default=None,
        help="a new (or empty) artifact root, kept afterwards (default: one in a temp dir, removed)",
    )
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (artifacts, PREFECT_HOME, flow.log)")
    ap.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    ap.add_argument(
        "--prefect",
        choices=["embedded", "server", "both"],
        default="embedded",
        help="embedded: the flow's own embedded server (the README's command); server: a `prefect server start` "
        "process beside the flow; both: one run each, embedded first, the second line with each stage's slowdown",
    )
    add_isa_arg(ap)  # --isa avx2: every library of the flow and its children capped at AVX2 (host.py)
    add_record_args(ap)
    a = ap.parse_args()
    apply_isa(a.isa)
    modes = ["embedded", "server"] if a.prefect == "both" else [a.prefect]
    if len(modes) > 1 and a.artifacts:
        raise SystemExit("pipeline bench: --prefect both runs twice, each in a fresh temp root: leave out --artifacts")
    alone = None
    for mode in modes:
        try:
            res = measure(
                a.pipeline,
                config=a.config,
                overrides=a.overrides,
                artifacts=a.artifacts,
                init_from=a.init_from,
                keep=a.keep,
                timeout=a.timeout,
                prefect=mode,
            )
        except BenchError as exc:
            raise SystemExit(f"pipeline bench: {exc}") from None
        if alone is not None:
            res["slowdown_vs_embedded"] = slowdowns(alone, res)
        alone = res
        record({"bench": "pipeline", **describe(len(os.sched_getaffinity(0))), **res}, a)


if __name__ == "__main__":
    main()
