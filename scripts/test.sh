#!/usr/bin/env bash
# README command (b): set up .venv if needed, then run the test suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -m slow`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3
exec .venv/bin/python -m pytest "$@"
