#!/usr/bin/env bash
# Usage: scripts/debian-packages.sh WHAT PACKAGE...
# Installs the Debian packages among PACKAGE that are missing (WHAT names them in messages, e.g.
# "C++ SDK"). Idempotent: prints "WHAT dependencies present" and does nothing when all are
# installed. Needs root (or sudo) only when something is missing.
set -euo pipefail

what=$1
shift

missing=()
for package in "$@"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "$what dependencies present"
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
