#!/usr/bin/env bash
# Lint every .proto under protos/ with buf (rules in buf.yaml), without network access.
#
#   scripts/buf_lint.sh                 # exit 0 when clean, non-zero on lint errors
#   BUF=/path/to/buf scripts/buf_lint.sh  # another buf binary
#
# buf comes from the npm package @bufbuild/buf (pinned below), installed on first use into
# .buf-tools/ (git-ignored). google/rpc/{status,error_details}.proto are vendored under
# protos/third_party/googleapis (a second module in buf.yaml, never linted), because the Buf
# Schema Registry is not reachable from the build machines.
set -euo pipefail

BUF_VERSION="1.75.0"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS="$ROOT/.buf-tools"

# buf: $BUF if set, else the pinned npm package under .buf-tools/.
if [[ -z "${BUF:-}" ]]; then
  BUF="$TOOLS/node_modules/.bin/buf"
  if [[ ! -x "$BUF" ]] || [[ "$("$BUF" --version 2>/dev/null)" != "$BUF_VERSION" ]]; then
    echo "buf_lint: installing @bufbuild/buf@$BUF_VERSION into .buf-tools/" >&2
    npm install --no-save --no-audit --no-fund --loglevel=error --prefix "$TOOLS" \
      "@bufbuild/buf@$BUF_VERSION" >&2
  fi
fi

# Two modules (buf.yaml): protos/ (linted) and the vendored googleapis files under
# protos/third_party/googleapis (imports only, ignored by lint). `buf lint` lints both modules'
# files less the ignored ones; the googleapis copies must stay byte-identical to upstream.
cd "$ROOT"
"$BUF" build --error-format=text -o /dev/null
"$BUF" lint --error-format=text
# Layout too: `buf format -w protos/rlfleet` (from .buf-tools/node_modules/.bin) fixes what this
# reports.
"$BUF" format protos --path protos/rlfleet --diff --exit-code
echo "buf lint: OK ($(find protos/rlfleet -name '*.proto' | wc -l) files, formatted)"
