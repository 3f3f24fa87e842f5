#!/usr/bin/env bash
# README command (b): set up .venv if needed, then run the tests in tiers: the unit tier (under
# 2 minutes on 2 cores: no msrun, no training children, no servers), the integration tests
# (stages, msrun, servers; with the unit tier under 10 minutes), then the slow ones (Prefect server
# and work pools, Dask, end-to-end flows), then the CPU-sensitive tests again as an AVX2-only CPU: natively with
# every library capped at AVX2, and on an emulated one (scripts/test_emulated_cpu.sh). This is what CI runs.
#   bash scripts/test.sh unit      # the unit tier alone
#   bash scripts/test.sh -k data   # any other arguments go to pytest instead
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3
unset PREFECT_API_URL
if [ "${1:-}" = "unit" ]; then
  exec .venv/bin/python -m pytest -m "not slow and not integration"
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest "$@"
fi
echo "[test] unit tier"
.venv/bin/python -m pytest -m "not slow and not integration"
echo "[test] integration tests"
.venv/bin/python -m pytest -m "integration and not slow"
echo "[test] slow integration tests"
.venv/bin/python -m pytest -m slow --ignore=tests/test_smollm2.py
# the real model in a process of its own: a MindSpore network, a transformers one and lm-eval's, ~2 GB each
echo "[test] slow: SmolLM2-135M against transformers"
.venv/bin/python -m pytest -m slow tests/test_smollm2.py
# the CPU-sensitive tests again as an AVX2-only CPU sums: natively with every library capped at AVX2 (any x86_64
# with AVX2, ~2 minutes), then on an emulated AVX2 + FMA core without AVX-512 or VNNI (skipped without qemu-user)
echo "[test] CPU-sensitive tests capped at AVX2"
bash scripts/test_emulated_cpu.sh --capped
echo "[test] emulated AVX2-only CPU"
bash scripts/test_emulated_cpu.sh
