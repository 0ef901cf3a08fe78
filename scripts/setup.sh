#!/usr/bin/env bash
# Create .venv and install moetool. torch is installed first, pinned, so nothing pulls a CUDA build.
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # + test and lint tools
#   bash scripts/setup.sh --bench  # + mergekit-moe for bench/, in a venv of its own (.venv-mergekit)
#   bash scripts/setup.sh --llama  # + llama-cpp-python (GGUF parity, K-quants); --dev includes it
#   bash scripts/setup.sh --eval   # + lm-evaluation-harness (moetool eval --tasks, the demo's task accuracy); --dev too
#   bash scripts/setup.sh --mlx    # + mlx-lm (MLX export and the consumer check; mlx's CPU build on Linux); --dev too
#   bash scripts/setup.sh --onnx   # + onnx, onnxruntime, onnxscript (ONNX export); --dev includes it
#   bash scripts/setup.sh --executorch / --coreml   # ExecuTorch (XNNPACK) / Core ML export; --dev includes both
#   bash scripts/setup.sh --tflite # litert-torch in its own venv, .venv-litert (it pins typing-extensions and
#                                  # pydantic below what the rest needs); --dev makes it too
#   bash scripts/setup.sh --comigs # Flower (flwr) in its own venv, .venv-flwr (scripts/setup_comigs.sh: flwr pins
#                                  # protobuf, typer, rich below the rest); --dev makes it too
# llama-cpp-python compiles llama.cpp (~12 min on 2 cores) once; pip caches the wheel for later runs.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
tflite=0
comigs=0
bench=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="${extras:+$extras,}dev"; tflite=1; comigs=1 ;;
    --bench) bench=1 ;;
    --llama) extras="${extras:+$extras,}llama" ;;
    --eval) extras="${extras:+$extras,}eval" ;;
    --onnx) extras="${extras:+$extras,}onnx" ;;
    --mlx) extras="${extras:+$extras,}mlx" ;;
    --executorch) extras="${extras:+$extras,}executorch" ;;
    --coreml) extras="${extras:+$extras,}coreml" ;;
    --tflite) tflite=1 ;;
    --comigs) comigs=1 ;;
    *) echo "unknown option: $arg" >&2; exit 2 ;;
  esac
done
py="${PYTHON:-$(command -v python3.11 || command -v python3)}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
export PIP_DISABLE_PIP_VERSION_CHECK=1
# a portable llama.cpp build (AVX2 baseline, not -march=native), so a cached wheel runs on any x86-64 CI machine
export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=OFF}"
.venv/bin/python -m pip install -q torch==2.13.0
log=.venv/pip-install.log
if ! .venv/bin/python -m pip install -q -c constraints.txt -e ".${extras:+[$extras]}" >"$log" 2>&1; then
  grep -v "is ignored: it is neither" "$log" >&2 || true
  echo "setup: pip install failed (full log: $log)" >&2
  exit 1
fi
grep -v "is ignored: it is neither" "$log" || true
.venv/bin/python -c "import torch, transformers, moetool; print('moetool', moetool.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
if [ "$tflite" = 1 ]; then
  bash scripts/side_venv.sh .venv-litert tflite "import litert_torch, ai_edge_litert, litert_lm, litert_lm_builder, moetool; print('tflite venv: litert-torch and LiteRT-LM ok')"
fi
if [ "$comigs" = 1 ]; then
  bash scripts/setup_comigs.sh
fi
if [ "$bench" = 1 ]; then
  # mergekit pins its own transformers/accelerate: kept out of .venv so the versions moetool is tested with never move
  bash scripts/side_venv.sh .venv-mergekit bench "import mergekit; print('bench venv: mergekit ok')"
fi
