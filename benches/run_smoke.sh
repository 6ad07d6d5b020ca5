#!/usr/bin/env bash
# Runs a benchmark once at its tiny size: it must finish and exit 0.
set -euo pipefail
"$1" --tiny "${@:2}"
