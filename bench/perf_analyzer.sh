#!/usr/bin/env bash
# Load the Triton model `llm` directly with NVIDIA's perf_analyzer (gRPC streaming, as a decoupled model needs).
#   bash bench/perf_analyzer.sh [GRPC_URL] [CONCURRENCY_RANGE]     e.g. 127.0.0.1:8001 1:16:4
# Uses perf_analyzer from PATH (e.g. NGC's tritonserver -py3-sdk image); otherwise it takes the binary the
# tritonclient 2.41 wheel still shipped (later wheels dropped it), with libcudart from PyPI; libb64 must be
# installed (Debian: apt-get install libb64-0d).
set -euo pipefail
url=${1:-127.0.0.1:8001}
concurrency=${2:-1:16:4}
cache=${TRITONLLM_CACHE:-$HOME/.cache/tritonllm}/perf_analyzer
python=${PYTHON:-.venv/bin/python}

binary=$(command -v perf_analyzer || true)
if [ -z "$binary" ]; then
    binary=$cache/perf_analyzer
    if [ ! -x "$binary" ]; then
        mkdir -p "$cache"
        "$python" -m pip download -q --no-deps -d "$cache" tritonclient==2.41.0
        unzip -o -q -j "$cache"/tritonclient-2.41.0-*.whl 'tritonclient-2.41.0.data/data/bin/perf_analyzer' -d "$cache"
        chmod +x "$binary"
        "$python" -m pip install -q --target "$cache/cudart" nvidia-cuda-runtime-cu12
    fi
    export LD_LIBRARY_PATH="$cache/cudart/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

data=$(mktemp --suffix=.json)
trap 'rm -f "$data"' EXIT
cat > "$data" <<'JSON'
{"data": [
  {"text_input": ["Write a short essay about the history of Rome."], "stream": [true],
   "sampling_parameters": ["{\"max_tokens\": 64, \"temperature\": 0.7, \"ignore_eos\": true}"]},
  {"text_input": ["Explain how vaccines work, step by step."], "stream": [true],
   "sampling_parameters": ["{\"max_tokens\": 64, \"temperature\": 0.7, \"ignore_eos\": true}"]}
]}
JSON
"$binary" -m llm -u "$url" -i grpc --streaming --input-data "$data" --concurrency-range "$concurrency" \
    --measurement-mode count_windows --measurement-request-count 8 --stability-percentage 50 --max-trials 3
