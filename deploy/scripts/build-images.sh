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
# wheelhouse rebuilds only the project layer, as long as the build stages are kept.
#
# Build stages: each image's first stage (the venv installed from the wheels, up to several GB)
# is left untagged by the build. At the end this script removes the dangling images labelled
# org.rlfleet.stage=build (set in the Dockerfiles), so only what these builds made goes:
# RLFLEET_KEEP_BUILD_STAGES=1 keeps this build's stages as the layer cache of the next build
# (a code change then rebuilds in seconds instead of reinstalling every wheel) and removes only
# stages an earlier build left that this one no longer uses.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
TAG="${TAG:-dev}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"
CONTEXT="${RLFLEET_WHEELHOUSE:-$("$REPO/deploy/scripts/wheelhouse.sh")}"
BASE_ID=$(docker image inspect --format '{{.Id}}' "$BASE_IMAGE" 2>/dev/null || echo "$BASE_IMAGE")
# What a build stage is made from (the image, its wheels' folder, the base image): the same key
# means the same stage, which the layer cache then reuses (RLFLEET_KEEP_BUILD_STAGES).
stage_key() { printf '%s %s %s' "$1" "$(basename "$2")" "$BASE_ID" | sha256sum | cut -c1-16; }
STAGE_KEYS=()

for image in slim trainer; do
    start=$SECONDS
    STAGE_KEYS+=("$(stage_key "$image" "$CONTEXT")")
    DOCKER_BUILDKIT=0 docker build --quiet --network=none --force-rm \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg RLFLEET_STAGE_KEY="${STAGE_KEYS[-1]}" \
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
STAGE_KEYS+=("$(stage_key phoenix "$phoenix_wheels")")
DOCKER_BUILDKIT=0 docker build --quiet --network=none --force-rm \
    --build-arg BASE_IMAGE="$BASE_IMAGE" --build-arg RLFLEET_STAGE_KEY="${STAGE_KEYS[-1]}" \
    -f "$REPO/deploy/docker/phoenix.Dockerfile" -t "rlfleet/phoenix:$TAG" \
    "$phoenix_wheels" >/dev/null
echo "build-images: rlfleet/phoenix:$TAG in $((SECONDS - start))s" >&2

# The build stages, now dangling: removed, unless kept as the next build's cache (see the top).
keep=" "
[[ "${RLFLEET_KEEP_BUILD_STAGES:-0}" == 1 ]] && keep=" ${STAGE_KEYS[*]} "
removed=0
for id in $(docker images --quiet --no-trunc --filter dangling=true \
    --filter label=org.rlfleet.stage=build | sort -u); do
    key=$(docker image inspect --format '{{index .Config.Labels "org.rlfleet.stage-key"}}' "$id")
    [[ "$keep" == *" $key "* ]] && continue
    # An image a container still uses stays; that is no reason to fail the build.
    docker rmi "$id" >/dev/null 2>&1 && removed=$((removed + 1))
done
echo "build-images: removed $removed dangling build stage(s)" \
    "$([[ "$keep" != " " ]] && echo "(kept this build's: RLFLEET_KEEP_BUILD_STAGES=1)")" >&2
