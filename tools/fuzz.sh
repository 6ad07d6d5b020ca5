#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/) with Debian's clang-14 and libFuzzer,
# instrumented for coverage and AddressSanitizer, in a Bazel output base of
# their own (the default gcc build is untouched), then fuzzes each for a
# bounded time starting from its seed corpus (a scratch copy: new inputs are
# not written into the repository). Exit status 0 if nothing crashed.
#
# usage: tools/fuzz.sh [SECONDS per target, default 30]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-30}
for tool in clang-14 clang++-14; do
  command -v "$tool" >/dev/null || { echo "fuzz: $tool missing (tools/setup.sh installs it)" >&2; exit 1; }
done
out_base="${XDG_CACHE_HOME:-$HOME/.cache}/offloadd-fuzz/$(pwd | md5sum | cut -c1-12)"
# --symlink_prefix=/: no bazel-* links in the workspace (they are the
# default build's).
CC=clang-14 CXX=clang++-14 bazel --output_base="$out_base" --max_idle_secs=60 build --symlink_prefix=/ \
  --repo_env=CC=clang-14 --repo_env=CXX=clang++-14 \
  --copt=-fsanitize=fuzzer-no-link,address --linkopt=-fsanitize=address \
  --copt=-Wno-unused-command-line-argument --copt=-Wno-unknown-warning-option \
  //fuzz:request_fuzzer_libfuzzer
bin="$(CC=clang-14 bazel --output_base="$out_base" --max_idle_secs=60 info --repo_env=CC=clang-14 bazel-bin 2>/dev/null)"
scratch=$(mktemp -d /tmp/offloadd-fuzz.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/corpus" "$scratch/tmp"
cp fuzz/corpus/request/* "$scratch/corpus/"
# A crash or hang leaves its input here (not in the repository).
artifacts=/tmp/offloadd-fuzz-artifacts
mkdir -p "$artifacts"
TMPDIR="$scratch/tmp" LSAN_OPTIONS="suppressions=$(pwd)/fuzz/lsan.supp" \
  "$bin/fuzz/request_fuzzer_libfuzzer" -max_total_time="$seconds" -timeout=25 -rss_limit_mb=4096 \
  -artifact_prefix="$artifacts/" \
  -print_final_stats=1 "$scratch/corpus" 2>&1 | grep -vE '^#[0-9]+\s+(NEW|REDUCE|pulse)' || exit 1
echo "fuzz: request_fuzzer ran ${seconds}s without a crash"
