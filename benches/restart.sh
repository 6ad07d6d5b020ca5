#!/usr/bin/env bash
# benches/restart.py with the offloadd binary and Python package built here.
# usage (from the repository root, after bazel build -c opt //benches:restart):
#   bazel-bin/benches/restart [--params=P --dir=DIR ...]
set -euo pipefail
cd "${RUNFILES_DIR:-$0.runfiles}/offloadd" 2>/dev/null || cd "$(dirname "$0")/.."
PYTHONPATH=client/python/site exec /usr/bin/python3 benches/restart.py \
  --offloadd=daemon/offloadd "$@"
