#!/usr/bin/env bash
# Build the local stand-in for `python:3.11-slim`: Debian bookworm (minbase) with Debian's
# Python 3.11, imported as rlfleet/base:bookworm. For machines that cannot pull from a registry
# (the images' `ARG BASE_IMAGE` defaults to the official image everywhere else).
#
#   deploy/scripts/base-image.sh            # skips the build when the image exists
#   RLFLEET_BASE_REBUILD=1 deploy/scripts/base-image.sh
#
# Needs root (debootstrap), a reachable Debian mirror and a Docker engine ($DOCKER_HOST).
# Packages: python3 + python3-venv (the images make a venv), ca-certificates, libglib2.0-0
# (pygame, which flappy-bird-gymnasium imports, needs libgthread; without it the env server's
# ListEnvs fails as a whole), libgomp1 (OpenMP of the CPU wheels that do not bundle it).
set -euo pipefail

IMAGE="${RLFLEET_BASE_IMAGE:-rlfleet/base:bookworm}"
SUITE=bookworm
PACKAGES=python3,python3-venv,ca-certificates,libglib2.0-0,libgomp1
CACHE="${RLFLEET_CACHE_DIR:-$HOME/.cache/rlfleet}"

say() { echo "base-image: $*" >&2; }

if [[ -z "${RLFLEET_BASE_REBUILD:-}" ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    say "$IMAGE exists (RLFLEET_BASE_REBUILD=1 rebuilds it)"
    exit 0
fi
command -v debootstrap >/dev/null || { say "debootstrap missing: deploy/scripts/docker-engine.sh start installs it"; exit 1; }

# The mirror apt already uses on this machine (deb822 or one-line sources), else Debian's.
mirror=$(grep -hoE '^URIs: *\S+' /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '{print $2}' | grep -v security | head -n1 || true)
[[ -n "$mirror" ]] || mirror=$(grep -hoE '^deb +\S+' /etc/apt/sources.list 2>/dev/null | awk '{print $2}' | head -n1 || true)
mirror="${RLFLEET_DEBIAN_MIRROR:-${mirror:-http://deb.debian.org/debian}}"

mkdir -p "$CACHE"
root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
trap 'rm -rf "$root"' EXIT
say "debootstrap $SUITE from $mirror (about a minute)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$mirror" >"$CACHE/debootstrap.log" 2>&1 ||
    { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$IMAGE" >/dev/null
say "built $IMAGE ($(docker image inspect "$IMAGE" --format '{{.Size}}' | numfmt --to=iec))"
