#!/usr/bin/env bash
# offloadd.deepspeed's mapping of DeepSpeed config fields (no daemon needed).
set -euo pipefail
export PYTHONPATH=client/python/site
exec /usr/bin/python3 tests/deepspeed_config_test.py "$@"
