#!/usr/bin/env bash
# Build rlfleet's CPU images from the wheelhouse, with no network inside the builds:
#
#   rlfleet/slim:$TAG     env_server, reward_service, gateway, and the nats-server binary
#   rlfleet/trainer:$TAG  learner, game actors, LM sampler (vLLM CPU), rollout driver
#   rlfleet/prometheus:$TAG  the compose `observability` profile's metrics (Debian's prometheus
#                         package: a build WITH network, apt reaches the base image's mirror)
#   rlfleet/phoenix:$TAG  the `observability` profile's trace collector and viewer (Arize
#                         Phoenix, from wheels downloaded here: no network in the build)
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

# Phoenix is no dependency of the project, so it is not in the wheelhouse: its wheels are
# downloaded here once per version into a cache of their own (pip on the host reaches PyPI;
# image builds do not), then installed with no network like the rlfleet images.
PHOENIX="arize-phoenix==20.26.1"
phoenix_wheels="${RLFLEET_CACHE_DIR:-$HOME/.cache/rlfleet}/phoenix/${PHOENIX#*==}"
if [ ! -f "$phoenix_wheels/.complete" ]; then
    start=$SECONDS
    rm -rf "$phoenix_wheels" && mkdir -p "$phoenix_wheels/wheels"
    "${PYTHON:-$REPO/.venv/bin/python}" -m pip download --quiet --disable-pip-version-check \
        --only-binary=:all: -d "$phoenix_wheels/wheels" "$PHOENIX" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
    touch "$phoenix_wheels/.complete"
    echo "build-images: $PHOENIX wheels in $((SECONDS - start))s" >&2
fi
start=$SECONDS
DOCKER_BUILDKIT=0 docker build --quiet --network=none --force-rm \
    --build-arg BASE_IMAGE="$BASE_IMAGE" \
    -f "$REPO/deploy/docker/phoenix.Dockerfile" -t "rlfleet/phoenix:$TAG" \
    "$phoenix_wheels" >/dev/null
echo "build-images: rlfleet/phoenix:$TAG in $((SECONDS - start))s" >&2
