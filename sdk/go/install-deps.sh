#!/usr/bin/env bash
# Installs what the Go GameLink SDK builds with, from Debian packages, when missing: the Go
# toolchain, protoc, the protoc-gen-go (APIv2) and protoc-gen-go-grpc plugins, and the Go
# libraries in /usr/share/gocode that sdk/go/build.sh compiles against offline (GOPATH mode):
# grpc-go, protobuf-go and genproto (google.golang.org/genproto/googleapis/rpc/{status,errdetails}).
#
# A Debian (bookworm) trap: golang-google-grpc-dev accepts github.com/golang/protobuf 1.3
# (golang-github-golang-protobuf-1-3-dev, pulled in by golang-goprotobuf-dev) whose marshaller
# panics on the first Send of APIv2 messages; golang-github-golang-protobuf-1-5-dev (the v1.5
# shim over google.golang.org/protobuf) is the one that works, and it conflicts with the 1.3
# packages, so golang-goprotobuf-dev is not installed (protoc-gen-go is its own package).
# Idempotent: prints "Go SDK dependencies present" and does nothing when all are installed.
# Needs root (or sudo) only when something is missing.
set -euo pipefail

packages=(golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev
  golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev golang-google-genproto-dev)

exec "$(dirname "$0")/../../scripts/debian-packages.sh" "Go SDK" "${packages[@]}"
