"""Multi-process training: launching ranks with `msrun` and reporting how they failed.

Parent side (the pretrain/finetune stage's supervisor, when `parallel.device_num > 1`):

    err = launch("pretrain", "tasks.stages.pretrain:train", spec_path, cfg.parallel, log_dir)   # None on success

runs MindSpore's own launcher,

    msrun --worker_num=N --local_worker_num=N/node_num --master_addr=A --master_port=P
          --node_rank=R --log_dir=LOG --join=True tasks/runtime/launch/worker.py --stage pretrain --child spec.json

relays rank 0's log while the job runs, and on failure returns the failing rank's own
error on top of the last lines of its log (`LOG/worker_<rank>.log`; the scheduler's
log is `LOG/scheduler.log`). Collectives go over HCCL on Ascend, NCCL on GPU and
MindSpore's TCP backend on CPU. A job of several nodes that loses one (its host or the network to
it) fails with a `NodeLost` line naming the lost ranks, node and host (`lost_node_report`), which
the supervisor does not retry.

Inside a worker, each rank's place in the layout is tasks/runtime/mesh.py's `Mesh` (this room starts
processes; it does not know the model).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tasks.store.artifacts import ArtifactStore
from tasks.store.disk import atomic_write_json
from tasks.store.locks import held_locks_env, pid_alive

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "launch" / "worker.py"
MSRUN_NODE = Path(__file__).resolve().parent / "launch" / "msrun_node.py"
STOPPED_MARK = "[rank stopped early]"


# ----------------------------------------------------------------------------- parent side


def msrun_command(parallel, log_dir: Path, script: list[str]) -> list[str]:
    """The msrun command line running `script` (path and arguments) for `parallel` (a config ParallelSection)."""
    msrun = [shutil.which("msrun", path=_path_env()) or "msrun"]
    if parallel.node_rank > 0:  # node 0 hosts the scheduler, even when master_addr is also this host's
        msrun = [sys.executable, str(MSRUN_NODE)]
    local = parallel.device_num // parallel.node_num
    return [
        *msrun,
        f"--worker_num={parallel.device_num}",
        f"--local_worker_num={local}",
        f"--master_addr={parallel.master_addr}",
        f"--master_port={parallel.master_port}",
        f"--node_rank={parallel.node_rank}",
        f"--log_dir={log_dir}",
        "--join=True",
        f"--cluster_time_out={parallel.cluster_timeout}",
        *script,
    ]


def _path_env() -> str:
    # msrun starts workers with `python` from PATH: this interpreter's directory goes first
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def check_port(parallel) -> None:
    """On the master node, fail before launching when parallel.master_port is taken."""
    if parallel.node_rank != 0 or parallel.master_addr not in ("127.0.0.1", "localhost"):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed job's TIME_WAIT is no conflict
        try:
            s.bind(("127.0.0.1", parallel.master_port))
        except OSError:
            raise RuntimeError(
                f"parallel.master_port: port {parallel.master_port} on {parallel.master_addr} is in use "
                "(another msrun job?); set parallel.master_port to a free port"
            ) from None


def launch(stage: str, entry: str, spec_path: Path, parallel, log_dir: Path, relay: bool = True) -> str | None:
    """Run the stage's workers (`entry`: module:function) under msrun; None on success, else the failing rank's
    error on top.

    On a node other than 0 (`parallel.node_rank > 0`) success also waits for rank 0 (on node 0) to
    publish the artifact into the shared root, so that every node's command returns its path.
    """
    err = run_msrun(
        [str(WORKER), "--stage", stage, "--entry", entry, "--child", str(spec_path)],
        parallel,
        log_dir,
        label=stage,
        relay=relay,
    )
    if isinstance(err, NodeLost):
        return NodeLost(
            f"{err}; nothing was published: once every node is up, rerun the same command on each and "
            f"{stage} resumes from its newest checkpoint ({Path(spec_path).parent / 'checkpoints'})"
        )
    if err is None and parallel.node_rank > 0:
        err = wait_published(stage, spec_path, timeout=parallel.cluster_timeout, node=parallel.node_rank)
    return err


def wait_published(stage: str, spec_path: Path, timeout: float, node: int) -> str | None:
    """Wait for the artifact of the spec's key to appear in its root (published by node 0); None once it has."""
    spec = json.loads(Path(spec_path).read_text())
    store, t0 = ArtifactStore(spec["root"]), time.monotonic()
    while time.monotonic() - t0 < timeout:
        if store.lookup(stage, spec["key"]) is not None:
            return None
        time.sleep(1.0)
    return (
        f"node {node}: this node's ranks finished but node 0 did not publish "
        f"{stage}/{spec['key']} under {spec['root']} within {timeout:.0f}s (parallel.cluster_timeout); see node 0's "
        "log, and check that every node sees the same artifact root (a shared filesystem)"
    )


