#!/usr/bin/env bash
# benches/torch_tokens.py with the offloadd binary and Python package built here.
# usage (from the repository root, after bazel build //benches:torch_tokens):
#   bazel-bin/benches/torch_tokens [--steps=N ...]
set -euo pipefail
cd "${RUNFILES_DIR:-$0.runfiles}/offloadd" 2>/dev/null || cd "$(dirname "$0")/.."
PYTHONPATH=client/python/site exec /usr/bin/python3 benches/torch_tokens.py \
  --offloadd=daemon/offloadd "$@"
