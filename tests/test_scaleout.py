"""Scale-out paths tested on one machine, each with its parts started as separate processes.

- The data stage on a Dask cluster given by address (`data.dask_address`): `dask scheduler`
  and `dask worker` are their own processes (not a LocalCluster); the artifact's bytes equal
  the local process pool's.
- msrun across nodes: two "nodes" (`parallel.node_num: 2`), each a separate `msllm train` with
  its own `parallel.node_rank`, one worker each, data parallel 2, sharing one artifact root;
  the losses match one process within train_tol (tests/helpers.py) and both nodes' commands return the same artifact.

(Prefect workers on several machines: tests/test_workpool.py, two workers sharing one pool.)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.config.loader import resolve_pipeline
from tasks.store.artifacts import ArtifactStore
from tests.helpers import assert_same_scalars, pretrain_child, run_stage
from tests.test_distributed import free_port

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
DATA = ["data.chunk_documents=1500", "data.num_workers=2", "data.executor=dask"]  # as tests/test_dask.py
TRAIN = [
    "pretrain.train.loop.max_steps=6",
    "pretrain.train.loop.log_steps=1",
    "pretrain.train.loop.eval_steps=3",
    "pretrain.train.loop.eval_batches=2",
    "pretrain.train.schedule.warmup_steps=2",
    "pretrain.train.loop.micro_batch_size=8",
    "checkpoint.save_steps=3",
]
DP2 = [
    "parallel.data_parallel=2",
    "parallel.device_num=2",
    "pretrain.train.loop.micro_batch_size=4",
]  # same global batch 8


@pytest.fixture(scope="module")
def local_data(tmp_path_factory) -> Path:
    """The tiny data artifact built by the local process pool (the reference bytes)."""
    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", DATA)
    return run_stage("data", cfg, ArtifactStore(tmp_path_factory.mktemp("local")), progress=False)


from tasks.serving.health import stop_group as _stop  # noqa: E402


@pytest.mark.slow
def test_data_stage_on_a_dask_cluster_started_by_address(tmp_path, local_data):
    from distributed import Client

    from tests.test_dask import DRIVER

    t0 = time.time()
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = dict(
        os.environ,
        PREFECT_HOME=str(tmp_path / "ph"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        GLOG_v="3",
        PYTHONPATH=str(REPO),
        PATH=f"{BIN}:{os.environ['PATH']}",
    )
    env.pop("PREFECT_API_URL", None)
    procs = []
    try:
        for name, cmd in (
            ("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"]),
            (
                "worker",
                [
                    "worker",
                    address,
                    "--nworkers",
                    "2",
                    "--nthreads",
                    "1",
                    "--no-dashboard",
                    "--local-directory",
                    str(tmp_path / "dask-space"),
                ],
            ),
        ):
            procs.append(
                subprocess.Popen(
                    [str(BIN / "dask"), *cmd],
                    cwd=tmp_path,
                    env=env,
                    start_new_session=True,
                    stdout=open(tmp_path / f"{name}.log", "w"),
                    stderr=subprocess.STDOUT,
                )
            )
            if name == "scheduler":
                deadline = time.time() + 60
                while "Scheduler at:" not in (tmp_path / "scheduler.log").read_text() and time.time() < deadline:
                    time.sleep(0.5)
        with Client(address, timeout=60) as client:
            client.wait_for_workers(2, timeout=120)
            worker_pids = set(client.run(os.getpid).values())
        assert len(worker_pids) == 2 and os.getpid() not in worker_pids
        arg = json.dumps(
            {
                "config": str(REPO / "pipelines.yaml"),
                "overrides": [*DATA, f"data.dask_address={address}"],
                "artifacts": str(tmp_path / "dask"),
            }
        )
        out = subprocess.run(
            [sys.executable, "-c", DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=900
        )
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PATH ")), None)
        assert out.returncode == 0 and line, out.stderr[-4000:]
        worker_log = (tmp_path / "worker.log").read_text()
    finally:
        for p in reversed(procs):
            _stop(p)
    # the chunks ran as mapped Prefect tasks inside the `dask worker` processes
    assert re.search(r"Task run 'tokenize-chunk-\w+' - Finished in state Completed", worker_log), worker_log[-3000:]
    a, b = ArtifactStore.read_manifest(local_data), ArtifactStore.read_manifest(Path(line[5:]))
    assert a["key"] == b["key"] and a["digest"] == b["digest"]
    assert [(f["path"], f["sha256"]) for f in a["files"]] == [(f["path"], f["sha256"]) for f in b["files"]]
    print(
        "DASK", json.dumps({"files": len(a["files"]), "digest": a["digest"][:16], "wall_s": round(time.time() - t0, 1)})
    )


def test_nodes_other_than_0_run_msrun_without_a_scheduler(tmp_path):
    from tasks.config.schema import ParallelSection
    from tasks.runtime.distributed import MSRUN_NODE, msrun_command

    two = dict(data_parallel=2, device_num=2, node_num=2)
    node0 = msrun_command(ParallelSection(**two, node_rank=0), tmp_path, ["w.py"])
    node1 = msrun_command(ParallelSection(**two, node_rank=1), tmp_path, ["w.py"])
    assert Path(node0[0]).name == "msrun" and node1[:2] == [sys.executable, str(MSRUN_NODE)]
    assert node0[1:] == [a.replace("--node_rank=1", "--node_rank=0") for a in node1[2:]]
    assert "--local_worker_num=1" in node1 and "--worker_num=2" in node1
    # the shim patches the one check msrun uses to start a scheduler (fails loudly if MindSpore renames it)
    out = subprocess.run([sys.executable, str(MSRUN_NODE), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--node_rank" in out.stdout, out.stderr[-2000:]
    from mindspore.parallel.cluster.process_entity import _api

    assert callable(_api._is_local_ip)


def _losses(path: Path) -> tuple[dict[int, float], list[float]]:
    rows = [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "grad_norm" in r}, [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.mark.slow
def test_two_msrun_nodes_on_one_machine_match_one_process(tmp_path, local_data):
    t0 = time.time()
    cfg1 = resolve_pipeline(REPO / "pipelines.yaml", "tiny", TRAIN)
    one = ArtifactStore(tmp_path / "one")
    data1 = one.root / "data" / local_data.name
    shutil.copytree(local_data, data1)
    train, _ = pretrain_child(cfg1, one.root, data1)
    single = train()

    root = tmp_path / "shared"  # the artifact root every node sees
    shared_data = root / "data" / local_data.name
    shutil.copytree(local_data, shared_data)
    port = free_port()
    env = dict(os.environ, GLOG_v="3", PATH=f"{BIN}:{os.environ['PATH']}")
    nodes = []
    for rank in (0, 1):
        sets = [
            *TRAIN,
            *DP2,
            "parallel.node_num=2",
            f"parallel.node_rank={rank}",
            f"parallel.master_port={port}",
            "parallel.cluster_timeout=120",
        ]
        cmd = [str(BIN / "msllm"), "train", "--pipeline", "tiny", "--artifacts", str(root), "--from", str(shared_data)]
        cmd += [x for s in sets for x in ("--set", s)]
        nodes.append(
            subprocess.Popen(
                cmd,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=open(tmp_path / f"node{rank}.log", "w"),
                text=True,
                start_new_session=True,
            )
        )
    try:
        outs = [p.communicate(timeout=600)[0] for p in nodes]
    finally:
        for p in nodes:
            _stop(p)
    logs = [(tmp_path / f"node{r}.log").read_text() for r in (0, 1)]
    assert [p.returncode for p in nodes] == [0, 0], [lg[-3000:] for lg in logs]
    paths = [Path(o.strip().splitlines()[-1]) for o in outs]
    assert paths[0] == paths[1] and paths[0].parent == root / "pretrain"  # both nodes name the one artifact
    path = paths[0]
    ls, vs = _losses(single)
    ln, vn = _losses(path)
    assert sorted(ln) == [1, 2, 3, 4, 5, 6] and len(vs) == len(vn) == 3
    assert_same_scalars(ls, ln)
    assert_same_scalars(vs, vn)
    m = ArtifactStore(root).verify(path)["metrics"]
    assert m["consumed_samples"] == 48 and m["layout"] == {"data_parallel": 2, "tensor_parallel": 1}
    # one msrun per node, each with its own log dir in the shared run dir; replicas bit-identical
    run_dir = root / "runs" / "pretrain" / path.name
    rank_logs = {r: run_dir / "msrun_logs" / f"node_{r}" / f"worker_{r}.log" for r in (0, 1)}
    digests = {r: re.findall(r"parameters sha256 ([0-9a-f]{64})", p.read_text()) for r, p in rank_logs.items()}
    assert digests[0] and digests[0] == digests[1], digests
    assert not (run_dir / "msrun_logs" / "node_1" / "worker_0.log").exists()  # node 1 ran rank 1 only
    loss_diff, val_diff = max(abs(ls[s] - ln[s]) for s in ls), max(abs(a - b) for a, b in zip(vs, vn))
    print(
        "NODES",
        json.dumps({"max_loss_diff": loss_diff, "max_val_diff": val_diff, "wall_s": round(time.time() - t0, 1)}),
    )
