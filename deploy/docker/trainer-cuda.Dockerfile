# The CUDA trainer image for NVIDIA hosts: learner (DeepSpeed), LM sampler (vLLM), rollout
# driver, game actors. Built where a package index is reachable (the CUDA torch, vLLM and their
# NVIDIA libraries come from PyPI); the project wheel comes from the wheelhouse context:
#
#   docker build -f deploy/docker/trainer-cuda.Dockerfile -t rlfleet/trainer-cuda:dev \
#       "$(deploy/scripts/wheelhouse.sh)"
#
# BASE_IMAGE: a CUDA runtime image with Python 3.11+ and venv; the default is NVIDIA's
# Ubuntu 24.04 runtime (Python 3.12). The versions below are the CPU image's, in their CUDA
# builds: vLLM 0.32.0 pins torch 2.13.0, DeepSpeed is built against that torch (no isolation).
ARG BASE_IMAGE=nvidia/cuda:12.9.1-cudnn-runtime-ubuntu24.04

FROM ${BASE_IMAGE} AS build
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0
ARG DEEPSPEED_VERSION=0.19.8
# g++ and the Python headers: DeepSpeed's ops build (its JIT needs them at run time too).
# Ubuntu's package versions are not pinned: the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/rlfleet \
    && /opt/rlfleet/bin/pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && /opt/rlfleet/bin/pip install --no-cache-dir "vllm==${VLLM_VERSION}" \
    && /opt/rlfleet/bin/pip install --no-cache-dir --no-build-isolation \
        "deepspeed==${DEEPSPEED_VERSION}"
COPY project/ /project/
# vLLM's torchvision/torchaudio are unused, and a mismatched build breaks `import transformers`.
RUN /opt/rlfleet/bin/pip install --no-cache-dir \
        "$(ls /project/rlfleet-*.whl)[env,sampler,learner,reward,otlp]" \
    && /opt/rlfleet/bin/pip uninstall -y torchvision torchaudio torchcodec

FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 g++ libglib2.0-0 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 --user-group rlfleet \
    && mkdir -p /data && chown rlfleet:rlfleet /data
COPY --from=build /opt/rlfleet /opt/rlfleet
ENV PATH=/opt/rlfleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RLFLEET_RUN_DIR=/data \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    TORCH_EXTENSIONS_DIR=/home/rlfleet/.cache/torch_extensions
USER 10001:10001
WORKDIR /home/rlfleet
EXPOSE 50051 9100
HEALTHCHECK --interval=5s --timeout=5s --start-period=300s --retries=3 \
    CMD ["rlfleet", "health", "127.0.0.1:50051"]
ENTRYPOINT ["rlfleet", "serve"]
