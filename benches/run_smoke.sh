#!/usr/bin/env bash
# Runs a benchmark once at its tiny size: it must finish and exit 0.
set -euo pipefail
# Arguments may name $TEST_TMPDIR literally; expand it here.
args=()
for a in "${@:2}"; do args+=("${a//\$\{TEST_TMPDIR\}/$TEST_TMPDIR}"); done
"$1" --tiny "${args[@]}"
