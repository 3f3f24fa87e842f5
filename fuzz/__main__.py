"""`python -m fuzz TARGET|all [--examples N] [--seconds S] [--until N] [--coverage]`: run fuzz targets
(fuzz/targets.py), each in a child process of its own under an address-space limit, and print one JSON line per
target: examples run, seconds, the slowest input, and the violations (the input, shortened, and what happened).
Exit 1 when any target has one.

A child runs hypothesis rounds of --examples inputs with fresh random seeds until --seconds have passed (at least one
round) or --until inputs have run, with no example database (nothing is written to the tree). With --coverage the
child runs under coverage.py and its line reports the line coverage of the reader's own code (the target's `covers`;
the tracer slows a run 2-3x, so long runs go without it). Every time is the child's CPU time, not the clock's: a run
can be paused (SIGSTOP, while a benchmark needs the machine quiet) and continued (SIGCONT) without false hangs, and
--seconds is CPU seconds of fuzzing on a shared machine. Per input: SIGPROF at twice SECONDS_PER_INPUT of CPU
interrupts a hang in Python code; the parent kills a child that outlives its CPU budget by a minute (a hang in native
code) and reports it, as it reports a child killed by a signal (a crash)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from tasks.training.hardware import process_cpu_seconds

REPO = Path(__file__).resolve().parent.parent
MEMORY_LIMIT = 6 * 2**30
"""RLIMIT_AS of a target's child: far above what any reader here needs on these inputs (< 1 GB), far below a
machine's memory; an allocation sized by a crafted count fails as MemoryError (a finding) instead of swapping."""


class Finding(Exception):
    """An input broke the contract (recorded in the child's stats): stops hypothesis's round after shrinking."""


class Hang(BaseException):
    """One input ran past twice SECONDS_PER_INPUT of CPU (raised by SIGPROF inside the target)."""


def _child(name: str, examples: int, seconds: float, until: int = 0, measure: bool = False) -> dict:
    cov = None
    if measure:
        import coverage

        cov = coverage.Coverage(data_file=None, branch=False, include=[str(REPO / "*")])
        cov.start()
    from hypothesis import HealthCheck, given, settings

    from fuzz.targets import SECONDS_PER_INPUT, TARGETS

    t = TARGETS[name]
    allowed = t.allowed()
    strategy = t.strategy()
    found: list[dict] = []
    stats = {"target": name, "reads": t.what, "examples": 0, "allowed_errors": 0, "slowest_s": 0.0, "violations": []}

    def alarm(*_):
        raise Hang(f"no answer in {2 * SECONDS_PER_INPUT:g} s")

    signal.signal(signal.SIGPROF, alarm)

    current = os.environ.get("MSLLM_FUZZ_CURRENT")
    progress = os.environ.get("MSLLM_FUZZ_PROGRESS")

    def one(data) -> None:
        stats["examples"] += 1
        if current:  # the input in flight, for the parent to report if this process hangs in native code or dies
            Path(current).write_text(repr(data))
        with tempfile.TemporaryDirectory(prefix="msllm-fuzz-") as d:
            t0 = time.process_time()
            signal.setitimer(signal.ITIMER_PROF, 2 * SECONDS_PER_INPUT)
            try:
                t.run(data, Path(d))
            except allowed:
                stats["allowed_errors"] += 1
            except (Exception, Hang) as exc:  # noqa: BLE001 - the finding itself
                found.append(
                    {
                        "input": repr(data)[:400],
                        "error": f"{type(exc).__name__}: {str(exc)[:300]}",
                        "where": traceback.format_exc(limit=-3)[-1200:],
                    }
                )
                raise Finding from None  # hypothesis shrinks it: the last one recorded is the smallest
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
            dt = time.process_time() - t0
            stats["slowest_s"] = max(stats["slowest_s"], round(dt, 3))
            if dt > SECONDS_PER_INPUT:
                found.append({"input": repr(data)[:400], "error": f"took {dt:.1f} s"})
                raise Finding

    run = settings(
        max_examples=examples,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=False,
    )(given(strategy)(one))
    t0, w0 = time.process_time(), time.perf_counter()
    while True:
        try:
            run()
        except (Finding, ExceptionGroup):  # hypothesis groups distinct failures it found in one round
            if not found:
                raise
            stats["violations"] = found[-1:] + found[:1] if len(found) > 1 else found  # the smallest, the first
            break
        if progress:  # the counts so far, for a run stopped before it reports (a long run spanning sessions)
            done = {**stats, "seconds": round(time.process_time() - t0, 1), "finished": False}
            tmp = Path(f"{progress}.tmp")
            tmp.write_text(json.dumps(done) + "\n")
            tmp.replace(progress)
        if time.process_time() - t0 >= seconds or (until and stats["examples"] >= until):
            break
    stats["seconds"] = round(time.process_time() - t0, 1)  # CPU seconds
    stats["wall_seconds"] = round(time.perf_counter() - w0, 1)
    if cov is not None:
        cov.stop()
        stats["coverage"] = _coverage(cov, t.covers)
    return stats


