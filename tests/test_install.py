"""A non-editable install works: build the wheel, install it into a fresh virtualenv, run the CLI outside the repo.

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
import yaml

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
        out = subprocess.run(["git", "-C", str(REPO), "ls-files", *PACKAGES], capture_output=True, text=True, check=True)
        files = out.stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        files = [p.relative_to(REPO).as_posix() for pkg in PACKAGES for p in (REPO / pkg).rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"]
    return {f for f in files if (REPO / f).is_file()}


def _absolute_paths(node, base: Path):
    """Relative paths in a pipeline (the corpus sources, say) made absolute, so the file works anywhere."""
    if isinstance(node, dict):
        return {k: _absolute_paths(v, base) for k, v in node.items()}
    if isinstance(node, list):
        return [_absolute_paths(v, base) for v in node]
    if isinstance(node, str) and "/" in node and not Path(node).is_absolute() and (base / node).exists():
        return str(base / node)
    return node


def _tiny_pipelines_file(path: Path) -> None:
    doc = yaml.safe_load((REPO / "pipelines.yaml").read_text())
    pipes, name = {}, "tiny"
    while name and name not in pipes:  # the tiny pipeline and any `base:` it extends
        pipes[name] = _absolute_paths(doc["pipelines"][name], REPO)
        name = pipes[name].get("base")
    path.write_text(yaml.safe_dump({"default": "tiny", "pipelines": pipes}, sort_keys=False))


def test_wheel_installs_and_runs_outside_the_repo(tmp_path):
    # 1. build the wheel from a copy of the sources (the build writes build/ and *.egg-info beside them)
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", str(dist), str(src)], cwd=tmp_path)
    (wheel,) = dist.glob("msllm-*.whl")
    members = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_tracked_package_files() - members)
    assert not missing, f"tracked files left out of the wheel: {missing}"
    assert not [m for m in members if m.endswith(".pyc") or "__pycache__" in m]

    # 2. a fresh virtualenv that sees .venv's dependencies but not the repo, and the wheel installed into it
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    py = venv / "bin" / "python"
    site = Path(_run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp_path).strip())
    (site / "_msllm_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-index", "-q",
          "-c", str(REPO / "requirements.lock"), str(wheel)], cwd=tmp_path)

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MSLLM_ARTIFACTS", "VIRTUAL_ENV")}
    env.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", GLOG_v="3", PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}")
    work = tmp_path / "work"  # outside the repo
    work.mkdir()
    probe = json.loads(_run([str(py), "-c", (
        "import json, tasks, tasks.cli, model, flows, tasks.stages.evaluate as ev, tasks.runtime.distributed as d\n"
        "print(json.dumps({'tasks': list(tasks.__path__), 'cli': tasks.cli.__file__, 'model': model.__file__,"
        " 'flows': flows.__file__, 'lm_tasks': len(list(ev.LOCAL_TASKS.glob('*.yaml'))),"
        " 'worker': d.WORKER.is_file()}))")], cwd=work, env=env))
    assert probe["tasks"] == [str(site / "tasks")], probe
    for key in ("cli", "model", "flows"):
        assert Path(probe[key]).is_relative_to(site), probe
    assert probe["lm_tasks"] == len(list((REPO / "tasks/stages/evaluate/lm_tasks").glob("*.yaml"))) > 0  # package data shipped
    assert probe["worker"], "the msrun worker script is not in the installed package"

    # 3. the CLI, from a directory outside the repo, with a pipelines.yaml that points at the shipped corpus
    _tiny_pipelines_file(work / "pipelines.yaml")
    msllm = str(venv / "bin" / "msllm")
    out = _run([msllm, "validate", "--pipeline", "tiny"], cwd=work, env=env)
    assert "pipeline 'tiny' is valid" in out
    out = _run([msllm, "data", "--pipeline", "tiny"], cwd=work, env=env)
    art = Path(out.strip().splitlines()[-1])
    assert art.parent == work / "artifacts" / "data", out
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["stage"] == "data"
    assert (art / "tokenizer.model").is_file() and list((art / "train").glob("*.mindrecord"))
