#!/usr/bin/env bash
# Builds and tests the Go GameLink SDK offline, from protos/ alone (the recipe of
# docs/game_link.md, "Generate a client in another language"):
#
#   sdk/go/build.sh            # -> sdk/go/build/bin/gamelink-cases
#
# 1. protoc + protoc-gen-go + protoc-gen-go-grpc generate the rlfleet messages and the
#    GameLinkService client into build/gopath/src/rlfleet/gen/go/... (their go_package paths;
#    never committed). google/rpc/status.proto comes from protos/third_party/googleapis for
#    protoc only: its Go package is google.golang.org/genproto/googleapis/rpc/status.
# 2. GOPATH mode (GO111MODULE=off, GOPROXY=off): build/gopath holds the generated code and a
#    links rlfleet/sdk/go/{gamelink,cmd} -> this folder's; /usr/share/gocode holds Debian's grpc-go,
#    protobuf-go and genproto (sdk/go/install-deps.sh installs them).
# 3. gofmt -l, go vet, go test (the package's unit tests), go build of cmd/gamelink-cases.
set -euo pipefail

SDK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$SDK/../.." && pwd)"
BUILD="$SDK/build"
GOPATH_DIR="$BUILD/gopath"

export GO111MODULE=off GOPROXY=off GOFLAGS=
export GOPATH="$GOPATH_DIR:/usr/share/gocode"
export GOCACHE="${GOCACHE:-$BUILD/cache}"

rm -rf "$GOPATH_DIR/src/rlfleet"
mkdir -p "$GOPATH_DIR/src/rlfleet/gen/go" "$GOPATH_DIR/src/rlfleet/sdk/go" "$BUILD/bin"
# The SDK's packages by link (not the whole folder, which holds build/: no cycle).
for dir in gamelink cmd; do ln -sfn "$SDK/$dir" "$GOPATH_DIR/src/rlfleet/sdk/go/$dir"; done

protoc -I "$ROOT/protos" -I "$ROOT/protos/third_party/googleapis" \
  --go_out="$GOPATH_DIR/src" --go-grpc_out="$GOPATH_DIR/src" \
  rlfleet/common/v1/tensor.proto rlfleet/common/v1/space.proto rlfleet/env/v1/game_link.proto

cd "$GOPATH_DIR/src/rlfleet/sdk/go"
unformatted="$(gofmt -l gamelink cmd)"
[ -z "$unformatted" ] || { echo "gofmt: run gofmt -w on $unformatted" >&2; exit 1; }
go vet ./gamelink ./cmd/...
go test ./gamelink
go build -o "$BUILD/bin/gamelink-cases" ./cmd/gamelink-cases
echo "Go SDK built: $BUILD/bin/gamelink-cases"
