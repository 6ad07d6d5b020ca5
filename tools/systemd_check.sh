#!/usr/bin/env bash
# Runs the Debian package's service under a real systemd: boots this
# machine's root, copy-on-write, as a systemd-nspawn container (systemd as
# its PID 1), installs the package there and checks, as an operator would:
#   1. the service starts (Type=notify: "started" once the socket answers);
#   2. with nvme.dirs set (and ReadWritePaths=, as the unit's comment says),
#      the NVMe tier runs on io_uring with O_DIRECT inside the sandbox, and a
#      trainer in the group "offloadd" trains with its optimizer state
#      swapping to it (3 AdamW steps, the weights checked);
#   3. a user outside the group is refused, in words;
#   4. `systemctl reload` (SIGHUP) applies the settings that change live;
#   5. `systemctl stop` stops it cleanly (exit status 0).
# Needs root and systemd-nspawn (installs systemd-container if missing).
# Not part of tools/test.sh: it mounts, boots a container and changes
# packages. usage: tools/systemd_check.sh [PACKAGE.deb]
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $(id -u) == 0 ]] || { echo "systemd_check: needs root" >&2; exit 2; }
command -v systemd-nspawn >/dev/null ||
  apt-get install -y --no-install-recommends systemd-container >/dev/null
work=$(mktemp -d /var/tmp/systemd_check.XXXXXX)
leader=""
cleanup() {
  [[ -n $leader ]] && kill -RTMIN+3 "$leader" 2>/dev/null  # systemd: halt
  for _ in $(seq 50); do pgrep -f "systemd-nspawn -D $work/root" >/dev/null || break; sleep 0.2; done
  pkill -f "systemd-nspawn -D $work/root" 2>/dev/null || true
  umount "$work/root" 2>/dev/null || true
  umount "$work/upper" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
deb=${1:-}
if [[ -z $deb ]]; then
  bash tools/package.sh "$work/pkg" >/dev/null 2>"$work/package.log" ||
    { cat "$work/package.log" >&2; exit 1; }
  deb=$(ls "$work"/pkg/offloadd_*_amd64.deb)
fi
mkdir -p "$work/pkg" "$work/upper" "$work/root" "$work/nvme"
cp "$deb" "$work/pkg/offloadd.deb"
mount -t tmpfs -o size=4g tmpfs "$work/upper"
mkdir -p "$work/upper/upper" "$work/upper/work"
mount -t overlay overlay \
  -o "lowerdir=/,upperdir=$work/upper/upper,workdir=$work/upper/work" "$work/root"

# The trainer: optimizer state homed on NVMe, a pool too small to hold it.
cat > "$work/pkg/trainer.py" <<'EOF'
import offloadd, torch
c = offloadd.Client("unix:/run/offloadd/offloadd.sock")
s = c.open_session("systemd-check", optimizer_state_host_percent=0)
ps = []
for i in range(8):
    p = s.register(f"w{i}", 1 << 20)
    torch.frombuffer(p.params, dtype=torch.float32).fill_(1.0)
    s.release([p.id])
    ps.append(p.id)
for _ in range(3):
    views = s.fetch(ps, grads=True)
    for v in views:
        torch.frombuffer(v.grads, dtype=torch.float32).fill_(0.5)
    s.return_gradients(views, release=True)
    s.step(lr=1e-2)
v = s.fetch([ps[0]])[0]
w = float(torch.frombuffer(v.params, dtype=torch.float32)[0])
s.release([ps[0]])
n = c.stats()["counters"]
s.close()
assert abs(w - 0.97) < 1e-6, w  # three AdamW steps of lr 1e-2 from 1.0
assert n["swap_out_bytes"] > 0 and n["swap_in_bytes"] > 0, n
print(f"trainer: weight {w:.6f} after 3 steps; swapped out {n['swap_out_bytes'] >> 20} MiB, "
      f"in {n['swap_in_bytes'] >> 20} MiB")
EOF

SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=${SYSTEMD_NSPAWN_UNIFIED_HIERARCHY:-0} \
  systemd-nspawn -D "$work/root" -b --console=passive --register=no --keep-unit \
  -M offloadd-check --bind="$work/nvme:/srv/nvme" --bind-ro="$work/pkg:/pkg" \
  >"$work/nspawn.log" 2>&1 &
for _ in $(seq 100); do
  nspawn=$(pgrep -f "systemd-nspawn -D $work/root" | head -1 || true)
  leader=${nspawn:+$(pgrep -P "$nspawn" | head -1 || true)}
  if [[ -n $leader ]] &&
     [[ $(nsenter -t "$leader" -a systemctl is-system-running 2>/dev/null) =~ running|degraded ]]; then
    break
  fi
  sleep 0.2
done
[[ -n $leader ]] || { cat "$work/nspawn.log" >&2; echo "systemd_check: no container" >&2; exit 1; }
in_container() { nsenter -t "$leader" -a sh -c "$1"; }
echo "container: systemd $(in_container 'systemctl --version | head -1 | cut -d" " -f2') is its PID 1"

in_container 'dpkg -i /pkg/offloadd.deb >/dev/null 2>&1 || dpkg -i /pkg/offloadd.deb'
in_container 'systemctl start offloadd && systemctl is-active offloadd' |
  sed 's/^/1. service started: /'
in_container 'mkdir -p /etc/systemd/system/offloadd.service.d &&
  printf "[Service]\nReadWritePaths=/srv/nvme\n" > /etc/systemd/system/offloadd.service.d/nvme.conf &&
  chown offloadd:offloadd /srv/nvme &&
  printf "\nnvme:\n  dirs: /srv/nvme\n  bytes_per_dir: 1GiB\nmemory:\n  host_budget_bytes: 96MiB\n" \
    >> /etc/offloadd/offloadd.yaml &&
  systemctl daemon-reload && systemctl restart offloadd'
in_container 'journalctl -u offloadd -o cat --no-pager | grep "tier nvme" | tail -1' |
  sed 's/^/2. /'
in_container 'journalctl -u offloadd -o cat --no-pager | grep -q "O_DIRECT); io_uring"' ||
  { echo "systemd_check: the NVMe tier is not on io_uring with O_DIRECT" >&2; exit 1; }
in_container 'id trainer >/dev/null 2>&1 || useradd -m -G offloadd trainer;
  id outsider >/dev/null 2>&1 || useradd -m outsider'
in_container 'su trainer -c "/usr/bin/python3 /pkg/trainer.py"' | sed 's/^/2. /'
refused=$(in_container 'su outsider -c "/usr/bin/python3 -c \"import offloadd
offloadd.Client(\\\"unix:/run/offloadd/offloadd.sock\\\").open_session(\\\"x\\\")\"" 2>&1 || true')
grep -q "PermissionDeniedError" <<<"$refused" ||
  { echo "systemd_check: the outsider was not refused: $refused" >&2; exit 1; }
echo "3. outside the group: $(tail -1 <<<"$refused" | cut -c1-120)..."
in_container 'sed -i "s/host_budget_bytes: 96MiB/host_budget_bytes: 128MiB/" /etc/offloadd/offloadd.yaml &&
  systemctl reload offloadd && sleep 1 &&
  journalctl -u offloadd -o cat --no-pager | grep "SIGHUP" | tail -1' | sed 's/^/4. /'
in_container 'systemctl stop offloadd; systemctl show offloadd -p Result -p ExecMainStatus --value |
  tr "\n" " "' | sed 's/^/5. stopped: /'
echo
in_container 'systemctl show offloadd -p Result --value' | grep -qx success ||
  { echo "systemd_check: the service did not stop cleanly" >&2; exit 1; }
echo "systemd_check: passed"
