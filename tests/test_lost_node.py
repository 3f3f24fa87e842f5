"""The lost node: two msrun "hosts" in two network namespaces joined by a veth pair, one lost mid-run.

Each host is a Linux network namespace with its own address (10.x.y.1 and 10.x.y.2 over a veth
pair) running its own `msllm train` with its `parallel.node_rank` (one worker each, data parallel
2, `master_addr` = host A's address), over one shared artifact root, as on two machines. Once rank
0 has logged step 4, host B is lost the hard way: its processes are frozen (SIGSTOP: from A's side
a machine that stopped answering), its link goes down (no FIN or RST reaches A, as when a machine
loses power or its cable) and every process in it is killed with SIGKILL.

A tiny step takes milliseconds, so where B stops (step 5, 6 or later) is whatever it had reached
when the test saw the line; the test reads it from the logs and derives what must hold: the
checkpoints left are complete and no newer than the last step rank 0 logged, and the resume
starts from the newest of them.

The survivor (host A, node 0, which hosts MindSpore's scheduler) must stop within a bounded time
with one line naming the lost rank, its node and host, publish nothing, and not retry (the lost
node's command is gone); rerunning both commands once B is back resumes from the newest
checkpoint and ends where an unbroken run ends (losses and weights within train_tol of one process,
as tests/test_scaleout.py; the steps the lost attempt logged after the checkpoint repeat bit for
bit).

Needs root and `ip netns` (skipped with the reason otherwise). Slow tier: about 2-3 minutes on 2 cores.
The unit tests below read the logs such a job leaves (the scheduler's heartbeat verdict, a rank's
MindSpore error banner) without starting one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.config.loader import resolve_pipeline
from tasks.store.artifacts import ArtifactStore
from tests.helpers import assert_same_scalars, assert_same_weights, pretrain_child, run_stage

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MAX_STEPS, SAVE_STEPS = 16, 3  # room after step 4: B is frozen within a step or two of it
TRAIN = [
    f"pretrain.train.loop.max_steps={MAX_STEPS}",
    "pretrain.train.loop.log_steps=1",
    "pretrain.train.loop.eval_steps=4",
    "pretrain.train.loop.eval_batches=2",
    "pretrain.train.schedule.warmup_steps=2",
    "pretrain.train.loop.micro_batch_size=8",
    f"checkpoint.save_steps={SAVE_STEPS}",
]
DP2_TWO_NODES = [
    "parallel.data_parallel=2",
    "parallel.device_num=2",
    "pretrain.train.loop.micro_batch_size=4",
    "parallel.node_num=2",
]
LOST_WITHIN_S = 120  # MindSpore's heartbeat timeout (MS_NODE_TIMEOUT, 30 s) + stopping the job, with room on 2 cores


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (creates network namespaces and a veth pair)"
    if shutil.which("ip") is None:
        return "needs iproute2's `ip` (ip netns)"
    try:
        out = _ip("netns", "list", check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns` unavailable: {exc}"
    if out.returncode != 0:
        return f"`ip netns` unavailable: {out.stderr.strip()}"
    return None


def _netns_pids(ns: str) -> list[int]:
    return [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_netns_processes(ns: str) -> None:
    _signal(_netns_pids(ns), signal.SIGKILL)


@pytest.fixture
def two_hosts():
    """Namespaces A and B (unique names), veth A<->B with 10.x.y.1 / 10.x.y.2; removed afterwards, whatever ran."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    pid = os.getpid()
    ns = {h: f"msllm-lost-{pid}-{h}" for h in "ab"}
    veth = {h: f"mll{pid}{h}" for h in "ab"}  # interface names: 15 characters at most
    net = f"10.{200 + pid % 50}.{pid // 50 % 250}"
    addr = {"a": f"{net}.1", "b": f"{net}.2"}
    try:
        for h in "ab":
            _ip("netns", "add", ns[h])
        _ip("link", "add", veth["a"], "type", "veth", "peer", "name", veth["b"])
        for h in "ab":
            _ip("link", "set", veth[h], "netns", ns[h])
            _ip("-n", ns[h], "addr", "add", f"{addr[h]}/24", "dev", veth[h])
            _ip("-n", ns[h], "link", "set", "lo", "up")
            _ip("-n", ns[h], "link", "set", veth[h], "up")
    except subprocess.CalledProcessError as exc:
        for h in "ab":
            _ip("netns", "del", ns[h], check=False)
        pytest.skip(f"cannot build two hosts with ip netns: {' '.join(exc.cmd)}: {exc.stderr.strip()}")
    try:
        yield {"ns": ns, "veth": veth, "addr": addr}
    finally:
        for h in "ab":
            _kill_netns_processes(ns[h])
        time.sleep(0.5)
        for h in "ab":
            _ip("netns", "del", ns[h], check=False)  # takes its end of the veth pair with it


