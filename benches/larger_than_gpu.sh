#!/usr/bin/env bash
# benches/larger_than_gpu.py with the offloadd binary and Python package built here.
# usage (from the repository root, after bazel build //benches:larger_than_gpu):
#   bazel-bin/benches/larger_than_gpu [--steps=N ...]
set -euo pipefail
cd "${RUNFILES_DIR:-$0.runfiles}/offloadd" 2>/dev/null || cd "$(dirname "$0")/.."
PYTHONPATH=client/python/site exec /usr/bin/python3 benches/larger_than_gpu.py \
  --offloadd=daemon/offloadd "$@"
