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
err=$($ctl top --steps=3 2>&1); rc=$?
set -e
[[ $rc == 2 ]] && grep -q "export's" <<<"$err" || fail "top --steps=3 was taken: $rc $err"
set +e
err=$($ctl frobnicate 2>&1); rc=$?
set -e
[[ $rc == 2 ]] || fail "usage error exited $rc"
grep -q "no command 'frobnicate'" <<<"$err" || fail "usage error says not which word: $err"
set +e
err=$($ctl set optimizer.threads 2 2>&1); rc=$?
set -e
[[ $rc == 2 ]] && grep -q "offloadctl config set" <<<"$err" || fail "set without config: $rc $err"
set +e
err=$($ctl config get 2>&1); rc=$?
set -e
[[ $rc == 2 ]] && grep -q "config is used as: config list" <<<"$err" ||
  fail "config get without a name: $rc $err"

client/demo/offload_demo --steps=20 >"$dir/demo" || fail "demo: $(cat "$dir/demo")"
grep -q "OK" "$dir/demo" || fail "demo output: $(cat "$dir/demo")"

out=$($ctl stats)
grep -Eq "^steps +20 " <<<"$out" || fail "stats: $out"

# doctor with a daemon: its live settings.
set +e
out=$($ctl doctor 2>&1); rc=$?
set -e
[[ $rc -le 2 ]] || fail "doctor exited $rc: $out"
grep -q "^settings: the running offloadd's at unix:$dir/offloadd.sock" <<<"$out" || fail "doctor settings: $out"

# top, in a terminal as a person sees it (tmux), while the demo trains:
# its session's row with steps a second and the step split; redrawn.
command -v tmux >/dev/null || fail "tmux is missing (tools/setup.sh installs it)"
client/demo/offload_demo --steps=100000 --mode=daemon >"$dir/demo2" 2>&1 &
demo_pid=$!
tmux_sock="$dir/tmux"
tmux -S "$tmux_sock" new-session -d -x 220 -y 30 \
  "OFFLOADD_ADDRESS=$OFFLOADD_ADDRESS $PWD/$ctl top --interval=0.3; sleep 30"
screen=""
for _ in $(seq 100); do
  sleep 0.1
  screen=$(tmux -S "$tmux_sock" capture-pane -p)
  grep -Eq "^[0-9]+ +offload_demo +[0-9]+ +[0-9]+ .* [0-9]+\.[0-9]{2} +[0-9.]+ +[0-9]+% +[0-9]+% " <<<"$screen" && break
