#!/usr/bin/env bash
# Lint every .proto under protos/ with buf (rules in buf.yaml), without network access.
#
#   scripts/buf_lint.sh                 # exit 0 when clean, non-zero on lint errors
#   PYTHON=/path/to/python scripts/buf_lint.sh
#
# buf comes from the npm package @bufbuild/buf (pinned below), installed on first use into
# .buf-tools/ (git-ignored). google/rpc/status.proto comes from the installed
# googleapis-common-protos Python package, which the project depends on anyway: it is copied
# into a temporary second module of a temporary buf workspace (never linted, never committed),
# because the Buf Schema Registry is not reachable from the build machines.
set -euo pipefail

BUF_VERSION="1.75.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.buf-tools"

# A Python with googleapis-common-protos: $PYTHON, else the active venv, else .venv, else python3.
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
  elif [[ -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON="$ROOT/.venv/bin/python"
  else
    PYTHON="python3"
  fi
fi

# buf: $BUF if set, else the pinned npm package under .buf-tools/.
if [[ -z "${BUF:-}" ]]; then
  BUF="$TOOLS/node_modules/.bin/buf"
  if [[ ! -x "$BUF" ]] || [[ "$("$BUF" --version 2>/dev/null)" != "$BUF_VERSION" ]]; then
    echo "buf_lint: installing @bufbuild/buf@$BUF_VERSION into .buf-tools/" >&2
    npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$TOOLS" \
      "@bufbuild/buf@$BUF_VERSION" >&2
  fi
fi

STATUS_PROTO="$("$PYTHON" - <<'EOF'
import pathlib
import sys

try:
    from google.rpc import status_pb2
except ImportError:
    sys.exit("buf_lint: this Python lacks googleapis-common-protos; set PYTHON=<venv>/bin/python")
path = pathlib.Path(status_pb2.__file__).with_name("status.proto")
if not path.is_file():
    sys.exit(f"buf_lint: {path} is missing from googleapis-common-protos")
print(path)
EOF
)"

WORK="$(mktemp -d "${TMPDIR:-/tmp}/rlfleet-buf.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

# The workspace: protos/ (a link to the real one, so reported paths read as in the repository)
# plus the googleapis copy as a second module. buf.yaml is the repository's, with that module
# added; `buf lint protos` then lints only the first module and resolves imports from both.
ln -s "$ROOT/protos" "$WORK/protos"
mkdir -p "$WORK/third_party/googleapis/google/rpc"
cp "$STATUS_PROTO" "$WORK/third_party/googleapis/google/rpc/status.proto"
"$PYTHON" - "$ROOT/buf.yaml" "$WORK/buf.yaml" <<'EOF'
import sys

import yaml

with open(sys.argv[1]) as f:
    config = yaml.safe_load(f)
modules = config.setdefault("modules", [])
if [m.get("path") for m in modules] != ["protos"]:
    sys.exit(f"buf_lint: expected buf.yaml to declare exactly the module 'protos', got {modules}")
modules.append({"path": "third_party/googleapis"})
with open(sys.argv[2], "w") as f:
    yaml.safe_dump(config, f, sort_keys=False)
EOF

cd "$WORK"
"$BUF" build protos --error-format=text -o /dev/null
"$BUF" lint protos --error-format=text
# Layout too: `buf format -w protos` (from .buf-tools/node_modules/.bin) fixes what this reports.
"$BUF" format protos --diff --exit-code
echo "buf lint: OK ($(find -L protos -name '*.proto' | wc -l) files, formatted)"
