#!/usr/bin/env bash
# The house style (.clang-format: Google's at 100 columns) over every C++ and
# CUDA source git knows. `tools/format.sh` rewrites what differs;
# `tools/format.sh --check` changes nothing and fails, naming the files, if
# one differs (tools/test.sh runs it as a test).
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
[[ -n $fmt ]] || { echo "format: no clang-format (tools/setup.sh installs clang-format-14)" >&2; exit 1; }
# (A failing git, or none, is a failure, not "0 files as .clang-format says".)
listed=$(git ls-files '*.cc' '*.h' '*.cu') || { echo "format: git ls-files failed" >&2; exit 1; }
mapfile -t files <<<"$listed"
[[ -n $listed ]] || { echo "format: git lists no C++ source here" >&2; exit 1; }
if [[ ${1:-} == --check ]]; then
  bad=()
  for f in "${files[@]}"; do
    "$fmt" --dry-run -Werror "$f" >/dev/null 2>&1 || bad+=("$f")
  done
  if ((${#bad[@]})); then
    echo "format: ${#bad[@]} files differ from .clang-format (tools/format.sh fixes them):" >&2
    printf '  %s\n' "${bad[@]}" >&2
    exit 1
  fi
  echo "format: ${#files[@]} files as .clang-format says"
else
  "$fmt" -i "${files[@]}"
fi
