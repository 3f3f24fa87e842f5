"""A non-editable install stands alone: build the wheel (no deprecation warning), install it into a fresh
virtualenv, and from a directory outside the repo run `msllm init` (the starter project from package data),
`validate`, `data`, `train` (a few steps), `eval` (the shipped benchmark files) and `lineage | head`.

The fresh virtualenv sees the project's dependencies through a .pth file naming
.venv's site-packages (a plain path entry: .venv's own .pth files, the editable
install's finder among them, are not run), so nothing is downloaded; pip installs
the wheel with `--no-index` and the lock as constraints, which also checks that the
wheel's pinned requirements are met by the locked set. The test then checks that
`tasks`, `model` and `flows` load from the new site-packages, not from the repo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("model", "tasks", "flows")

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: int = 300) -> str:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} exited {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r.stdout


def _tracked_package_files() -> set[str]:
    """The packages' files as git tracks them (every file under them, without git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", *PACKAGES], capture_output=True, text=True, check=True
        )
        files = out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = [
            p.relative_to(REPO).as_posix()
            for pkg in PACKAGES
            for p in (REPO / pkg).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        ]
    return {f for f in files if (REPO / f).is_file()}


def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    # 1. build the wheel from a copy of the sources (the build writes build/ and *.egg-info beside them)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    build_log = _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-v",
            "-w",
            str(dist),
            str(src),
        ],
        cwd=tmp_path,
    )
    assert "deprecat" not in build_log.lower(), [ln for ln in build_log.splitlines() if "eprecat" in ln]
    (wheel,) = dist.glob("msllm-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())
    metadata = zipfile.ZipFile(wheel).read(next(m for m in members if m.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata  # PEP 639
    missing = sorted(_tracked_package_files() - members)
    assert not missing, f"tracked files left out of the wheel: {missing}"
    assert not [m for m in members if m.endswith(".pyc") or "__pycache__" in m]

    # 2. a fresh virtualenv that sees .venv's dependencies but not the repo, and the wheel installed into it
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip()
    )
    (site / "_msllm_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(py),
            "install",
            "--no-index",
            "-q",
            "-c",
            str(REPO / "requirements.lock"),
            str(wheel),
        ],
        cwd=tmp_path,
    )

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSLLM_ARTIFACTS", "VIRTUAL_ENV")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", GLOG_v="3", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    work = tmp_path / "work"  # outside the repo
    work.mkdir()
    probe = json.loads(
        _run(
            [
                str(py),
                "-c",
                (
                    "import json, tasks, tasks.cli, model, flows, tasks.stages.evaluate as ev, "
                    "tasks.runtime.distributed as d\n"
                    "print(json.dumps({'tasks': list(tasks.__path__), 'cli': tasks.cli.__file__,"
                    " 'model': model.__file__,"
                    " 'flows': flows.__file__, 'lm_tasks': len(list(ev.LOCAL_TASKS.glob('*.yaml'))),"
                    " 'worker': d.WORKER.is_file()}))"
                ),
            ],
            cwd=work,
            env=env,
        )
    )
    assert probe["tasks"] == [str(site / "tasks")], probe
    for key in ("cli", "model", "flows"):
        assert Path(probe[key]).is_relative_to(site), probe
    assert (
        probe["lm_tasks"] == len(list((REPO / "tasks/stages/evaluate/lm_tasks").glob("*.yaml"))) > 0
    )  # package data shipped
    assert probe["worker"], "the msrun worker script is not in the installed package"

    # 3. the CLI, from a directory outside the repo: a starter project from the package, then every stage it needs
    out = _run([msllm_bin := str(venv / "bin" / "msllm"), "init", "proj"], cwd=work, env=env)
    proj = work / "proj"
    assert out.strip().splitlines()[-1] == str(proj) and (proj / "pipelines.yaml").is_file()
    out = _run([msllm_bin, "validate"], cwd=proj, env=env)
    assert "pipeline 'tiny' is valid" in out
    out = _run([msllm_bin, "data"], cwd=proj, env=env)
    art = Path(out.strip().splitlines()[-1])
    assert art.parent == proj / "artifacts" / "data", out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["stage"] == "data"
    assert (art / "tokenizer.model").is_file() and list((art / "train").glob("*.mindrecord"))
    short = [
        "--set",
        "pretrain.train.loop.max_steps=3",
        "--set",
        "pretrain.train.loop.eval_steps=3",
        "--set",
        "checkpoint.save_steps=3",
        "--set",
        "pretrain.train.schedule.warmup_steps=1",
    ]
    out = _run([msllm_bin, "train", *short], cwd=proj, env=env, timeout=900)
    model = Path(out.strip().splitlines()[-1])
    assert model.parent == proj / "artifacts" / "pretrain"
    r = subprocess.run(
        [msllm_bin, "eval", "--set", "eval.tasks=[local_arc_easy, local_boolq]", "--set", "eval.limit=2"],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    ev = Path(r.stdout.strip().splitlines()[-1])
    m = json.loads((ev / "manifest.json").read_text())
    assert 0.0 <= m["metrics"]["local_arc_easy.acc"] <= 1.0 and "local_boolq.acc" in m["metrics"]
    assert m["model_choice"]["artifact"] == f"pretrain/{model.name}" and f"model pretrain/{model.name}" in r.stderr
    # a closed pipe is not an error
    r = subprocess.run(
        ["bash", "-c", f"{msllm_bin} lineage {ev} --format json | head -1; exit ${{PIPESTATUS[0]}}"],
        cwd=proj,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode in (0, 141) and "rror" not in r.stderr, r.stderr