def run_msrun(script: list[str], parallel, log_dir: Path, *, label: str = "msrun", relay: bool = True) -> str | None:
    """Run `script` on every rank under msrun, relaying this node's first rank's log to stderr as it grows.

    None on success, else the failing rank's own error on top of its log's last lines.
    """
    check_port(parallel)
    if parallel.node_num > 1:  # each node its own log dir: the nodes may share the run dir (one filesystem)
        log_dir = log_dir / f"node_{parallel.node_rank}"
    if log_dir.exists():
        shutil.rmtree(log_dir)  # this attempt's logs only
    log_dir.mkdir(parents=True)
    if parallel.node_num > 1:  # who this node is, for the other nodes' reports should it be lost
        _write_node_file(log_dir, parallel)
    threads = max(1, (os.cpu_count() or 1) // max(1, parallel.device_num // parallel.node_num))
    env = {
        **os.environ,
        "PATH": _path_env(),
        "PYTHONUNBUFFERED": "1",
        "GLOG_v": os.environ.get("GLOG_v", "3"),
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OMP_NUM_THREADS": str(threads),
        **held_locks_env(),
    }  # rank 0 publishes under the parent's build lock
    cmd = msrun_command(parallel, log_dir, script)
    print(
        f"[{label}] msrun: {parallel.device_num} workers ({parallel.device_num // parallel.node_num} on this node), "
        f"logs in {log_dir}",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=str(REPO), start_new_session=True
    )  # its own process group: a failed job is stopped as a whole
    first = log_dir / f"worker_{parallel.node_rank * (parallel.device_num // parallel.node_num)}.log"
    pos, partial = 0, b""
    msrun_out = b""
    assert proc.stdout is not None
    os.set_blocking(proc.stdout.fileno(), False)
    failed_at = None
    while True:
        rc = proc.poll()
        if rc is None and failed_at is None and _some_rank_failed(log_dir):
            failed_at = time.monotonic()
        if rc is None and failed_at is not None and time.monotonic() - failed_at > _grace(log_dir, parallel):
            # a rank died; the others would wait in a collective until the cluster times out
            _stop_group(proc)
            rc = proc.wait()
        chunk = proc.stdout.read() or b""
        msrun_out = (msrun_out + chunk)[-20000:]
        if relay and first.is_file():
            with open(first, "rb") as f:
                f.seek(pos)
                new = f.read()
            pos += len(new)
            *lines, partial = (partial + new).split(b"\n")
            keep = [ln for ln in lines if not ln.startswith((b"[INFO]", b"[WARNING]", b"[DEBUG]"))]
            if keep:  # MindSpore's own C++ log lines stay in the rank's log file
                sys.stderr.buffer.write(b"\n".join(keep) + b"\n")
                sys.stderr.buffer.flush()
        if rc is not None:
            break
        time.sleep(0.5)
    if rc == 0:
        return None
    return lost_node_report(log_dir, parallel) or failure_report(log_dir, rc, msrun_out.decode("utf-8", "replace"))


FAIL_GRACE_S = 5.0  # after one rank logged its error, how long msrun gets to stop the job itself


def _grace(log_dir: Path, parallel) -> float:
    """How long after the first failure the job gets to end by itself before it is stopped.

    On node 0 of several, when a rank here failed in a collective (a peer went silent) and the
    scheduler has not yet named a lost node, long enough for its heartbeat verdict (MS_NODE_TIMEOUT):
    that verdict is what names the lost rank.
    """
    if (
        parallel.node_num > 1
        and parallel.node_rank == 0
        and not _timed_out_ranks(log_dir)
        and any(_collective_failed(_tail(p, 60)) for p in rank_logs(log_dir).values())
    ):
        return FAIL_GRACE_S + node_timeout()
    return FAIL_GRACE_S


def _some_rank_failed(log_dir: Path) -> bool:
    if _timed_out_ranks(log_dir):  # the scheduler lost a node: the ranks here may hang in a collective
        return True
    for path in rank_logs(log_dir).values():
        try:
            tail = path.read_bytes()[-4000:]
        except OSError:
            continue
        if b"\nerror: " in tail or tail.startswith(b"error: ") or b"\nTraceback (most recent call last)" in tail:
            return True
    return False


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (msrun puts its workers in their own process groups)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _stop_group(proc: subprocess.Popen) -> None:
    """Stop msrun and every worker it started: SIGTERM, then SIGKILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in [*_descendants(proc.pid), proc.pid]:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
        if not any(pid_alive(p) for p in _descendants(proc.pid)):
            return


# ----------------------------------------------------------------------------- a lost node


class NodeLost(str):
    """A job's error saying another node stopped answering (its host died, or the network to it).

    The supervisor does not retry it on the nodes left: the lost node's command is gone, so a
    rerun here would only wait `cluster_timeout` for it. Rerunning on every node resumes.
    """


NODE_FILE = "node.json"
"""In each node's log dir (runs/<stage>/<key>/msrun_logs/node_<k>/, on the shared root): its host and ranks."""
SCHEDULER_LOG = "scheduler.log"


def _write_node_file(log_dir: Path, parallel) -> None:
    local = parallel.device_num // parallel.node_num
    atomic_write_json(
        log_dir / NODE_FILE,
        {
            "node_rank": parallel.node_rank,
            "hostname": socket.gethostname(),
            "address": _address_towards(parallel.master_addr),
            "ranks": list(range(parallel.node_rank * local, (parallel.node_rank + 1) * local)),
        },
    )


def _address_towards(host: str) -> str | None:
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError:
        return None


def node_timeout() -> float:
    """MindSpore's heartbeat timeout (MS_NODE_TIMEOUT, seconds; 30 unless set): when the scheduler declares a node
    lost."""
    try:
        return max(1.0, float(os.environ.get("MS_NODE_TIMEOUT", "30")))
    except ValueError:
        return 30.0


COLLECTIVE_FAILURE = re.compile(
    r"wait receiving .* failed|Launch kernel failed: \S*(AllReduce|AllGather|ReduceScatter|"
    r"Broadcast|Barrier|Send|Receive)"
)
"""What a rank logs when a collective's peer stopped answering (MindSpore's CPU backend)."""


def _collective_failed(lines: list[str]) -> bool:
    return any(COLLECTIVE_FAILURE.search(ln) for ln in lines)


def _timed_out_ranks(log_dir: Path) -> list[int]:
    """The ranks MindSpore's scheduler (node 0) declared lost: no heartbeat for MS_NODE_TIMEOUT (30 s default).

    msrun gives worker i of node k the cluster node id k × local_worker_num + i, which is its rank.
    """
    try:
        text = (log_dir / SCHEDULER_LOG).read_bytes()[-200000:].decode("utf-8", "replace")
    except OSError:
        return []
    ranks = {int(m) for m in re.findall(r"The node: (\d+) is timed out", text)}
    for group in re.findall(r"Timed out node list is: [^{\n]*\{([\d,\s]*)\}", text):
        ranks.update(int(x) for x in re.findall(r"\d+", group))
    return sorted(ranks)


def _node_desc(log_dir: Path, node: int, fallback_host: str | None = None) -> str:
    """ "node 1, host NAME ADDRESS" from that node's node.json (on the shared root), else what is known."""
    try:
        info = json.loads((log_dir.parent / f"node_{node}" / NODE_FILE).read_text())
        host = " ".join(dict.fromkeys(x for x in (info.get("hostname"), info.get("address")) if x))
    except (OSError, ValueError, AttributeError):
        host = fallback_host or "unknown (no node.json from it on the shared root)"
    return f"node {node}, host {host}"


def _ranks_text(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _failed_on_its_own(log_dir: Path, node: int, rank: int) -> bool:
    """Whether `rank`'s log (node `node`'s, on the shared root) ends in an error of its own, not a collective's:
    then its node stopped it (msrun stops a node's job when one of its ranks fails) and it was not lost."""
    lines = _tail(log_dir.parent / f"node_{node}" / f"worker_{rank}.log", 60)
    return _error_line(lines) is not None and not _collective_failed(lines)


def _scheduler_answers(host: str, port: int, timeout: float = 5.0) -> bool | None:
    """True: something listens at host:port; False: the host answers but nothing listens (refused);
    None: no answer at all (the host is down or unreachable)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


def lost_node_report(log_dir: Path, parallel) -> NodeLost | None:
    """When the failed multi-node job lost a node, one line naming its ranks, node and host; else None.

    Node 0 reads its scheduler's log (MindSpore's heartbeat timeout names the lost ranks); any other
    node, whose ranks failed with node 0 gone, finds the scheduler's address no longer answering.
    """
    if parallel.node_num <= 1:
        return None
    local = parallel.device_num // parallel.node_num
    timeout = node_timeout()
    if parallel.node_rank == 0:
        lost = [r for r in _timed_out_ranks(log_dir) if not _failed_on_its_own(log_dir, r // local, r)]
        if not lost:
            return None
        by_node: dict[int, list[int]] = {}
        for r in lost:
            by_node.setdefault(r // local, []).append(r)
        parts = [f"{_ranks_text(rs)} ({_node_desc(log_dir, n)}) lost" for n, rs in sorted(by_node.items())]
        return NodeLost(
            f"{'; '.join(parts)}: no heartbeat from it for MS_NODE_TIMEOUT={timeout:g}s (its host died or "
            "the network to it is down); the job on this node was stopped"
        )
    if _scheduler_answers(parallel.master_addr, parallel.master_port) is not None:
        return None  # node 0 is up (its job may have failed on its own: that is its ranks' error to report)
    return NodeLost(
        f"{_ranks_text(list(range(local)))} ({_node_desc(log_dir, 0, parallel.master_addr)}) lost: "
        f"the scheduler at {parallel.master_addr}:{parallel.master_port} no longer answers (node 0's host "
        "died, or the network between it and this node is down); the job on this node was stopped"
    )


def rank_logs(log_dir: Path) -> dict[int, Path]:
    out = {}
    for p in log_dir.glob("worker_*.log"):
        m = re.fullmatch(r"worker_(\d+)\.log", p.name)
        if m:
            out[int(m.group(1))] = p
    return dict(sorted(out.items()))


def _tail(path: Path, n: int = 30) -> list[str]:
    try:
        text = path.read_bytes()[-40000:].decode("utf-8", "replace")
    except OSError:
        return []
    lines = [ln.rsplit("\r", 1)[-1] for ln in text.splitlines()]
    return [ln for ln in lines if ln.strip() and not ln.startswith("[WARNING]") and not ln.startswith("[INFO]")][-n:]


def _error_line(lines: list[str]) -> str | None:
    errs = [i for i, ln in enumerate(lines) if ln.startswith("error:") or re.match(r"^\w*(Error|Exception)\b", ln)]
    if not errs:
        return None
    err = lines[errs[-1]].removeprefix("error:").strip()
    if not err:  # MindSpore's message starts on the next line, after a banner ("- Kernel error:")
        err = next(
            (
                ln.strip()
                for ln in lines[errs[-1] + 1 :]
                if ln.strip() and not ln.lstrip().startswith(("-", "[")) and not ln.rstrip().endswith(":")
            ),
            "(an empty error message)",
        )
    return err


def failure_report(log_dir: Path, rc: int, msrun_out: str) -> str:
    """The first failing rank's own error on top, then its log's last lines, then every rank's status."""
    logs = rank_logs(log_dir)
    status, failing = [], None
    for rank, path in logs.items():
        lines = _tail(path)
        err = _error_line(lines)
        stopped = any(STOPPED_MARK in ln for ln in lines)
        status.append(
            f"  rank {rank}: {'error: ' + err if err else ('stopped early' if stopped else 'no error in its log')}"
            f" ({path})"
        )
        if err and failing is None:
            failing = (rank, err, lines)
    if failing is None and logs and all(STOPPED_MARK in "\n".join(_tail(p)) for p in logs.values()):
        return "all ranks stopped before the end (stop_after)\n" + "\n".join(status)
    if failing is None:
        tail = [ln for ln in msrun_out.splitlines() if ln.strip()][-20:]
        return (
            f"msrun exited with code {rc} and no rank logged an error (cluster start failed? see "
            f"{log_dir / 'scheduler.log'})\n" + "\n".join(status) + "\n--- msrun ---\n" + "\n".join(tail)
        )
    rank, err, lines = failing
    return (
        f"rank {rank}: {err}\n--- last lines of rank {rank}'s log ({logs[rank]}) ---\n"
        + "\n".join(lines)
        + "\n--- all ranks ---\n"
        + "\n".join(status)
    )
