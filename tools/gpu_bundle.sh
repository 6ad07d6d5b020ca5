#!/usr/bin/env bash
# Packs offloadd, its Python package, its system tests and its benchmarks for
# a GPU machine that has CUDA and a CUDA build of PyTorch but none of this
# build's libraries (a Python other than Debian's 3.11 there, no gRPC, no TBB).
#
# usage: tools/gpu_bundle.sh DEST [PYTHON_INCLUDE_DIR]
#   PYTHON_INCLUDE_DIR: the headers of the target machine's Python (default:
#   /usr/local/include/python3.12). Bazel accepts system include paths only,
#   so copy them under /usr/local/include first.
# Builds in a separate output base (the extension is compiled for that Python,
# so it must not replace the default build's) and writes:
#   DEST/run/   the files at the paths the tests and benchmarks expect
#               (daemon/offloadd, client/python/site, tests/..., benches/...)
#   DEST/lib/   the shared libraries those programs need beyond the C and C++
#               runtimes, which the target machine has (newer ones).
# On the target: cd DEST/run && export LD_LIBRARY_PATH=$PWD/../lib
#   PYTHONPATH=client/python/site python3 tests/torch_wrap_test.py
# With OLD_REV=<commit>, DEST/run/site_old/offloadd is the package with
# that commit's offloadd.torch (the same binaries): gpu_run.sh's tokens_ab
# stage runs both alternately (an A/B of a Python change in one call).
set -euo pipefail
dest=${1:?usage: tools/gpu_bundle.sh DEST [PYTHON_INCLUDE_DIR]}
pyinc=${2:-/usr/local/include/python3.12}
[[ -f $pyinc/Python.h ]] || { echo "no Python.h in $pyinc" >&2; exit 2; }
cd "$(dirname "$0")/.."
base=${XDG_CACHE_HOME:-$HOME/.cache}/offloadd-py$(basename "$pyinc" | tr -cd 0-9)
targets=(//daemon:offloadd //client:offloadctl //client/python:package //tests:wait_for_daemon
         //benches:step_overlap //benches:load //benches:out_of_core_step //benches:cpu_adam
         //benches:nvme //benches:trace_replay //benches:gpu_copy //benches:shares //gpu:cuda_device_test
         //gpu:nccl_communicator_test //client/demo:offload_gpu_demo)
# --symlink_prefix=/: leaves the checkout's bazel-* links to the default build.
bazel --output_base="$base" build -c opt --symlink_prefix=/ --copt=-isystem"$pyinc" "${targets[@]}"
bin=$(bazel --output_base="$base" info -c opt bazel-bin 2>/dev/null)

rm -rf "$dest" && mkdir -p "$dest/run" "$dest/lib"
put() {  # put SRC REL: copies SRC to DEST/run/REL
  mkdir -p "$dest/run/$(dirname "$2")" && cp -L "$1" "$dest/run/$2"
}
for b in daemon/offloadd client/offloadctl tests/wait_for_daemon benches/step_overlap \
         benches/load benches/out_of_core_step benches/cpu_adam benches/nvme benches/trace_replay \
         benches/gpu_copy benches/shares gpu/cuda_device_test gpu/nccl_communicator_test \
         client/demo/offload_gpu_demo; do
  put "$bin/$b" "$b"
done
mkdir -p "$dest/run/client/python/site"
cp -rL "$bin/client/python/site/offloadd" "$dest/run/client/python/site/"
for f in tests/torch_wrap_test.py tests/torch_wrap_worker.py benches/torch_tokens.py \
         benches/bench_daemon.py benches/larger_than_gpu.py \
         benches/torch_adamw.py client/python/demo/gpt.py client/python/demo/train_gpt.py; do
  put "$f" "$f"
done
cp /usr/share/common-licenses/GPL-3 "$dest/GPL-3"  # the demo's training text
if [[ -n ${OLD_REV:-} ]]; then
  mkdir -p "$dest/run/site_old"
  cp -rL "$bin/client/python/site/offloadd" "$dest/run/site_old/"
  chmod -R u+w "$dest/run/site_old"
  git show "$OLD_REV:client/python/offloadd/torch.py" >"$dest/run/site_old/offloadd/torch.py"
fi

# The libraries: everything ldd resolves except the C runtime, the C++
# runtime and the loader, which the target has in newer versions, and NCCL
# (218 MB; the target's PyTorch has its own, which gpu_run.sh finds).
for f in "$dest"/run/daemon/offloadd "$dest"/run/client/offloadctl "$dest"/run/benches/* \
         "$dest"/run/gpu/cuda_device_test "$dest"/run/gpu/nccl_communicator_test \
         "$dest"/run/client/demo/offload_gpu_demo \
         "$dest"/run/client/python/site/offloadd/_offloadd.so; do
  [[ -x $f || $f == *.so ]] || continue
  ldd "$f" | awk '/=> \//{print $3}'
done | sort -u | grep -vE '/(libc|libm|libpthread|libdl|librt|libstdc\+\+|libgcc_s|libnccl|ld-linux[^/]*)\.so' |
  while read -r lib; do cp -L "$lib" "$dest/lib/"; done
# Debug symbols stay here: the device tool carries at most 64 MiB.
find "$dest/run" "$dest/lib" -type f \( -perm -u+x -o -name '*.so*' \) ! -name '*.py' \
  -exec strip --strip-unneeded {} + 2>/dev/null || true
du -sh "$dest"
