#!/usr/bin/env bash
# llama.cpp's own llama-imatrix, llama-quantize and llama-perplexity, built from the llama.cpp that the pinned
# llama-cpp-python vendors (the same quantizer moetool calls), into out/llama-tools/bin. Only the imatrix benchmark
# (bench/imatrix_quality.py, its llama-imatrix anchor) uses them; moetool itself never needs them.
#   bash scripts/build_llama_tools.sh        (~4 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(.venv/bin/python -c "import llama_cpp; print(llama_cpp.__version__)")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src=$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)
cmake -S "$src" -B "$src/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=ON \
  -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=ON >/dev/null
cmake --build "$src/build" -j"$(nproc)" --target llama-imatrix llama-quantize llama-perplexity >/dev/null
mkdir -p out/llama-tools/bin
cp "$src"/build/bin/llama-{imatrix,quantize,perplexity} out/llama-tools/bin/
echo "built out/llama-tools/bin/llama-{imatrix,quantize,perplexity} from llama-cpp-python $version's llama.cpp"
