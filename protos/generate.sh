#!/bin/sh
# Generates the Python stubs of protos/pagedkv/v1/*.proto into base/v1, the base layer that
# both planes import (Makefile `make proto` and the Docker images run this one script).
# protoc names the modules after the .proto paths (pagedkv/v1/...), so it writes to a scratch
# dir; the stubs' imports of each other become relative and their module names base.v1.
# `pagedkv.v1` stays importable as an alias (pagedkv/v1/__init__.py). Usage: generate.sh [PYTHON]
set -eu
PY=${1:-python3}
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"$PY" -m grpc_tools.protoc -Iprotos --python_out="$tmp" --pyi_out="$tmp" --grpc_python_out="$tmp" \
    protos/pagedkv/v1/*.proto
sed -i -e 's/^from pagedkv\.v1 import /from . import /' \
    -e "s/'pagedkv\.v1\.\([a-z_0-9]*\)'/'base.v1.\1'/" "$tmp"/pagedkv/v1/*.py "$tmp"/pagedkv/v1/*.pyi
mkdir -p base/v1
rm -f base/v1/*_pb2*.py base/v1/*_pb2*.pyi
mv "$tmp"/pagedkv/v1/*_pb2*.py "$tmp"/pagedkv/v1/*_pb2*.pyi base/v1/
touch base/v1/__init__.py