def _spans(path: Path, names: list[str]) -> list[tuple[int, int]]:
    """The line spans of the named top-level functions/classes (or `Class.method`) of a module."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    spans = []
    for name in names:
        body, node = tree.body, None
        for part in name.split("."):
            node = next((n for n in body if getattr(n, "name", None) == part), None)
            if node is None:
                raise SystemExit(f"fuzz: {path.name} has no {name!r} (a target's covers is stale)")
            body = getattr(node, "body", [])
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        spans.append((first, node.end_lineno))
    return spans


def _coverage(cov, covers: tuple[str, ...]) -> dict:
    """Statements run / statements, per entry of a target's `covers`, and in all."""
    out, run_all, total_all = {}, 0, 0
    for spec in covers:
        rel, _, names = spec.partition(":")
        path = REPO / rel
        _, statements, _, missing, _ = cov.analysis2(str(path))
        if names:
            spans = _spans(path, names.split(","))
            statements = [ln for ln in statements if any(a <= ln <= b for a, b in spans)]
        missing_set = set(missing)
        ran = sum(ln not in missing_set for ln in statements)
        out[spec] = f"{ran}/{len(statements)}"
        run_all, total_all = run_all + ran, total_all + len(statements)
    out["all"] = f"{run_all}/{total_all} ({100 * run_all / max(total_all, 1):.0f}%)"
    return out


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def _keep(current: Path, name: str) -> str:
    """The input in flight when a child hung or died: kept whole under the seeds' cache (findings/), and its start."""
    if not current.is_file():
        return ""
    from fuzz.seeds import CACHE

    text = current.read_text()
    keep = CACHE / "findings" / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.repr"
    keep.parent.mkdir(parents=True, exist_ok=True)
    keep.write_text(text)
    return f"{text[:600]} ... (whole input: {keep})"


def _run_target(
    name: str, examples: int, seconds: float, until: int = 0, measure: bool = False, progress: str = ""
) -> dict:
    cmd = [sys.executable, "-m", "fuzz", name, "--child", "--examples", str(examples), "--seconds", str(seconds)]
    cmd += ["--until", str(until)] + (["--coverage"] if measure else [])
    from fuzz.seeds import seeds

    seeds()  # built once, here, before the memory limit
    budget = seconds + 60 + 30 * examples / 100  # CPU seconds: a round always completes; a native hang does not
    with tempfile.TemporaryDirectory(prefix="msllm-fuzz-run-") as d:
        current = Path(d) / "current"
        env = {**os.environ, "PYTHONHASHSEED": "0", "MSLLM_FUZZ_CURRENT": str(current)}
        if progress:
            env["MSLLM_FUZZ_PROGRESS"] = f"{progress}.{name}.json"
        with open(Path(d) / "out", "w+") as out, open(Path(d) / "err", "w+") as err:
            child = subprocess.Popen(
                cmd, cwd=REPO, stdout=out, stderr=err, text=True, preexec_fn=_limit_memory, env=env
            )
            while child.poll() is None:  # a hang in native code burns CPU past the budget
                try:
                    cpu = process_cpu_seconds(child.pid)
                except OSError:
                    cpu = 0.0
                if cpu > budget:
                    child.kill()
                    child.wait()
                    last = _keep(current, name)
                    why = (
                        f"the child ran past {budget:.0f} CPU s: a hang outside Python code (the alarm could not "
                        "interrupt it)"
                    )
                    return {"target": name, "violations": [{"error": why, "input": last}]}
                time.sleep(0.5)
            out.seek(0), err.seek(0)
            stdout, stderr = out.read(), err.read()
        if child.returncode < 0 or not stdout.strip():
            tail = (stderr.strip().splitlines() or ["(no output)"])[-5:]
            last = _keep(current, name)
            why = f"the child exited {child.returncode}: {' | '.join(tail)}"
            return {"target": name, "violations": [{"error": why, "input": last}]}
    return json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from fuzz.targets import TARGETS

    ap = argparse.ArgumentParser(prog="python -m fuzz", description=__doc__.split("\n\n")[0])
    ap.add_argument("target", nargs="?", default="all", help=f"one of {', '.join(TARGETS)}, or all")
    ap.add_argument("--examples", type=int, default=200, help="inputs per hypothesis round (default 200)")
    ap.add_argument("--seconds", type=float, default=0.0, help="run rounds until this many seconds have passed")
    ap.add_argument("--until", type=int, default=0, help="stop a target once this many inputs have run (0: no limit)")
    ap.add_argument("--coverage", action="store_true", help="report the line coverage of each reader's own code")
    ap.add_argument(
        "--progress",
        default="",
        metavar="PREFIX",
        help="after every round, write the counts so far to PREFIX.<target>.json (a run stopped before it reports)",
    )
    ap.add_argument("--list", action="store_true", help="list the targets and what each reads")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.list:
        for t in TARGETS.values():
            print(f"{t.name:14} {t.what}")
        return 0
    if a.child:
        print(json.dumps(_child(a.target, a.examples, a.seconds, a.until, a.coverage)), flush=True)
        return 0
    names = list(TARGETS) if a.target == "all" else [a.target]
    if unknown := [n for n in names if n not in TARGETS]:
        ap.error(f"unknown target {unknown[0]!r}; one of {', '.join(TARGETS)} or all")
    bad = 0
    for n in names:
        res = _run_target(n, a.examples, a.seconds, a.until, a.coverage, a.progress)
        bad += bool(res["violations"])
        print(json.dumps(res), flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
