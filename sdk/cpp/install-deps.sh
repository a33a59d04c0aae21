#!/usr/bin/env bash
# Installs what the C++ GameLink SDK builds with, from Debian/Ubuntu packages, when missing:
# gRPC C++ (libgrpc++-dev), protoc and its gRPC plugin, CMake, g++, pkg-config, GoogleTest.
# Idempotent: prints "C++ SDK dependencies present" and does nothing when all are installed.
# Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc cmake g++
  pkg-config libgtest-dev)

exec "$(dirname "$0")/../../scripts/debian-packages.sh" "C++ SDK" "${packages[@]}"
