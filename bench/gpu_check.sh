#!/usr/bin/env bash
# On a CUDA machine with torch and triton installed, from the repository root:
#   bash bench/gpu_check.sh CONFIG_DIR
# CONFIG_DIR holds a Llama config.json and tokenizer files (random weights are made from it).
# Runs the kernel tests natively, then kernel microbenchmarks and engine decode throughput (under 5 minutes).
set -euo pipefail
config_dir=${1:?usage: bash bench/gpu_check.sh CONFIG_DIR}
export TRITON_INTERPRET=0 HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
unset TRITONLLM_FORCE_KERNELS
if python -c "import pytest" 2>/dev/null; then
    # the engine test needs the default model's weights; -p no:cacheprovider: the copy may be read-only
    timeout 150 python -m pytest tests/kernels -q -p no:cacheprovider \
        --deselect tests/kernels/test_engine_kernels.py::test_greedy_generation_matches_torch_path
else
    echo "pytest is not installed here: kernel tests skipped" >&2
fi
timeout 150 python bench/gpu_kernels_bench.py "$config_dir"