@pytest.fixture
def data_artifact(tmp_path) -> Path:

    return run_stage(
        "data",
        resolve_pipeline(REPO / "pipelines.yaml", "tiny", TRAIN),
        ArtifactStore(tmp_path / "data_root"),
        progress=False,
    )


def _losses(run_or_artifact: Path) -> tuple[dict[int, float], list[float]]:
    rows = [json.loads(x) for x in (run_or_artifact / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "grad_norm" in r}, [r["val_loss"] for r in rows if "val_loss" in r]


def _start_nodes(hosts, root: Path, data: Path, port: int, logs: Path, attempt: str) -> list[subprocess.Popen]:
    env = dict(os.environ, GLOG_v="3", PATH=f"{BIN}:{os.environ['PATH']}")
    nodes = []
    for rank, h in ((0, "a"), (1, "b")):
        sets = [
            *TRAIN,
            *DP2_TWO_NODES,
            f"parallel.node_rank={rank}",
            f"parallel.master_addr={hosts['addr']['a']}",
            f"parallel.master_port={port}",
        ]
        cmd = [
            "ip",
            "netns",
            "exec",
            hosts["ns"][h],
            sys.executable,
            "-m",
            "tasks.cli",
            "train",
            "--pipeline",
            "tiny",
            "--artifacts",
            str(root),
            "--from",
            str(data),
        ]
        cmd += [x for s in sets for x in ("--set", s)]
        nodes.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                text=True,
                stderr=open(logs / f"{attempt}-node{rank}.log", "w"),
                start_new_session=True,
            )
        )
    return nodes


def _wait_for_line(
    pattern: str, glob: str, root: Path, procs: list[subprocess.Popen], timeout: float, poll: float = 0.1
) -> Path:
    """The first file under root matching glob with a line matching pattern; each file read from where it was left."""
    deadline = time.monotonic() + timeout
    seen: dict[Path, tuple[int, str]] = {}  # file -> (bytes read, its unfinished last line)
    rx = re.compile(pattern, re.M)
    while time.monotonic() < deadline:
        for path in root.glob(glob):
            offset, carry = seen.get(path, (0, ""))
            with open(path, "rb") as f:
                f.seek(offset)
                chunk = f.read()
            text = carry + chunk.decode(errors="replace")
            if rx.search(text):
                return path
            seen[path] = (offset + len(chunk), text[text.rfind("\n") + 1 :])
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a node exited before {pattern!r} appeared in {glob}: {[p.returncode for p in procs]}")
        time.sleep(poll)
    pytest.fail(f"{pattern!r} did not appear in {glob} within {timeout:.0f}s")


def _logged_steps(log: Path) -> list[int]:
    return [int(m) for m in re.findall(r"^\[train\] step +(\d+)/", log.read_text(errors="replace"), re.M)]


