#!/usr/bin/env bash
# README command (b): set up .venv if needed, then run the tests: the fast suite first
# (under 10 minutes on 2 cores), then the slow integration tests (Prefect server, Dask,
# end-to-end flows). Arguments, when given, go to pytest instead (e.g. `-m slow`, `-k data`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3
unset PREFECT_API_URL
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
echo "[test] fast suite"
.venv/bin/python -m pytest -m "not slow"
echo "[test] slow integration tests"
.venv/bin/python -m pytest -m slow