done
# The demo session's weight in the node's optimizer, set live.
id=$(grep -Eo "^[0-9]+ +offload_demo" <<<"$screen" | awk '{print $1}')
[[ -n $id ]] || fail "no demo session id in: $screen"
out=$($ctl share "$id" 3) || fail "share: $out"
[[ $out == "session $id: share weight 3" ]] || fail "share: $out"
set +e
err=$($ctl share "$id" 0 2>&1); rc=$?
[[ $rc == 1 ]] && grep -q INVALID_ARGUMENT <<<"$err" || fail "share 0 exited $rc: $err"
# Ids and weights that are not numbers: usage errors (2), daemon or not.
for bad in "share abc 3" "share $id x" "checkpoint x /tmp/d"; do
  err=$($ctl $bad 2>&1); rc=$?
  [[ $rc == 2 ]] && grep -q "is not a number" <<<"$err" || fail "$bad exited $rc: $err"
  err=$($ctl --address=unix:///nonexistent/offloadd.sock $bad 2>&1); rc=$?
  [[ $rc == 2 ]] || fail "$bad without a daemon exited $rc: $err"
done
set -e
$ctl stats | grep -Eq "^$id +offload_demo .* 3 +[0-9]+ +[0-9.]+ +[0-9.]+ [KMGT]?i?B/[0-9.]+ [KMGT]?i?B +[0-9.]+ +[0-9.]+ [KMGT]?i?B +[0-9]+ +here *$" ||
  fail "stats lacks the share, NVMe traffic, pool room or trainer: $($ctl stats)"

tmux -S "$tmux_sock" kill-server 2>/dev/null || true
kill "$demo_pid" 2>/dev/null; wait "$demo_pid" 2>/dev/null || true
grep -q "^offloadd 0.* pid $daemon_pid .* every 0\.[0-9] s" <<<"$screen" || fail "top header: $screen"
grep -q "^tier host " <<<"$screen" || fail "top tiers: $screen"
grep -Eq "^SESSION +NAME +PARTS +HELD .* STEPS/S +STEP MS +WAIT% +COMPUTE%" <<<"$screen" || fail "top columns: $screen"
grep -Eq "^[0-9]+ +offload_demo +[0-9]+ +[0-9]+ .* [0-9]+\.[0-9]{2} +[0-9.]+ +[0-9]+% +[0-9]+% " <<<"$screen" ||
  fail "top has no live row for the demo: $screen"
# Not a terminal: one screen after another, as many as asked.
out=$($ctl top --interval=0.1 --iterations=2)
[[ $(grep -c "^offloadd " <<<"$out") == 2 ]] || fail "top --iterations=2: $out"
for bad in -1 inf nan 1e300; do  # (inf would sleep for no time: a flood of calls)
  set +e
  timeout 10 $ctl top --interval=$bad >/dev/null 2>&1; rc=$?
  set -e
  [[ $rc == 2 ]] || fail "top with interval $bad exited $rc"
done

kill -TERM "$daemon_pid"
wait "$daemon_pid" || fail "daemon exited $? on SIGTERM: $(cat "$dir/log")"
daemon_pid=
[[ ! -e $dir/offloadd.sock ]] || fail "socket left behind"
set +e
OFFLOADD_ADDRESS="unix:$dir/offloadd.sock" $ctl status >/dev/null 2>&1; rc=$?
set -e
[[ $rc == 1 ]] || fail "status without daemon exited $rc"

# doctor without a daemon: one line per check, a summary naming its exit
# status, a real swap directory tried.
check_doctor() {  # OUT RC
  local lines n
  n=$(wc -l <<<"$1")
  (( n >= 10 )) || fail "doctor printed $n lines: $1"
  grep -q "^settings: offloadd's defaults" <<<"$1" || fail "doctor settings line: $1"
  lines=$(sed '1d;$d' <<<"$1")
  if grep -Ev '^(ok  |info|SLOW|FAIL)  [^ ].*  [^ ]' <<<"$lines"; then fail "doctor line shape: $1"; fi
  tail -1 <<<"$1" | grep -Eq "^[0-9]+ ok, [0-9]+ info, [0-9]+ slow, [0-9]+ fail: .* \(exit $2\)$" ||
    fail "doctor summary (exit $2): $1"
  for name in "shmem huge pages" "anon huge pages" DAMON "memory limit" RLIMIT_MEMLOCK "Adam kernel" NUMA GPU; do
    grep -Eq "^[a-zA-Z]+ +$name " <<<"$lines" || fail "doctor lacks $name: $1"
  done
}
mkdir "$dir/swap"
set +e
out=$(OFFLOADD_ADDRESS="unix:$dir/offloadd.sock" $ctl doctor --nvme.dirs="$dir/swap" --nvme.bytes_per_dir=16MiB); rc=$?
set -e
[[ $rc -le 1 ]] || fail "doctor on a usable directory exited $rc: $out"
check_doctor "$out" "$rc"
grep -Eq "^ok    swap space $dir/swap +.* free for nvme.bytes_per_dir 16.0 MiB$" <<<"$out" || fail "doctor space: $out"
grep -Eq "^(ok  |SLOW)  O_DIRECT $dir/swap " <<<"$out" || fail "doctor O_DIRECT: $out"
[[ -z $(ls -A "$dir/swap") ]] || fail "doctor left files in $dir/swap: $(ls -A "$dir/swap")"
set +e
out=$($ctl doctor --offline --nvme.dirs="$dir/missing"); rc=$?
set -e
[[ $rc == 2 ]] || fail "doctor on a missing directory exited $rc: $out"
check_doctor "$out" 2
grep -q "^FAIL  swap dir $dir/missing .*fix: mkdir -p $dir/missing" <<<"$out" || fail "doctor missing: $out"
set +e
$ctl doctor --offline --nvme.bytes_per_dir=lots >/dev/null 2>&1; rc=$?
set -e
[[ $rc == 2 ]] || fail "doctor with a bad setting exited $rc"
$ctl doctor --help | grep -q "^Exit status: 0 nothing would make offloadd fail or slow" || fail "doctor --help"
echo PASS
