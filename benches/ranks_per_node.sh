#!/usr/bin/env bash
# benches/ranks_per_node.py with the offloadd binary and Python package built here.
# usage (from the repository root, after bazel build //benches:ranks_per_node):
#   bazel-bin/benches/ranks_per_node [--ranks=N --params=P ...]
set -euo pipefail
cd "${RUNFILES_DIR:-$0.runfiles}/offloadd" 2>/dev/null || cd "$(dirname "$0")/.."
PYTHONPATH=client/python/site exec /usr/bin/python3 benches/ranks_per_node.py \
  --offloadd=daemon/offloadd "$@"
