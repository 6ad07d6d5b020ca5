#!/usr/bin/env bash
# Builds the Debian package: offloadd_<version>_amd64.deb with the daemon,
# offloadctl, the Python package for the system Python, a default
# /etc/offloadd/offloadd.yaml naming every setting (offloadd --print-config),
# the systemd unit, man pages made from --help, a Grafana dashboard of its
# Prometheus metrics, and the maintainer scripts in packaging/.
#
#   bash tools/package.sh [OUTDIR]          builds with Bazel, writes OUTDIR (default: .)
#   bash tools/package.sh --from=DIR OUTDIR takes DIR/bin/offloadd, DIR/bin/offloadctl
#                                           and the Python package DIR/python/offloadd
set -euo pipefail
cd "$(dirname "$0")/.."
from=""
if [[ ${1:-} == --from=* ]]; then
  from=${1#--from=}
  shift
fi
out=$(realpath -m "${1:-.}")
mkdir -p "$out"
if [[ -z $from ]]; then
  bazel build //daemon:offloadd //client:offloadctl //client/python:package >&2
  from=$(mktemp -d)
  built=$from
  mkdir -p "$from/bin" "$from/python"
  cp bazel-bin/daemon/offloadd bazel-bin/client/offloadctl "$from/bin/"
  cp -r bazel-bin/client/python/site/offloadd "$from/python/"
fi
for f in bin/offloadd bin/offloadctl python/offloadd/__init__.py python/offloadd/_offloadd.so; do
  [[ -e $from/$f ]] || { echo "package: $from/$f is missing" >&2; exit 2; }
done

version=$("$from/bin/offloadd" --help | sed -n '1s/^offloadd \([0-9][^:]*\):.*/\1/p')
[[ -n $version ]] || { echo "package: no version in offloadd --help" >&2; exit 2; }
root=$(mktemp -d)
chmod 755 "$root"
work=$(mktemp -d)
trap 'rm -rf "$root" "$work" ${built:-}' EXIT
umask 022

install -d "$root/usr/bin" "$root/etc/offloadd" "$root/lib/systemd/system" \
  "$root/usr/share/man/man8" "$root/usr/share/man/man1" "$root/usr/share/doc/offloadd" \
  "$root/usr/lib/python3/dist-packages/offloadd" "$root/DEBIAN"
install -m 755 "$from/bin/offloadd" "$from/bin/offloadctl" "$root/usr/bin/"
install -m 644 "$from"/python/offloadd/*.py "$root/usr/lib/python3/dist-packages/offloadd/"
install -m 644 "$from/python/offloadd/_offloadd.so" "$root/usr/lib/python3/dist-packages/offloadd/"
strip --strip-unneeded --remove-section=.comment --remove-section=.note \
  "$root/usr/bin/offloadd" "$root/usr/bin/offloadctl" \
  "$root/usr/lib/python3/dist-packages/offloadd/_offloadd.so"
"$from/bin/offloadd" --print-config >"$root/etc/offloadd/offloadd.yaml"
chmod 644 "$root/etc/offloadd/offloadd.yaml"
install -m 644 packaging/offloadd.service "$root/lib/systemd/system/"
install -d "$root/usr/share/offloadd"
install -m 644 packaging/grafana-dashboard.json "$root/usr/share/offloadd/"

# Man pages: each program's --help, verbatim.
man_page() {  # name section summary help-text
  local date
  date=$(date -u +%Y-%m-%d)
  {
    printf '.TH %s %s %s "offloadd %s"\n' "${1^^}" "$2" "$date" "$version"
    printf '.SH NAME\n%s \\- %s\n.SH DESCRIPTION\n.nf\n' "$1" "$3"
    sed -e 's/\\/\\e/g' -e 's/^\./\\\&./' -e "s/^'/\\\\\&'/" <<<"$4"
    printf '.fi\n.SH FILES\n/etc/offloadd/offloadd.yaml, /lib/systemd/system/offloadd.service\n'
  } | gzip -9n >"$root/usr/share/man/man$2/$1.$2.gz"
}
man_page offloadd 8 "holds the ZeRO-3 partitions of a node's trainers" "$("$from/bin/offloadd" --help)"
man_page offloadctl 1 "controls and inspects offloadd" "$("$from/bin/offloadctl" --help 2>&1 || true)"

install -m 644 packaging/copyright "$root/usr/share/doc/offloadd/copyright"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
printf 'offloadd (%s) unstable; urgency=medium\n\n  * Built from commit %s.\n\n -- offloadd maintainers <offloadd@example.com>  %s\n' \
  "$version" "$commit" "$(date -uR)" | gzip -9n >"$root/usr/share/doc/offloadd/changelog.gz"

install -m 755 packaging/postinst packaging/prerm packaging/postrm "$root/DEBIAN/"
echo /etc/offloadd/offloadd.yaml >"$root/DEBIAN/conffiles"

# The shared libraries' packages, as dpkg-shlibdeps finds them.
mkdir -p "$work/debian"
printf 'Source: offloadd\n\nPackage: offloadd\nArchitecture: amd64\n' >"$work/debian/control"
depends=$(cd "$work" && dpkg-shlibdeps -O -e"$root/usr/bin/offloadd" -e"$root/usr/bin/offloadctl" \
  -e"$root/usr/lib/python3/dist-packages/offloadd/_offloadd.so" 2>/dev/null |
  sed -n 's/^shlibs:Depends=//p')
py=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
next_py=$(/usr/bin/python3 -c 'import sys; print("%d.%d" % (sys.version_info[0], sys.version_info[1] + 1))')
size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
cat >"$root/DEBIAN/control" <<CONTROL
Package: offloadd
Version: $version
Architecture: amd64
Maintainer: offloadd maintainers <offloadd@example.com>
Installed-Size: $size
Depends: $depends, adduser, python3 (>= $py), python3 (<< $next_py)
Recommends: python3-torch
Section: misc
Priority: optional
Homepage: https://github.com/offloadd/offloadd
Description: node daemon that holds ZeRO-3 training state off the GPU
 offloadd runs once per node and holds the ZeRO-3 partitions of the training
 processes on it (working parameters, gradients, fp32 master weights, Adam
 moments) in one tiered store: GPU memory, pinned host memory and NVMe
 (io_uring). It runs a vectorised CPU Adam for every rank of the node,
 optionally one step delayed, and serves trainers over gRPC and shared
 memory. Includes offloadctl (status, settings, checkpoints, doctor) and the
 Python package offloadd (offloadd.torch.wrap for PyTorch).
CONTROL
(cd "$root" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum) \
  >"$root/DEBIAN/md5sums"
chmod 644 "$root/DEBIAN/md5sums"
deb="$out/offloadd_${version}_amd64.deb"
dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
echo "$deb"
