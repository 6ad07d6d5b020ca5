#!/usr/bin/env bash
# Sets up the machine and runs every test (unit, system, and each benchmark
# once at a tiny size), then prints "N passed, N failed" (test targets).
# Exit status 0 only if everything built and passed.
set -uo pipefail
cd "$(dirname "$0")/.."

bash tools/setup.sh || { echo "0 passed, 1 failed"; exit 1; }

log=$(mktemp)
bazel test //... --test_summary=short 2>&1 | tee "$log"
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
echo "$passed passed, $failed failed"
[[ $rc == 0 && $failed == 0 ]]
