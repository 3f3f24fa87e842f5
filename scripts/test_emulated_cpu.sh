#!/usr/bin/env bash
# Run tests on an emulated CPU without AVX-512: qemu-user's TCG models an AVX2+FMA x86-64 (no AVX-512, no
# VNNI), so every library that picks its code by CPUID (onnxruntime's MLAS, MindSpore's oneDNN and nnacl,
# OpenBLAS, our kernels) takes the path it takes on such a machine, and an AVX-512 instruction would fault.
# Numerics only: TCG is ~10x slower than the host and says nothing about speed on that CPU.
#   bash scripts/test_emulated_cpu.sh                        # the CPU-sensitive tests (below) on EPYC-Milan (Zen 3)
#   QEMU_CPU=Haswell-v4 bash scripts/test_emulated_cpu.sh    # an Intel AVX2 client core instead
#   bash scripts/test_emulated_cpu.sh -m "not slow and not integration"   # any pytest arguments instead
#   bash scripts/test_emulated_cpu.sh --capped               # the same tests natively, every library capped at AVX2
# Needs Debian's qemu-user (`apt-get install qemu-user`); exits 0 with a line saying so where it is missing.
# Python child processes (sys.executable) run under the same emulator: the shim below is the venv's python.
# --capped needs no emulator: the host's CPU runs the tests with the variables an AVX2 run of the benchmarks sets
# (scripts/bench/host.py isa_env: MSLLM_KERNEL_ISA=avx2, ONEDNN_MAX_CPU_ISA=AVX2, OpenBLAS as Haswell, numpy's
# AVX-512 loops off), so our kernels and MindSpore's oneDNN MatMuls take their AVX2 paths and sum in their order
# (~2 minutes on 2 cores, without SmolLM2). It is not the whole machine (MindSpore's nnacl kernels and onnxruntime's MLAS keep
# the host's ISA), but it is what turned test_eval's `a == b` red on an AVX2-only EPYC (issue 35), and it runs
# wherever the tests run; scripts/test.sh runs it before the emulated run. With SmolLM2's parity tests, ~5 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
# the tests whose bounds depend on the CPU's kernels: int8 MatMul without VNNI, re-scored log-likelihoods,
# the fused kernels against MindSpore's ops, the ISA bodies, the ONNX/MindSpore parity
CPU_SENSITIVE=(tests/test_onnx_decoder.py tests/test_kernels.py tests/test_kernel_isa.py tests/test_model.py
               tests/test_eval.py::test_task_run_returns_the_harness_result_structure
               tests/test_eval.py::test_scorer_splits_calls_by_memory_and_scores_only_what_is_asked
               tests/test_eval.py::test_loglikelihood_equals_sum_of_log_softmax_of_the_logits
               tests/test_eval.py::test_trailing_context_space_moves_to_the_continuation
               tests/test_eval.py::test_rolling_loglikelihood_agrees_with_the_perplexity_function
               tests/test_eval.py::test_perplexity_in_one_window_is_exp_of_the_model_loss)
# --capped also runs SmolLM2-135M's parity with transformers (logits, greedy tokens, lm-eval loglikelihoods and the
# bound they are held to; ~3 minutes): the real model's sums in the AVX2 order. Not emulated (~10x slower under TCG).
CAPPED_ONLY=(tests/test_smollm2.py::test_logits_and_greedy_tokens_equal_transformers
             tests/test_smollm2.py::test_eval_loglikelihoods_equal_lm_eval_hf_on_the_same_weights
             tests/test_smollm2.py::test_loglikelihood_bound_admits_rounding_and_rejects_a_wrong_token)
