#!/usr/bin/env bash
# The request harness over its seed corpus, once (no libFuzzer needed).
set -euo pipefail
fuzz/request_fuzzer fuzz/corpus/request
