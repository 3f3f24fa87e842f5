#!/usr/bin/env bash
# Create .venv at the repo root (if missing) and install the project with its pinned
# dependency set (requirements.lock). Skips the install when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $("$PY" --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.msllm-installed
want=$(cat pyproject.toml requirements.lock | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "[setup] installing pinned dependencies (first run: a few minutes)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -c requirements.lock -e ".[test,reference]"
  echo "$want" > "$stamp"
else
  echo "[setup] .venv up to date"
fi
