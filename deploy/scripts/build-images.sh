#!/usr/bin/env bash
# Build rlfleet's CPU images from the wheelhouse, with no network inside the builds:
#
#   rlfleet/slim:$TAG     env_server, reward_service, gateway, and the nats-server binary
#   rlfleet/trainer:$TAG  learner, game actors, LM sampler (vLLM CPU), rollout driver
#   rlfleet/prometheus:$TAG  the compose `observability` profile (Debian's prometheus package;
#                         the one build WITH network: apt reaches the base image's Debian mirror)
#
#   deploy/scripts/build-images.sh                 # TAG=dev, BASE_IMAGE=python:3.11-slim
#   BASE_IMAGE=rlfleet/base:bookworm deploy/scripts/build-images.sh   # no registry: local base
#
# BASE_IMAGE: the official python:3.11-slim where a registry can be reached (pull it first:
# builds run with --network=none), else rlfleet/base:bookworm (deploy/scripts/base-image.sh).
# The classic builder is used (DOCKER_BUILDKIT=0): it needs no buildx plugin, and the
# Dockerfiles use nothing BuildKit-only. Layers are cached by the engine: an unchanged
# wheelhouse rebuilds only the project layer.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
TAG="${TAG:-dev}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
CONTEXT="${RLFLEET_WHEELHOUSE:-$("$REPO/deploy/scripts/wheelhouse.sh")}"

for image in slim trainer; do
    start=$SECONDS
    DOCKER_BUILDKIT=0 docker build --quiet --network=none --force-rm \
        --build-arg BASE_IMAGE="$BASE_IMAGE" \
        -f "$REPO/deploy/docker/$image.Dockerfile" -t "rlfleet/$image:$TAG" "$CONTEXT" >/dev/null
    echo "build-images: rlfleet/$image:$TAG in $((SECONDS - start))s" >&2
done

# Prometheus is no Python package, so it is not in the wheelhouse: apt installs it, which needs
# the network. Its context is deploy/prometheus/ (the config is mounted by compose, not copied).
start=$SECONDS
DOCKER_BUILDKIT=0 docker build --quiet --force-rm \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -f "$REPO/deploy/docker/prometheus.Dockerfile" -t "rlfleet/prometheus:$TAG" \
    "$REPO/deploy/prometheus" >/dev/null
echo "build-images: rlfleet/prometheus:$TAG in $((SECONDS - start))s" >&2
