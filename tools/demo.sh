#!/usr/bin/env bash
# Sets up the machine, builds offloadd, starts it with its embedded defaults,
# trains the demo MLP through it (and in-process, to compare), shows what
# offloadctl reports, and stops the daemon.
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
bazel build //engine:offloadd //client:offloadctl //client/demo:offload_demo

bin=bazel-bin
"$bin/engine/offloadd" &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT

socket="${XDG_STATE_HOME:-$HOME/.local/state}/offloadd/offloadd.sock"
for _ in $(seq 1 500); do
  "$bin/client/offloadctl" status >/dev/null 2>&1 && break
  kill -0 $daemon 2>/dev/null || { echo "offloadd exited; see above" >&2; exit 1; }
  sleep 0.02
done

echo; echo "== offloadctl status"; "$bin/client/offloadctl" status
echo; echo "== demo trainer (parameters held by offloadd at $socket)"
"$bin/client/demo/offload_demo"
echo; echo "== offloadctl stats"; "$bin/client/offloadctl" stats

kill -TERM $daemon
wait $daemon
trap - EXIT
echo; echo "offloadd stopped"
