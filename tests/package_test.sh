#!/usr/bin/env bash
# The Debian package (tools/package.sh) from the binaries under test:
# lintian finds no error or warning; systemd-analyze verify has nothing to
# say about the unit; installed into a throwaway root, the daemon starts
# with the installed config, answers the installed offloadctl and the
# installed Python package, re-reads its config on SIGHUP and stops cleanly.
set -euo pipefail
t=$(mktemp -d /tmp/package_test.XXXXXX)
daemon_pid=
cleanup() { [[ -n $daemon_pid ]] && kill -9 "$daemon_pid" 2>/dev/null; rm -rf "$t"; }
trap cleanup EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
for tool in lintian dpkg-deb dpkg-shlibdeps systemd-analyze; do
  command -v $tool >/dev/null || fail "$tool is missing (tools/setup.sh installs it)"
done

mkdir -p "$t/from/bin" "$t/from/python"
cp daemon/offloadd client/offloadctl "$t/from/bin/"
cp -rL client/python/site/offloadd "$t/from/python/"
deb=$(bash tools/package.sh --from="$t/from" "$t/out") || fail "package.sh exited $?"
[[ $(basename "$deb") == offloadd_*_amd64.deb ]] || fail "package named $deb"

out=$(lintian --fail-on error,warning "$deb" 2>&1) || fail "lintian: $out"
! grep -qE '^[EW]: ' <<<"$out" || fail "lintian: $out"

root="$t/root"
dpkg -x "$deb" "$root"
for f in usr/bin/offloadd usr/bin/offloadctl etc/offloadd/offloadd.yaml \
  usr/share/offloadd/grafana-dashboard.json \
  lib/systemd/system/offloadd.service usr/lib/python3/dist-packages/offloadd/_offloadd.so \
  usr/share/man/man8/offloadd.8.gz usr/share/doc/offloadd/copyright; do
  [[ -e $root/$f ]] || fail "the package lacks $f"
done
dpkg-deb -I "$deb" conffiles | grep -qx /etc/offloadd/offloadd.yaml || fail "conffiles"

# The unit against this machine's systemd (its targets and /bin/kill copied
# into the root the unit is checked in): not one complaint.
cp /lib/systemd/system/*.target "$root/lib/systemd/system/"
mkdir -p "$root/bin" && cp /bin/kill "$root/bin/"
out=$(systemd-analyze verify --man=no --root="$root" "$root/lib/systemd/system/offloadd.service" 2>&1) ||
  fail "systemd-analyze verify: $out"
[[ -z $out ]] || fail "systemd-analyze verify: $out"

# Installed, with the installed config (every setting commented out: the
# defaults), as the unit runs it.
mkdir -p "$t/state" "$t/run"
"$root/usr/bin/offloadd" --config="$root/etc/offloadd/offloadd.yaml" --server.data_dir="$t/state" \
  --server.socket="$t/run/offloadd.sock" --metrics.port=0 >"$t/log" 2>&1 &
daemon_pid=$!
tests/wait_for_daemon "$daemon_pid" "$t/log" "$t/run/offloadd.sock" || fail "offloadd: $(cat "$t/log")"
out=$("$root/usr/bin/offloadctl" --address="unix:$t/run/offloadd.sock" status) || fail "status: $out"
grep -q "tier host" <<<"$out" || fail "status: $out"
out=$(PYTHONPATH="$root/usr/lib/python3/dist-packages" /usr/bin/python3 -c "
import offloadd, sys
c = offloadd.Client('unix:$t/run/offloadd.sock')
s = c.open_session('from-the-package')
print('sessions', len(c.stats()['sessions']))
s.close()
") || fail "python: $out"
[[ $out == "sessions 1" ]] || fail "python: $out"
# The packaged Grafana dashboard asks only for metrics this daemon exports.
port=$(sed -n 's|.*metrics (Prometheus) on http://127.0.0.1:\([0-9]*\)/metrics.*|\1|p' "$t/log")
[[ -n $port ]] || fail "no metrics port in the log: $(cat "$t/log")"
out=$(/usr/bin/python3 - "$root/usr/share/offloadd/grafana-dashboard.json" "$port" <<'PY'
import json, re, sys, urllib.request
dash = json.load(open(sys.argv[1]))
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[2]}/metrics").read().decode()
exported = set(re.findall(r"^# TYPE (\S+)", text, re.M))
exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
used = {m for e in exprs for m in re.findall(r"\boffloadd_[a-z0-9_]+", e)}
missing = sorted(used - exported)
print(f"{len(exprs)} queries, {len(used)} metrics" if not missing and used else f"missing {missing}")
PY
) || fail "dashboard check: $out"
[[ $out != missing* ]] || fail "the dashboard asks for metrics offloadd does not export: $out"

kill -HUP "$daemon_pid"
for _ in $(seq 100); do grep -q "SIGHUP: re-read" "$t/log" && break; sleep 0.1; done
grep -q "SIGHUP: re-read .*: 0 setting(s) applied" "$t/log" || fail "reload: $(cat "$t/log")"
kill -TERM "$daemon_pid"
wait "$daemon_pid" || fail "offloadd exited $? on SIGTERM: $(cat "$t/log")"
daemon_pid=
grep -q "stopped cleanly" "$t/log" || fail "stop: $(cat "$t/log")"
echo "PASS: $(basename "$deb")"
