#!/usr/bin/env bash
# Flower for `method: comigs` in its own venv, .venv-flwr (like .venv-litert): flwr 1.41 pins protobuf < 7,
# typer < 0.21, rich < 15 and packaging < 26, below what the main .venv runs (onnx, coremltools, transformers), and
# flwr 1.42.0 cannot be installed at all (it needs certifi >= 2026.10.19, which is not published).
#   bash scripts/setup_comigs.sh
#   .venv-flwr/bin/moetool comigs train recipes/demo-comigs.yaml -o out/comigs-flower --engine flower
set -euo pipefail
cd "$(dirname "$0")/.."
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
export PIP_DISABLE_PIP_VERSION_CHECK=1
[ -x .venv-flwr/bin/python ] || "$py" -m venv .venv-flwr
.venv-flwr/bin/python -m pip install -q torch==2.13.0
if ! .venv-flwr/bin/python -m pip install -q -c constraints.txt -e ".[comigs]" >.venv-flwr/pip-install.log 2>&1; then
  grep -v "is ignored: it is neither" .venv-flwr/pip-install.log >&2 || true
  echo "setup: flower venv install failed (full log: .venv-flwr/pip-install.log)" >&2
  exit 1
fi
.venv-flwr/bin/python -c "import flwr, moetool.methods.comigs.flower; print('flower venv: flwr', flwr.__version__, 'ok')"
