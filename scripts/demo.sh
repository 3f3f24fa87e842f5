#!/usr/bin/env bash
# README command (a): set up .venv if needed, then run the demo pipeline end to end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3
exec .venv/bin/python scripts/demo.py "$@"
