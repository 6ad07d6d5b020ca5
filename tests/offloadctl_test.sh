#!/usr/bin/env bash
# offloadctl and the demo binary against a real offloadd.
set -euo pipefail
dir=$(mktemp -d /tmp/offloadctl_test.XXXXXX)
daemon_pid=
cleanup() { [[ -n $daemon_pid ]] && kill -9 "$daemon_pid" 2>/dev/null; rm -rf "$dir"; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }

daemon/offloadd --server.data_dir="$dir" >"$dir/log" 2>&1 &
daemon_pid=$!
tests/wait_for_daemon "$daemon_pid" "$dir/log" "$dir/offloadd.sock" || fail "offloadd did not start"
export OFFLOADD_ADDRESS="unix:$dir/offloadd.sock"
ctl=client/offloadctl

out=$($ctl status) || fail "status exited $?"
grep -q "offloadd 0" <<<"$out" || fail "status: $out"
grep -q "tier host" <<<"$out" || fail "status lacks tiers: $out"

out=$($ctl config list)
for name in memory.host_budget_bytes optimizer.threads server.socket server.tcp_port; do
  grep -q "^$name " <<<"$out" || fail "config list lacks $name: $out"
done

out=$($ctl config set optimizer.threads 1)
grep -q "optimizer.threads = 1" <<<"$out" || fail "set: $out"
$ctl config get optimizer.threads | grep -q "= 1" || fail "get after set"

set +e
err=$($ctl config set server.socket /tmp/x 2>&1); rc=$?
set -e
[[ $rc == 1 ]] || fail "static set exited $rc"
grep -q FAILED_PRECONDITION <<<"$err" || fail "static set: $err"
set +e
$ctl frobnicate >/dev/null 2>&1; rc=$?
set -e
[[ $rc == 2 ]] || fail "usage error exited $rc"

client/demo/offload_demo --steps=20 >"$dir/demo" || fail "demo: $(cat "$dir/demo")"
grep -q "OK" "$dir/demo" || fail "demo output: $(cat "$dir/demo")"

out=$($ctl stats)
grep -Eq "^steps +20 " <<<"$out" || fail "stats: $out"

kill -TERM "$daemon_pid"
wait "$daemon_pid" || fail "daemon exited $? on SIGTERM: $(cat "$dir/log")"
daemon_pid=
[[ ! -e $dir/offloadd.sock ]] || fail "socket left behind"
set +e
OFFLOADD_ADDRESS="unix:$dir/offloadd.sock" $ctl status >/dev/null 2>&1; rc=$?
set -e
[[ $rc == 1 ]] || fail "status without daemon exited $rc"
echo PASS
