// benches/gpu_copy: how fast a CUDA device copies to and from a session's
// arena as the client maps it, against pinned memory (the link's limit for
// host memory) measured in the same run.
//
//   bazel build -c opt //benches:gpu_copy
//   bazel-bin/benches/gpu_copy [--bytes=256MiB] [--iterations=10] [--device=0] [--tiny]
//
// Buffers, each --bytes, copied to and from one device buffer on a created
// stream:
//   (a) arena, registered: a memfd mapped shared on 4 KiB pages
//       (HostMemory::MapShared, Pages::kSmall: how the client maps an
//       arena), its pages touched, then registered (Device::RegisterHost);
//   (b) arena, pageable: the same mapping before it is registered (CUDA
//       stages each copy through its own pinned buffer);
//   (c) pinned: Device::AllocatePinned (cudaMallocHost), the peer.
// Each copy is timed alone, by the wall clock from its issue to the return
// of Synchronize on an event recorded after it; one untimed copy in each
// direction comes first. The rows show the median and the range over
// --iterations copies. Registering and unregistering the arena are timed
// too: what a session pays once, at attach and at detach.
//
// Target: the registered arena's median bandwidth >= 0.9x pinned memory's,
// each way.
//
// Without a CUDA device (or a build without the toolkit) it prints
// "gpu_copy: no CUDA device: <reason>" and exits 0, so that its smoke test
// passes on machines without a GPU.
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "base/host_memory.h"
#include "base/posix_error.h"
#include "base/unique_fd.h"
#include "benches/bench_util.h"
#include "gpu/cuda_device.h"
#include "gpu/device.h"

namespace offload::bench {
namespace {

using gpu::Device;
using gpu::Direction;

constexpr double kTarget = 0.9;

struct Flags {
  uint64_t bytes = uint64_t{256} << 20;
  int iterations = 10;
  int device = 0;
};

// Bandwidths (bytes/s) of a series of copies.
struct Series {
  double median = 0;
  double low = 0;
  double high = 0;
};

Series Summarise(std::vector<double> bandwidths) {
  std::sort(bandwidths.begin(), bandwidths.end());
  const size_t n = bandwidths.size();
  const double median =
      n % 2 == 1 ? bandwidths[n / 2] : (bandwidths[n / 2 - 1] + bandwidths[n / 2]) / 2;
  return {median, bandwidths.front(), bandwidths.back()};
}

int Fail(const absl::Status& s, const char* what) {
  std::fprintf(stderr, "gpu_copy: %s: %s\n", what, s.ToString().c_str());
  return 1;
}

// What the measurements share: the device, its buffer, a stream and an event.
struct Bench {
  Device* device;
  uint64_t bytes;
  int iterations;
  void* on_device;
  const gpu::Stream* stream;
  const gpu::Event* done;

  // One copy of `bytes` between `host` and the device buffer, issued and
  // waited for; its seconds.
  absl::StatusOr<double> TimeOne(void* host, Direction direction) const {
    const Clock::time_point start = Clock::now();
    void* dst = direction == Direction::kHostToDevice ? on_device : host;
    const void* src = direction == Direction::kHostToDevice ? host : on_device;
    if (absl::Status s = device->CopyAsync(dst, src, bytes, direction, *stream); !s.ok()) return s;
    if (absl::Status s = device->Record(*done, *stream); !s.ok()) return s;
    if (absl::Status s = device->Synchronize(*done); !s.ok()) return s;
    return SecondsSince(start);
  }