@pytest.mark.slow
@pytest.mark.integration
def test_lost_node_stops_the_survivor_in_one_line_and_both_resume_exactly(tmp_path, two_hosts, data_artifact):
    from tasks.store.tensors import load_weights
    from tasks.training.checkpoint import load_checkpoint
    from tests.test_distributed import free_port

    t0 = time.time()
    cfg1 = resolve_pipeline(REPO / "pipelines.yaml", "tiny", TRAIN)
    one = ArtifactStore(tmp_path / "one")
    data1 = one.root / "data" / data_artifact.name
    shutil.copytree(data_artifact, data1)
    train, _ = pretrain_child(cfg1, one.root, data1)
    single = train()  # the unbroken reference

    root = tmp_path / "shared"  # the artifact root both hosts see
    data = root / "data" / data_artifact.name
    shutil.copytree(data_artifact, data)
    logs = tmp_path / "logs"
    logs.mkdir()
    port = free_port()
    ns_b, veth_b = two_hosts["ns"]["b"], two_hosts["veth"]["b"]

    nodes = _start_nodes(two_hosts, root, data, port, logs, "lost")
    try:
        # B's processes, taken while the ranks compile their first step (no hurry there; rank 0 gets here only
        # once every rank joined the cluster)
        _wait_for_line(r"^\[train\] step: ", "runs/pretrain/*/msrun_logs/node_0/worker_0.log", root, nodes, timeout=300)
        b_pids = _netns_pids(ns_b)
        rank0_log = _wait_for_line(
            r"^\[train\] step +4/",
            "runs/pretrain/*/msrun_logs/node_0/worker_0.log",
            root,
            nodes,
            timeout=300,
            poll=0.005,
        )
        # host B is lost: frozen at once (a tiny step takes milliseconds), its cable pulled (nothing reaches A),
        # then every process on it killed
        _signal(b_pids, signal.SIGSTOP)
        _ip("-n", ns_b, "link", "set", veth_b, "down")
        _kill_netns_processes(ns_b)
        killed_at = time.monotonic()
        out0, _ = nodes[0].communicate(timeout=600)
        stopped_after = time.monotonic() - killed_at
        nodes[1].wait(timeout=30)
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    err0 = (logs / "lost-node0.log").read_text()
    run_dir = rank0_log.parents[2]
    key = run_dir.name
    logged = _logged_steps(rank0_log)
    assert max(logged) < MAX_STEPS, f"rank 0 logged step {max(logged)}: the run ended before B was lost"
    assert nodes[0].returncode == 1, (nodes[0].returncode, out0, err0[-3000:])
    errors = [ln for ln in err0.splitlines() if ln.startswith("error:")]
    # the command's own report (its last error line): naming the lost rank, its node and host (its address on the veth)
    assert errors, err0[-3000:]
    assert re.match(
        rf"error: rank 1 \(node 1, host [^)]*\b{re.escape(two_hosts['addr']['b'])}\) lost: no heartbeat", errors[-1]
    ), errors[-1]
    assert "resumes from its newest checkpoint" in errors[-1]
    assert stopped_after <= LOST_WITHIN_S, f"the survivor took {stopped_after:.0f}s to stop"
    assert "retrying" not in err0  # no second attempt waiting for a node whose command is gone
    # nothing published: no artifact directory for the stage, no half-built one
    store = ArtifactStore(root)
    assert store.lookup("pretrain", key) is None
    assert not (root / "pretrain").exists() or not any((root / "pretrain").iterdir())
    # the checkpoints left: every save_steps up to the last step rank 0 logged, the newest keep_checkpoint_max of them,
    # each complete; the last logged step's own save may be missing (it waits for B's barriers)
    saved = [int(c.name.removeprefix("step_")) for c in sorted((run_dir / "checkpoints").glob("step_*"))]
    due = list(range(SAVE_STEPS, max(logged) + 1, SAVE_STEPS))
    keep = cfg1.checkpoint.keep_checkpoint_max
    assert saved in [due[-keep:]] + ([due[:-1][-keep:]] if max(logged) % SAVE_STEPS == 0 else []), (saved, logged)
    for s in saved:
        load_checkpoint(run_dir / "checkpoints" / f"step_{s:08d}")  # state.json complete, each file its sha256
    newest = saved[-1]
    lost_losses, _ = _losses(run_dir)  # what the lost attempt logged (steps after the checkpoint are redone)
    assert 4 in lost_losses and max(lost_losses) == max(logged)

    # host B is back (same address); both commands again
    _ip("-n", ns_b, "link", "set", veth_b, "up")
    nodes = _start_nodes(two_hosts, root, data, free_port(), logs, "resume")
    try:
        outs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    errs = [(logs / f"resume-node{r}.log").read_text() for r in (0, 1)]
    assert [p.returncode for p in nodes] == [0, 0], [e[-3000:] for e in errs]
    paths = [Path(o.strip().splitlines()[-1]) for o in outs]
    assert paths[0] == paths[1] == root / "pretrain" / key  # both hosts name the one artifact
    rank0 = (run_dir / "msrun_logs" / "node_0" / "worker_0.log").read_text()
    assert f"[train] resumed from step_{newest:08d}: step {newest}" in rank0, rank0[-3000:]

    ls, vs = _losses(single)
    lr, vr = _losses(paths[0])
    assert sorted(lr) == list(range(1, MAX_STEPS + 1)) and len(vs) == len(vr) == MAX_STEPS // 4 + 1
    assert_same_scalars(ls, lr)
    assert_same_scalars(vs, vr)
    assert {s: lr[s] for s in lost_losses} == lost_losses  # the same layout redoes steps 4.. bit for bit
    a, b = load_weights(single), load_weights(paths[0])
    assert_same_weights(a, b, steps=MAX_STEPS, lr=3e-3)
    m = store.verify(paths[0])["metrics"]
    assert m["consumed_samples"] == 8 * MAX_STEPS and m["layout"] == {"data_parallel": 2, "tensor_parallel": 1}
    digests = [
        re.findall(
            r"parameters sha256 ([0-9a-f]{64})", (run_dir / "msrun_logs" / f"node_{r}" / f"worker_{r}.log").read_text()
        )
        for r in (0, 1)
    ]
    assert digests[0] and digests[0] == digests[1], digests  # the replicas agree after the resume
    print(
        "LOST",
        json.dumps(
            {
                "lost_after_step": max(logged),
                "resumed_from": newest,
                "stopped_after_s": round(stopped_after, 1),
                "error": errors[-1][:200],
                "wall_s": round(time.time() - t0, 1),
            }
        ),
    )


