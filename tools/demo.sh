#!/usr/bin/env bash
# Sets up the machine, builds offloadd and its Python package, starts offloadd
# with its embedded defaults plus an NVMe tier in a directory this script
# creates (and a host pool smaller than the model's optimizer state, so that
# the state really lives on NVMe), trains a small GPT-style transformer
# through it with offloadd.torch (and the same model in-process with
# torch.optim.AdamW, to compare), shows what offloadd reports, and stops it.
#
# OFFLOADD_DEMO_DIR (default ~/.local/state/offloadd-demo) holds the swap
# space and loss.png. Extra arguments go to the trainer
# (client/python/demo/train_gpt.py --help), e.g. --steps 100.
# The C++ example trainer: bazel run //client/demo:offload_demo (with a daemon up).
set -euo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh
bazel build //daemon:offloadd //client:offloadctl //client/python:package

bin=bazel-bin
demo_dir="${OFFLOADD_DEMO_DIR:-${XDG_STATE_HOME:-$HOME/.local/state}/offloadd-demo}"
mkdir -p "$demo_dir/swap"
"$bin/daemon/offloadd" --nvme.dirs="$demo_dir/swap" --nvme.bytes_per_dir=256MiB \
  --memory.host_budget_bytes=12MiB &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null' EXIT

for _ in $(seq 1 500); do
  "$bin/client/offloadctl" status >/dev/null 2>&1 && break
  kill -0 $daemon 2>/dev/null || { echo "offloadd exited; see above" >&2; exit 1; }
  sleep 0.02
done

echo; echo "== offloadctl status"; "$bin/client/offloadctl" status
echo; echo "== demo trainer: offloadd.torch.wrap(model) with the optimizer state on NVMe ($demo_dir/swap)"
PYTHONPATH="$bin/client/python/site" /usr/bin/python3 client/python/demo/train_gpt.py \
  --out "$demo_dir" "$@"
echo; echo "== offloadctl stats"; "$bin/client/offloadctl" stats

kill -TERM $daemon
wait $daemon
trap - EXIT
echo; echo "offloadd stopped"
