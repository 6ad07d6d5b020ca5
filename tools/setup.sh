#!/usr/bin/env bash
# Installs the Debian packages offloadd needs to build, test and benchmark,
# and nothing that is already there. Safe to run any number of times.
set -euo pipefail

packages=(
  bazel-bootstrap g++ protobuf-compiler protobuf-compiler-grpc
  libgrpc++-dev libprotobuf-dev libabsl-dev libtbb-dev liburing-dev
  libyaml-cpp-dev libxxhash-dev libgtest-dev libgmock-dev libbenchmark-dev
  pybind11-dev python3-dev python3-torch python3-tqdm python3-matplotlib fio libcpp-httplib-dev
  clang-14 libfuzzer-14-dev libclang-rt-14-dev  # tools/fuzz.sh: the libFuzzer targets in fuzz/ (the sanitizer runtimes are a Recommends of clang's)
  git  # tools/format.sh lists the tracked files
  systemd procps  # tests/package_test.sh: systemd-analyze, the targets the unit names, /bin/kill
  clang-format-14  # tools/format.sh: the house style
  lintian dpkg-dev  # tools/package.sh and its test: the .deb, checked
  tmux  # offloadctl top, tested in a terminal as a person sees it
  libopenblas0-pthread  # torch's BLAS: Debian's python3-torch falls back to reference BLAS (~1 GFLOP/s)
  libtorch-dev ninja-build  # benches/cpu_adam's peer, ../shared/peers/deepspeed_cpu_adam
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}" >&2
  sudo=""
  [[ $(id -u) == 0 ]] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
echo "setup: all ${#packages[@]} packages present" >&2

# The node's setting for huge pages in shared memory is the administrator's:
# say what it means for offloadd, change nothing (README, "Node setup").
shmem=/sys/kernel/mm/transparent_hugepage/shmem_enabled
if [[ -r $shmem ]] && grep -q '\[never\]' "$shmem"; then
  echo "setup: note: $shmem is never: offloadd's session arenas use 4 KiB pages, and" \
    "parameters or gradients on NVMe swap slower (README, \"Node setup\")" >&2
fi