# ----------------------------------------------------------------------------- reading the logs (unit tier)

SCHEDULER_TIMED_OUT = """\
[ERROR] DISTRIBUTED(29328,7f15d579e6c0,python):2026-12-02-10:05:51.208.807 [mindspore/ccsrc/cluster/topology/meta_server_node.cc:548] UpdateTopoState] The node: 1 is timed out. It may exit with exception, please check this node's log.
[ERROR] DISTRIBUTED(29328,7f1607dd3e40,python):2026-12-02-10:05:56.178.997 [mindspore/ccsrc/cluster/topology/meta_server_node.cc:95] Finalize] There are 1 abnormal compute graph nodes.
error: The total number of timed out node is 1. Timed out node list is: [const vector]{1}, worker 1 is the first one timed out, please check its log.
"""
RANK_COLLECTIVE_FAILED = """\
[train] step     5/12 | loss 5.8380 | lr 2.74e-03 | gnorm 0.756 | 5980 tok/s | MFU 0.9% | rss 0.63 GiB | eta 20s
[ERROR] DISTRIBUTED(29329,7f53128fe6c0,python):2026-12-02-10:05:50.745.926 [mindspore/ccsrc/cluster/rpc/core/collective_ops_impl.cc:259] ReduceBroadcastAllReduce] Reduce wait receiving [const pair] failed.
[ERROR] KERNEL(29329,7f53128fe6c0,python):2026-12-02-10:05:50.746.064 [mindspore/ops/kernel/cpu/native/allreduce_cpu_kernel.cc:89] Launch] AllReduceCPUKernelMod launch failed.
error: 
----------------------------------------------------
- Kernel error:
----------------------------------------------------
Launch kernel failed: Default/AllReduce-op0

----------------------------------------------------
- C++ Call Stack: (For framework developers)
----------------------------------------------------
mindspore/ccsrc/backend/ms_backend/runtime/actors/base/kernel_actor.cc:995 OnMemoryAllocFinish
"""


def _two_node_logs(tmp_path: Path, rank1_log: str) -> Path:
    logs = tmp_path / "msrun_logs"
    (logs / "node_0").mkdir(parents=True)
    (logs / "node_1").mkdir()
    (logs / "node_0" / "scheduler.log").write_text(SCHEDULER_TIMED_OUT)
    (logs / "node_0" / "worker_0.log").write_text(RANK_COLLECTIVE_FAILED)
    (logs / "node_1" / "node.json").write_text(
        json.dumps({"node_rank": 1, "hostname": "gpu7", "address": "10.0.0.2", "ranks": [1]})
    )
    (logs / "node_1" / "worker_1.log").write_text(rank1_log)
    return logs / "node_0"


def test_scheduler_heartbeat_verdict_names_the_lost_rank_node_and_host(tmp_path, monkeypatch):
    from tasks.config.schema import ParallelSection
    from tasks.runtime.distributed import NodeLost, _grace, _some_rank_failed, failure_report, lost_node_report

    monkeypatch.delenv("MS_NODE_TIMEOUT", raising=False)
    par = ParallelSection(data_parallel=2, device_num=2, node_num=2, node_rank=0)
    log_dir = _two_node_logs(tmp_path, "[train] step     5/12 | loss 5.8380\n")  # killed: no error of its own
    assert _some_rank_failed(log_dir)
    err = lost_node_report(log_dir, par)
    assert isinstance(err, NodeLost) and "\n" not in err
    assert err.startswith("rank 1 (node 1, host gpu7 10.0.0.2) lost: no heartbeat from it for MS_NODE_TIMEOUT=30s"), err
    # a rank whose own log ends in its own error was stopped by its node, not lost: its error is the report
    log_dir = _two_node_logs(tmp_path / "own", "error: the corpus shard of rank 1 is unreadable\n")
    assert lost_node_report(log_dir, par) is None
    # a rank failing in a collective: its error is MindSpore's banner's message, not the empty 'error:' line
    assert failure_report(log_dir, 1, "").splitlines()[0] == "rank 0: Launch kernel failed: Default/AllReduce-op0"
    # before the scheduler's verdict, node 0 waits for it when its rank failed in a collective
    (log_dir / "scheduler.log").write_text("")
    assert _grace(log_dir, par) == 35.0
    assert _grace(log_dir, ParallelSection(data_parallel=2, device_num=2)) == 5.0  # one node: nothing to wait for
