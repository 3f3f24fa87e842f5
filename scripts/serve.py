"""Register and serve the deployments on a Prefect server (PREFECT_API_URL), until interrupted.

    prefect server start                     # in another terminal (or any reachable server)
    python scripts/serve.py [--pipeline demo] [--artifacts DIR] [--cron "0 3 * * 1"] [--all-pipelines]
    prefect deployment run 'full-pipeline/full-pipeline'

Deployments of --pipeline only: full-pipeline/full-pipeline, one per stage (data-stage/data-only,
pretrain-stage/pretrain-only, …, eval-stage/eval-only) and continued-pretraining/continued (on
demand), their `pipeline` parameter defaulting to it; and continued-pretraining/scheduled-<pipeline>
when its `continued.schedule` sets a cron (`--cron` gives it one, or replaces its cron). Serving
all: the on-demand deployments run any pipeline of the file (`prefect deployment run
'full-pipeline/full-pipeline' --param pipeline=tiny`), and `--all-pipelines` also schedules every
pipeline whose `continued.schedule` is set (continued-pretraining/scheduled-<name> for each, what
prefect.yaml declares). Parameters of every deployment: pipeline, config, artifacts (and, for the
continued ones, inbox and base_model: see flows/continued.py).

Stopping: SIGTERM or SIGINT (Ctrl-C) stops it within `--stop-timeout` seconds (default 4).
In-flight flow runs and everything they started get SIGTERM at once; when they are gone the
runner stops and pauses the schedules; whatever still runs at the deadline is killed
(SIGKILL) and serve exits. A second signal skips the wait. (prefect.serve alone took up to
14 s: its shutdown polls a cancelled run every 3 s, then loads the flow code again for
cancellation hooks; and on SIGINT it left the runs' worker processes running.)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def schedules(config: str, only: str | None = None) -> dict[str, tuple[str, str]]:
    """{pipeline: (cron, timezone)} for every pipeline of the file (or the one `only` names) whose
    continued.schedule is set."""
    from tasks.config.loader import read_pipelines_file, resolve_pipeline
    from tasks.config.schema import ConfigError

    out = {}
    for name in [only] if only else read_pipelines_file(config)["pipelines"]:
        try:
            cfg = resolve_pipeline(config, name, check_files=False)
        except ConfigError as exc:
            print(f"serve: pipeline {name!r} skipped ({exc.errors[0]})", file=sys.stderr)
            continue
        if cfg.continued.schedule is not None:
            out[name] = (cfg.continued.schedule.cron, cfg.continued.schedule.timezone)
    return out


def deployments(
    pipeline: str,
    config: str,
    artifacts: str,
    cron: str | None = None,
    inbox: str | None = None,
    all_pipelines: bool = False,
):
    """The deployments of `pipeline` (its schedule's among them); with all_pipelines, every pipeline's schedule."""
    from prefect.schedules import Cron

    import flows  # noqa: F401  (its Prefect defaults must be set before Prefect is imported)
    from flows import stage_flows
    from flows.continued import continued_pretraining
    from flows.full_pipeline import full_pipeline

    config, artifacts = str(Path(config).resolve()), str(Path(artifacts).resolve())
    params = {"pipeline": pipeline, "config": config, "artifacts": artifacts}
    out = [full_pipeline.to_deployment(name="full-pipeline", parameters=params)]
    for name, fl in stage_flows.STAGE_FLOWS.items():
        out.append(fl.to_deployment(name=f"{name}-only", parameters=params))
    extra = {"inbox": inbox} if inbox else {}
    out.append(continued_pretraining.to_deployment(name="continued", parameters=dict(params, **extra)))
    crons = schedules(config, None if all_pipelines else pipeline)
    if cron:
        crons[pipeline] = (cron, "UTC")
    for name, (expr, tz) in crons.items():
        p = {"pipeline": name, "config": config, "artifacts": artifacts, **(extra if name == pipeline else {})}
        out.append(
            continued_pretraining.to_deployment(
                name=f"scheduled-{name}", parameters=p, schedule=Cron(expr, timezone=tz)
            )
        )
    return out


class _Stopper:
    """SIGTERM/SIGINT: terminate the flow runs, stop the runner, force the exit at the deadline."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.runner = None
        self.procs: list = []
        self.signalled: str | None = None

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.on_signal)

    def on_signal(self, signum: int, _frame=None) -> None:
        import psutil

        name = signal.Signals(signum).name
        if self.signalled is not None:
            self._exit(f"{name} again: stopping now")
        self.signalled = name
        me = psutil.Process()
        runs, self.procs = me.children(), me.children(recursive=True)
        for p in self.procs:
            try:
                p.terminate()
            except psutil.Error:
                pass
        runner = self.runner
        if runner is None or not getattr(runner, "started", False):
            self._exit(f"{name} while starting: stopped")
        print(
            f"serve: {name}: terminating {len(runs)} flow run(s), then stopping the runner "
            f"(at most {self.timeout:g} s)",
            file=sys.stderr,
            flush=True,
        )
        runner.stopping = True  # submit no new runs
        threading.Thread(target=self._stop, name="serve-stop", daemon=True).start()

    def _stop(self) -> None:
        import psutil

        deadline = time.monotonic() + self.timeout
        psutil.wait_procs(self.procs, timeout=self.timeout / 2)
        try:
            self.runner.execute_in_background(self.runner.astop)  # cancel loops, pause schedules, return
        except Exception as exc:  # noqa: BLE001  (the deadline below still ends the process)
            print(f"serve: runner did not stop cleanly ({exc})", file=sys.stderr, flush=True)
        time.sleep(max(0.0, deadline - time.monotonic()))
        self._exit(f"{self.signalled}: runner still stopping after {self.timeout:g} s; killed what was left")

    def _exit(self, why: str) -> None:
        import psutil

        left = {p for p in self.procs if p.is_running()}
        try:
            left |= set(psutil.Process().children(recursive=True))
        except psutil.Error:
            pass
        for p in left:
            try:
                p.kill()
            except psutil.Error:
                pass
        print(f"serve: {why}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)


def serve(deps: list, stop_timeout: float) -> None:
    """prefect.serve(*deps) with a bounded shutdown (see the module doc)."""
    import asyncio

    from prefect.runner import Runner
    from prefect.settings import PREFECT_API_URL

    stopper = _Stopper(stop_timeout)
    stopper.install()

    class _Runner(Runner):
        def handle_sigterm(self, *args, **kwargs) -> None:  # Runner.start installs this for SIGTERM
            stopper.on_signal(signal.SIGTERM)

    runner = _Runner(pause_on_shutdown=True)
    for d in deps:
        runner.add_deployment(d)
    names = [f"{d.flow_name}/{d.name}" for d in deps]
    print(
        f"Serving {len(deps)} deployments on {PREFECT_API_URL.value() or 'the ephemeral API'}:\n  "
        + "\n  ".join(names)
        + f"\nTo trigger one: prefect deployment run '{names[0]}'. Stop with Ctrl-C or SIGTERM.",
        flush=True,
    )
    stopper.runner = runner
    asyncio.run(runner.start())
    print("serve: stopped", file=sys.stderr, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--pipeline",
        default="demo",
        help="the pipeline whose deployments to register (default demo); the on-demand ones run any "
        "pipeline with `prefect deployment run ... --param pipeline=NAME`",
    )
    ap.add_argument(
        "--all-pipelines",
        action="store_true",
        help="also register continued-pretraining/scheduled-<name> for every pipeline of --config whose "
        "continued.schedule is set (as prefect.yaml does), not only --pipeline's",
    )
    ap.add_argument("--config", default=str(REPO / "pipelines.yaml"))
    ap.add_argument("--artifacts", default=str(REPO / "artifacts"))
    ap.add_argument(
        "--cron",
        default=os.environ.get("MSLLM_CONTINUED_CRON") or None,
        help="a schedule for --pipeline's continued-pretraining/scheduled-<pipeline> (default: its "
        "continued.schedule in the config)",
    )
    ap.add_argument("--inbox", default=None, help="inbox directory (default: the pipeline's continued.inbox)")
    ap.add_argument(
        "--stop-timeout",
        type=float,
        default=4.0,
        help="seconds from SIGTERM/SIGINT to exit; flow runs still running then are killed (default 4)",
    )
    a = ap.parse_args()
    _Stopper(a.stop_timeout).install()  # quiet, prompt exit while importing and registering
    serve(deployments(a.pipeline, a.config, a.artifacts, a.cron or None, a.inbox, a.all_pipelines), a.stop_timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
