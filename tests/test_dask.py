"""The data stage's chunks as mapped Prefect tasks on a Dask LocalCluster give the same bytes as the local pool."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.config.loader import resolve_pipeline
from tasks.store.artifacts import ArtifactStore
from tests.helpers import run_stage

REPO = Path(__file__).resolve().parent.parent
OVERRIDES = ["data.chunk_documents=1500", "data.num_workers=2", "data.executor=dask"]

DRIVER = r"""
import json, sys
from flows.data_dask import run_on_dask
from tasks.config.loader import resolve_pipeline
args = json.loads(sys.argv[1])
cfg = resolve_pipeline(args["config"], "tiny", args["overrides"])
print("PATH " + run_on_dask(cfg, args["artifacts"]))
"""


@pytest.mark.slow
def test_dask_mapped_tokenization_matches_local_pool(tmp_path):
    cfg = resolve_pipeline(REPO / "pipelines.yaml", "tiny", OVERRIDES)
    local = run_stage("data", cfg, ArtifactStore(tmp_path / "local"), progress=False)
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "ph"), PREFECT_SERVER_ANALYTICS_ENABLED="false", GLOG_v="3")
    env.pop("PREFECT_API_URL", None)
    arg = json.dumps(
        {"config": str(REPO / "pipelines.yaml"), "overrides": OVERRIDES, "artifacts": str(tmp_path / "dask")}
    )
    out = subprocess.run(
        [sys.executable, "-c", DRIVER, arg], capture_output=True, text=True, cwd=REPO, env=env, timeout=900
    )
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("PATH ")), None)
    assert out.returncode == 0 and line, out.stderr[-4000:]
    dask_art = Path(line[5:])
    assert "tokenize-chunk" in out.stdout + out.stderr  # the chunks really ran as mapped Prefect tasks
    a, b = ArtifactStore.read_manifest(local), ArtifactStore.read_manifest(dask_art)
    assert a["key"] == b["key"] and a["digest"] == b["digest"]
    assert [f["sha256"] for f in a["files"]] == [f["sha256"] for f in b["files"]]
