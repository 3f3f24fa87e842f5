#!/usr/bin/env bash
# README command (b): set up .venv if needed, then run the tests in tiers: the unit tier (under 2 minutes on 2 cores:
# no msrun, no training children, no servers), the integration tests (stages, msrun, servers; with the unit tier
# under 10 minutes), then the slow ones (Prefect server and work pools, Dask, end-to-end flows), SmolLM2-135M against
# transformers, then the CPU-sensitive tests again as an AVX2-only CPU: natively with every library capped at AVX2
# (SmolLM2's parity tests included), and on an emulated one (scripts/test_emulated_cpu.sh). This is what CI runs.
# Every tier runs even when one before it failed; each prints its time at its end, and the last lines are a table of
# the tiers and the total (`total: N passed, N failed, N skipped`); the exit status is non-zero when any tier failed.
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
REPORTS=$(mktemp -d "${TMPDIR:-/tmp}/msllm-tiers.XXXXXX")
trap 'rm -rf "$REPORTS"' EXIT
START=$SECONDS
status=0
n=0
# tier NAME pytest ARGS... | tier NAME COMMAND...: runs it, prints its time, keeps its status and its JUnit report
# (pytest's --junitxml; a script is handed the path as MSLLM_JUNIT: scripts/test_emulated_cpu.sh)
tier() {
  local name=$1 t0=$SECONDS rc=0
  shift
  n=$((n + 1))
  local xml="$REPORTS/$(printf %02d $n).xml"
  echo "[test] $name"
  if [ "$1" = pytest ]; then
    shift
    .venv/bin/python -m pytest --junitxml="$xml" "$@" || rc=$?
  else
    MSLLM_JUNIT="$xml" "$@" || rc=$?
  fi
  local dt=$((SECONDS - t0))
  printf '%s\t%d\t%d\t%s\n' "$name" "$dt" "$rc" "$xml" >> "$REPORTS/tiers.tsv"
  printf '[test] %s: %dm%02ds, exit %d\n' "$name" $((dt / 60)) $((dt % 60)) "$rc"
  [ "$rc" -eq 0 ] || status=1
}
tier "unit tier" pytest -m "not slow and not integration"
tier "integration tests" pytest -m "integration and not slow" --durations=15
tier "slow integration tests" pytest -m slow --ignore=tests/test_smollm2.py --durations=15
# the real model in a process of its own: a MindSpore network, a transformers one and lm-eval's, ~2 GB each
tier "slow: SmolLM2-135M against transformers" pytest -m slow tests/test_smollm2.py
# the CPU-sensitive tests again as an AVX2-only CPU sums: natively with every library capped at AVX2 (any x86_64
# with AVX2, ~5 minutes with SmolLM2's parity tests), then on an emulated AVX2 + FMA core without AVX-512 or VNNI
# (skipped without qemu-user)
tier "CPU-sensitive tests capped at AVX2" bash scripts/test_emulated_cpu.sh --capped
tier "emulated AVX2-only CPU" bash scripts/test_emulated_cpu.sh
.venv/bin/python scripts/test_report.py "$REPORTS/tiers.tsv" $((SECONDS - START))
exit $status