# MSLLM_JUNIT (set by scripts/test.sh): where pytest writes its JUnit report (one per process: PATH.N.xml)
junit() { [ -n "${MSLLM_JUNIT:-}" ] && echo "--junitxml=$MSLLM_JUNIT${1:+.$1.xml}"; true; }
if [ "${1:-}" = "--capped" ]; then
  shift
  bash scripts/setup.sh >/dev/null
  levels=$(.venv/bin/python -c "from model.cpu import cpu_levels; print(' '.join(cpu_levels()))")
  if [ "$(uname -m)" != "x86_64" ] || [[ " $levels " != *" avx2 "* ]]; then
    echo "[avx2-capped] skipped: needs an x86_64 CPU with AVX2 (this one runs: $levels)"
    exit 0
  fi
  mapfile -t CAP < <(.venv/bin/python -c "import sys; sys.path.insert(0, 'scripts/bench'); from host import isa_env
print('\n'.join(f'{k}={v}' for k, v in isa_env('avx2').items()))")
  echo "[avx2-capped] CPU-sensitive tests on this CPU ($levels) with ${CAP[*]}"
  export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3
  unset PREFECT_API_URL
  [ $# -gt 0 ] || set -- "${CPU_SENSITIVE[@]}" "${CAPPED_ONLY[@]}"
  exec env "${CAP[@]}" .venv/bin/python -m pytest -p no:cacheprovider $(junit) -m "" "$@"
fi
QEMU=$(command -v qemu-x86_64 || true)
if [ "$(uname -m)" != "x86_64" ] || [ -z "$QEMU" ]; then
  echo "[emulated-cpu] skipped: needs an x86_64 host with qemu-x86_64 (Debian: apt-get install qemu-user)"
  exit 0
fi
bash scripts/setup.sh >/dev/null
CPU=${QEMU_CPU:-EPYC-Milan}
REAL=$(readlink -f .venv/bin/python)
SHIM=$(mktemp -d "${TMPDIR:-/tmp}/msllm-qemu-venv.XXXXXX")
trap 'rm -rf "$SHIM"' EXIT
# a venv whose python is the real interpreter under qemu: pyvenv.cfg beside argv[0] makes it this venv
mkdir -p "$SHIM/bin"
cp .venv/pyvenv.cfg "$SHIM/pyvenv.cfg"
ln -s "$PWD/.venv/lib" "$SHIM/lib"
[ -e .venv/lib64 ] && ln -s "$PWD/.venv/lib64" "$SHIM/lib64"
cat > "$SHIM/bin/python" <<EOF
#!/bin/sh
exec "$QEMU" -cpu "$CPU" -0 "\$0" "$REAL" "\$@" 2> >(grep -v "TCG doesn't support requested feature" >&2)
EOF
# /bin/sh has no process substitution: the filter runs in bash
sed -i '1s|.*|#!/usr/bin/env bash|' "$SHIM/bin/python"
chmod +x "$SHIM/bin/python"
ln -s python "$SHIM/bin/python3"
export PREFECT_SERVER_ANALYTICS_ENABLED=false HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 GLOG_v=3 PATH="$SHIM/bin:$PATH"
unset PREFECT_API_URL
# qemu-user passes the host's /proc/cpuinfo through; model/cpu.py drops what the emulated CPUID lacks
"$SHIM/bin/python" - <<'EOF'
import onnxruntime, os
from model.cpu import cpu_levels
from model.kernel_build import kernel_path
print(f"[emulated-cpu] qemu -cpu {os.environ.get('QEMU_CPU', 'EPYC-Milan')}: kernel levels {', '.join(cpu_levels())}; "
      f"kernels {kernel_path()}; onnxruntime {onnxruntime.__version__}", flush=True)
EOF
if [ "${1:-}" = "--python" ]; then shift; exec "$SHIM/bin/python" "$@"; fi
if [ $# -gt 0 ]; then
  exec "$SHIM/bin/python" -m pytest -p no:cacheprovider "$@"
fi
# CPU_SENSITIVE (above; ~5 min here). One pytest process per file: a fork from an emulated process with many
# threads can hang in qemu-user.
status=0
i=0
for t in "${CPU_SENSITIVE[@]}"; do
  i=$((i + 1))
  echo "[emulated-cpu] $t"
  "$SHIM/bin/python" -m pytest -p no:cacheprovider $(junit $i) -m "" "$t" || status=1
done
exit $status
