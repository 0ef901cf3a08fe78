#!/usr/bin/env bash
# Create .venv and install moetool. torch is installed first, pinned, so nothing pulls a CUDA build.
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # + test and lint tools
#   bash scripts/setup.sh --bench  # + mergekit for bench/
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
for arg in "$@"; do
  case "$arg" in
    --dev) extras="${extras:+$extras,}dev" ;;
    --bench) extras="${extras:+$extras,}bench" ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}" 2>&1 | grep -v "is ignored: it is neither" || true
.venv/bin/python -c "import torch, transformers, moetool; print('moetool', moetool.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
