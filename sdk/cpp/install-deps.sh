#!/usr/bin/env bash
# Installs what the C++ GameLink SDK builds with, from Debian/Ubuntu packages, when missing:
# gRPC C++ (libgrpc++-dev), protoc and its gRPC plugin, CMake, g++, pkg-config, GoogleTest.
# Idempotent: prints "C++ SDK dependencies present" and does nothing when all are installed.
# Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(libgrpc++-dev libprotobuf-dev protobuf-compiler protobuf-compiler-grpc cmake g++
  pkg-config libgtest-dev)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "C++ SDK dependencies present"
  exit 0
fi

if ! command -v apt-get >/dev/null; then
  echo "missing ${missing[*]}: install them with your system's package manager" >&2
  exit 1
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  command -v sudo >/dev/null || { echo "missing ${missing[*]}: run as root to install" >&2; exit 1; }
  sudo=(sudo)
fi

echo "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
# A fresh machine may have no package lists yet; update only when the install cannot find one.
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}" ||
  { "${sudo[@]}" apt-get update -q && "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"; }
