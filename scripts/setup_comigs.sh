#!/usr/bin/env bash
# Flower for `method: comigs` in its own venv, .venv-flwr (like .venv-litert): flwr 1.41 pins protobuf < 7,
# typer < 0.21, rich < 15 and packaging < 26, below what the main .venv runs (onnx, coremltools, transformers), and
# flwr 1.42.0 cannot be installed at all (it needs certifi >= 2026.10.19, which is not published).
#   bash scripts/setup_comigs.sh
#   .venv-flwr/bin/moetool comigs train recipes/demo-comigs.yaml -o out/comigs-flower --engine flower
#   .venv-flwr/bin/python examples/comigs-flower/launch.py recipes/demo-comigs.yaml -o out/comigs-deploy  # deployment
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/side_venv.sh .venv-flwr comigs \
  "import flwr, moetool.methods.comigs.flower, moetool.methods.comigs.pki; print('flower venv: flwr', flwr.__version__, 'ok')"
