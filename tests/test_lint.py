"""The ecosystem's linter and formatter hold the whole tree: `ruff check` and `ruff format --check` (configured and
pinned in pyproject.toml, [tool.ruff]) over model/, tasks/, flows/, scripts/, tests/ and fuzz/. To fix what they
report: `.venv/bin/ruff format . && .venv/bin/ruff check --fix .`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True)


def test_ruff_check_passes():
    r = _ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_ruff_format_leaves_the_tree_as_it_is():
    r = _ruff("format", "--no-cache", "--check", ".")
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


def test_the_pinned_ruff_is_the_one_that_runs():
    """A newer ruff formats differently: the test extra pins the version that wrote the tree."""
    pin = next(
        ln.split("==")[1] for ln in (REPO / "requirements.lock").read_text().splitlines() if ln.startswith("ruff==")
    )
    assert pin in (REPO / "pyproject.toml").read_text()
    assert _ruff("--version").stdout.split()[1] == pin
