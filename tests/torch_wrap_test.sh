#!/usr/bin/env bash
# offloadd.torch.wrap: trainer processes (one to four gloo ranks) against
# real daemons, compared with in-process torch.optim.AdamW.
set -euo pipefail
export PYTHONPATH=client/python/site
exec /usr/bin/python3 tests/torch_wrap_test.py "$@"