  // One untimed copy, then `iterations` timed ones.
  absl::StatusOr<Series> Measure(void* host, Direction direction) const {
    if (absl::StatusOr<double> warm = TimeOne(host, direction); !warm.ok()) return warm.status();
    std::vector<double> bandwidths;
    for (int i = 0; i < iterations; ++i) {
      absl::StatusOr<double> seconds = TimeOne(host, direction);
      if (!seconds.ok()) return seconds.status();
      bandwidths.push_back(static_cast<double>(bytes) / std::max(*seconds, 1e-9));
    }
    return Summarise(std::move(bandwidths));
  }
};

struct Row {
  const char* buffer;
  Series h2d;
  Series d2h;
};

absl::StatusOr<Row> MeasureRow(const Bench& bench, const char* buffer, void* host) {
  Row row{buffer, {}, {}};
  absl::StatusOr<Series> h2d = bench.Measure(host, Direction::kHostToDevice);
  if (!h2d.ok()) return h2d.status();
  absl::StatusOr<Series> d2h = bench.Measure(host, Direction::kDeviceToHost);
  if (!d2h.ok()) return d2h.status();
  row.h2d = *h2d;
  row.d2h = *d2h;
  return row;
}

std::string MemlockLimit() {
  struct rlimit limit {};
  if (getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return std::to_string(limit.rlim_cur) + " bytes";
}

const char* Verdict(double ratio) { return ratio >= kTarget ? "MET" : "NOT MET"; }

int Main(int argc, char** argv) {
  Flags f;
  bool tiny = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const char* v;
    if ((v = FlagValue(argv[i], "bytes"))) {
      f.bytes = static_cast<uint64_t>(ByteSizeOrExit(v));
    } else if ((v = FlagValue(argv[i], "iterations"))) {
      f.iterations = std::atoi(v);
    } else if ((v = FlagValue(argv[i], "device"))) {
      f.device = std::atoi(v);
    } else if (a == "--tiny") {
      tiny = true;
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/gpu_copy_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (tiny) {
    f.bytes = uint64_t{4} << 20;
    f.iterations = 2;
  }
  if (f.iterations < 1) {
    std::fprintf(stderr, "bad flags: --iterations must be at least 1\n");
    return 2;
  }

  absl::StatusOr<std::unique_ptr<Device>> opened = gpu::OpenCudaDevice(f.device);
  if (!opened.ok()) {
    std::printf("gpu_copy: no CUDA device: %s\n", opened.status().ToString().c_str());
    return 0;
  }
  Device& device = **opened;
  PrintMachine("/dev/shm");
  std::printf("device: %s; %.1f MiB per copy, %d timed copies each way; RLIMIT_MEMLOCK %s\n",
              device.name().c_str(), f.bytes / 1048576.0, f.iterations, MemlockLimit().c_str());

  absl::StatusOr<gpu::DeviceMemory> on_device = device.Allocate(f.bytes);
  if (!on_device.ok()) return Fail(on_device.status(), "device buffer");
  absl::StatusOr<gpu::Stream> stream = device.CreateStream();
  if (!stream.ok()) return Fail(stream.status(), "stream");
  absl::StatusOr<gpu::Event> done = device.CreateEvent();
  if (!done.ok()) return Fail(done.status(), "event");
  const Bench bench{&device, f.bytes, f.iterations, on_device->get(), &*stream, &*done};

  // The arena: a memfd mapped shared on small pages, every page touched.
  UniqueFd memfd(memfd_create("gpu_copy arena", MFD_CLOEXEC));
  if (!memfd.valid()) return Fail(PosixError("memfd_create", errno), "arena");
  if (ftruncate(memfd.get(), static_cast<off_t>(RoundUpToPage(f.bytes))) != 0) {
    return Fail(PosixError("ftruncate of the memfd", errno), "arena");
  }
  absl::StatusOr<HostMemory> arena = HostMemory::MapShared(memfd.get(), 0, f.bytes, Pages::kSmall);
  if (!arena.ok()) return Fail(arena.status(), "mapping the arena");
  for (uint64_t i = 0; i < f.bytes; ++i) arena->data()[i] = std::byte(static_cast<uint8_t>(i));

  // (b) before registration: pageable.
  absl::StatusOr<Row> pageable = MeasureRow(bench, "arena (memfd, 4 KiB, pageable)", arena->data());
  if (!pageable.ok()) return Fail(pageable.status(), "pageable arena");

  // (a) registered.
  Clock::time_point start = Clock::now();
  absl::StatusOr<gpu::HostRegistration> registration = device.RegisterHost(arena->data(), f.bytes);
  const double register_seconds = SecondsSince(start);
  if (!registration.ok()) return Fail(registration.status(), "registering the arena");
  absl::StatusOr<Row> registered =
      MeasureRow(bench, "arena (memfd, 4 KiB, registered)", arena->data());
  if (!registered.ok()) return Fail(registered.status(), "registered arena");
  // A check that the registered copies moved the bytes (the check below
  // reads the arena after its registration went): a pattern to the device
  // and, the arena cleared, back from it.
  std::memset(arena->data(), 0x5a, f.bytes);
  if (absl::StatusOr<double> s = bench.TimeOne(arena->data(), Direction::kHostToDevice); !s.ok()) {
    return Fail(s.status(), "check of the registered arena");
  }
  std::memset(arena->data(), 0, f.bytes);
  if (absl::StatusOr<double> s = bench.TimeOne(arena->data(), Direction::kDeviceToHost); !s.ok()) {
    return Fail(s.status(), "check of the registered arena");
  }
  for (uint64_t i = 0; i < f.bytes; ++i) {
    if (arena->data()[i] != std::byte{0x5a}) {
      std::fprintf(stderr, "gpu_copy: the registered arena's bytes did not come back (byte %llu)\n",
                   static_cast<unsigned long long>(i));
      return 1;
    }
  }
  start = Clock::now();
  registration->Reset();
  const double unregister_seconds = SecondsSince(start);

  // (c) the peer: pinned memory from the device.
  absl::StatusOr<gpu::PinnedMemory> pinned_memory = device.AllocatePinned(f.bytes);
  if (!pinned_memory.ok()) return Fail(pinned_memory.status(), "pinned buffer");
  std::memset(pinned_memory->get(), 1, f.bytes);
  absl::StatusOr<Row> pinned = MeasureRow(bench, "pinned (cudaMallocHost)", pinned_memory->get());
  if (!pinned.ok()) return Fail(pinned.status(), "pinned");

  // A check that the copies ran: the arena's bytes through the device into
  // the pinned buffer (all ones until now).
  if (absl::StatusOr<double> s = bench.TimeOne(arena->data(), Direction::kHostToDevice); !s.ok()) {
    return Fail(s.status(), "check");
  }
  if (absl::StatusOr<double> s = bench.TimeOne(pinned_memory->get(), Direction::kDeviceToHost);
      !s.ok()) {
    return Fail(s.status(), "check");
  }
  if (std::memcmp(arena->data(), pinned_memory->get(), f.bytes) != 0) {
    std::fprintf(stderr, "gpu_copy: the arena's bytes did not come back through the device\n");
    return 1;
  }

  const Row rows[] = {*registered, *pageable, *pinned};
  std::printf("\n%-36s %26s %26s\n", "buffer", "H2D GB/s median (range)",
              "D2H GB/s median (range)");
  for (const Row& r : rows) {
    std::printf("%-36s %8.2f (%6.2f - %6.2f) %8.2f (%6.2f - %6.2f)\n", r.buffer, r.h2d.median / 1e9,
                r.h2d.low / 1e9, r.h2d.high / 1e9, r.d2h.median / 1e9, r.d2h.low / 1e9,
                r.d2h.high / 1e9);
  }
  std::printf("\nregistering the arena: %.2f ms (%.2f GB/s), unregistering: %.2f ms\n",
              register_seconds * 1e3, f.bytes / std::max(register_seconds, 1e-9) / 1e9,
              unregister_seconds * 1e3);
  const double h2d_ratio = registered->h2d.median / pinned->h2d.median;
  const double d2h_ratio = registered->d2h.median / pinned->d2h.median;
  std::printf("arena_registered/pinned H2D: %.3fx (target >= %.1fx): %s\n", h2d_ratio, kTarget,
              Verdict(h2d_ratio));
  std::printf("arena_registered/pinned D2H: %.3fx (target >= %.1fx): %s\n", d2h_ratio, kTarget,
              Verdict(d2h_ratio));
  std::printf("arena_pageable/pinned H2D: %.3fx, D2H: %.3fx (for comparison)\n",
              pageable->h2d.median / pinned->h2d.median, pageable->d2h.median / pinned->d2h.median);
  return 0;
}

}  // namespace
}  // namespace offload::bench

int main(int argc, char** argv) { return offload::bench::Main(argc, argv); }
