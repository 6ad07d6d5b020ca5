#!/usr/bin/env bash
# benches/session_churn.py with the offloadd binary and Python package built here.
# usage (from the repository root, after bazel build -c opt //benches:session_churn):
#   bazel-bin/benches/session_churn [--partitions=N --cycles=C]
set -euo pipefail
cd "${RUNFILES_DIR:-$0.runfiles}/offloadd" 2>/dev/null || cd "$(dirname "$0")/.."
PYTHONPATH=client/python/site exec /usr/bin/python3 benches/session_churn.py \
  --offloadd=daemon/offloadd "$@"
