#!/usr/bin/env bash
# Makes `import offloadd` work for Debian's /usr/bin/python3: builds the
# binding (client/python) and copies the package into
# /usr/local/lib/python3.X/dist-packages, which that interpreter searches
# (Debian keeps pip out of the system interpreter; nothing comes from PyPI).
# Idempotent. Run tools/setup.sh first on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
bazel build //client/python:package
site=$(/usr/bin/python3 -c 'import sys; print(f"/usr/local/lib/python{sys.version_info[0]}.{sys.version_info[1]}/dist-packages")')
sudo=""; [[ $(id -u) == 0 ]] || sudo=sudo
$sudo mkdir -p "$site/offloadd"
for f in bazel-bin/client/python/site/offloadd/*.py; do
  $sudo install -m 0644 "$f" "$site/offloadd/$(basename "$f")"
done
$sudo install -m 0755 bazel-bin/client/python/site/offloadd/_offloadd.so "$site/offloadd/_offloadd.so"
/usr/bin/python3 -c 'import offloadd; print("offloadd installed for", __import__("sys").executable, "at", offloadd.__file__)'
