# The CPU trainer image: learner (DeepSpeed), game actors and the LM sampler (vLLM CPU), the
# rollout driver. torch 2.13.0 CPU, vLLM CPU 0.32.0, DeepSpeed 0.19.8, installed from exact pins
# (trainer.txt) that leave out the CUDA companions (triton, torchvision, ...) which break imports
# beside the CPU torch. See deploy/docker/trainer-cuda.Dockerfile for NVIDIA hosts.
#
#   docker build -f deploy/docker/trainer.Dockerfile -t rlfleet/trainer:dev "$(deploy/scripts/wheelhouse.sh)"
#
# Build context, --network=none and BASE_IMAGE: as in slim.Dockerfile.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
# Labelled so deploy/scripts/build-images.sh prunes this stage once the image is built
# (untagged, it would stay behind as a dangling image of up to several GB).
ARG RLFLEET_STAGE_KEY=""
LABEL org.rlfleet.stage=build org.rlfleet.stage-key="${RLFLEET_STAGE_KEY}"
RUN python3 -m venv /opt/rlfleet
# The wheels stay in this stage; the final image gets only the installed venv.
COPY trainer.txt /tmp/pins.txt
COPY deps/ /wheels/
# Exact pins installed without resolution: what is in the image is exactly trainer.txt.
RUN /opt/rlfleet/bin/pip install --no-cache-dir --no-index --no-deps --find-links /wheels \
        -r /tmp/pins.txt

FROM ${BASE_IMAGE}
RUN useradd --create-home --uid 10001 --user-group rlfleet \
    && mkdir -p /data && chown rlfleet:rlfleet /data
COPY --from=build /opt/rlfleet /opt/rlfleet
# The project last, in its own small layer: a code change rebuilds only this one.
COPY project/ /tmp/project/
RUN /opt/rlfleet/bin/pip install --no-cache-dir --no-index --no-deps /tmp/project/rlfleet-*.whl \
    && rm -rf /tmp/project
# OMP_NUM_THREADS=1: several services share a host's cores; oversubscription is what slows them.
ENV PATH=/opt/rlfleet/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1 \
    RLFLEET_RUN_DIR=/data \
    HF_HUB_OFFLINE=1 \
    VLLM_NO_USAGE_STATS=1 \
    VLLM_CPU_KVCACHE_SPACE=1 \
    TORCH_EXTENSIONS_DIR=/home/rlfleet/.cache/torch_extensions
USER 10001:10001
WORKDIR /home/rlfleet
# 50051: gRPC (`--host 0.0.0.0 --port 50051`), 9100: Prometheus /metrics (RLFLEET_METRICS_PORT).
EXPOSE 50051 9100
HEALTHCHECK --interval=5s --timeout=5s --start-period=60s --retries=3 \
    CMD ["rlfleet", "health", "127.0.0.1:50051"]
ENTRYPOINT ["rlfleet", "serve"]
