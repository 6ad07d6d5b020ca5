#!/usr/bin/env bash
# Sets up the machine and runs every test (unit, system, and each benchmark
# once at a tiny size), then prints "N passed, N failed" (test targets).
# Exit status 0 only if everything built and passed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

# Huge pages in shared memory, so that the tests of offloadd's arenas on
# them run: where the kernel's setting is never and this is root, advise
# (huge pages only for mappings that ask) for this run, put back at its
# end. OFFLOADD_TEST_NO_SYSFS=1 leaves the setting alone (those tests then
# check the small-page layout, or skip saying why).
shmem=/sys/kernel/mm/transparent_hugepage/shmem_enabled
shmem_was=""
if [[ -z ${OFFLOADD_TEST_NO_SYSFS:-} && $(id -u) == 0 && -w $shmem ]] && grep -q '\[never\]' "$shmem" &&
  echo advise >"$shmem" 2>/dev/null; then
  shmem_was=never
  echo "test: $shmem is advise for this run (never again at its end)" >&2
fi
trap '[[ -z $shmem_was ]] || echo "$shmem_was" >"$shmem"' EXIT

log=$(mktemp)
# (--keep_going: a target that fails to build does not stop the others'
# tests, and is counted failed.)
bazel test //... --keep_going --test_summary=short 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}

passed=$(grep -cE '^//[^ ]+ +(\(cached\) )?PASSED' "$log")
failed=$(grep -cE '^//[^ ]+ +(\(cached\) )?(FAILED|TIMEOUT|NO STATUS|FLAKY|INCOMPLETE|REMOTE FAILURE|FAILED TO BUILD)' "$log")
rm -f "$log"
if [[ $rc != 0 && $failed == 0 ]]; then
  echo "bazel exited $rc before reporting a failed test (build error?)" >&2
  failed=1
fi

# One more test: the libFuzzer targets, built with clang, fuzzed for a
# bounded time (tools/fuzz.sh).
fuzz_log=$(mktemp)
if bash tools/fuzz.sh 30 >"$fuzz_log" 2>&1; then
  passed=$((passed + 1))
  grep -E '^(Done|fuzz:)' "$fuzz_log"
else
  failed=$((failed + 1))
  rc=1
  tail -40 "$fuzz_log"
  echo "tools/fuzz.sh FAILED" >&2
fi
rm -f "$fuzz_log"
# And the house style: every C++ source as .clang-format says.
if bash tools/format.sh --check; then
  passed=$((passed + 1))
else
  failed=$((failed + 1))
  rc=1
fi
echo "$passed passed, $failed failed"
[[ $rc == 0 && $failed == 0 ]]
