#!/usr/bin/env bash
# The Python binding (client/python) against a real offloadd, with torch.
set -euo pipefail
dir=$(mktemp -d /tmp/python_client_test.XXXXXX)
daemon_pid=
cleanup() { [[ -n $daemon_pid ]] && kill -9 "$daemon_pid" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
daemon/offloadd --server.data_dir="$dir" >"$dir/log" 2>&1 &
daemon_pid=$!
tests/wait_for_daemon "$daemon_pid" "$dir/log" "$dir/offloadd.sock" || {
  echo "offloadd did not start" >&2
  exit 1
}
export OFFLOADD_ADDRESS="unix:$dir/offloadd.sock"
PYTHONPATH=client/python/site /usr/bin/python3 tests/python_client_test.py -v
