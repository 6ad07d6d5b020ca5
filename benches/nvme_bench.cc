// benches/nvme: the io_uring engine against fio on the same file.
//
//   bazel run -c opt //benches:nvme -- --dir=/path/on/nvme
//       [--sizes=256K,1M,4M,16M] [--depths=1,4,8,16,32,64] [--file_bytes=1G]
//       [--ops=write,read] [--rounds=2] [--buffers=huge|small] [--no-fixed]
//       [--no-fio] [--tiny]
//
// For each direction, request size and queue depth it moves --file_bytes
// sequentially through our backend (O_DIRECT, fixed buffers, registered
// file), and has fio do the same with its io_uring engine (direct=1,
// fixedbufs, registerfiles) on the same file, --rounds times in alternating
// order, and prints each one's best and the ratio.
// The file is written once before any timing, so writes are overwrites for
// both. Then it measures the checksum's cost: XXH3 throughput and swap-out /
// swap-in through SwapSpace with checksums on and off.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/checksum.h"
#include "base/config_registry.h"
#include "base/host_memory.h"
#include "benches/bench_util.h"
#include "nvme/dio.h"
#include "nvme/io_backend.h"
#include "nvme/io_backend_factory.h"
#include "nvme/swap_space.h"

namespace offload {
namespace {

using ::offload::bench::Clock;
using ::offload::bench::FioBandwidth;
using ::offload::bench::SecondsSince;

struct Flags {
  std::string dir;
  std::vector<uint64_t> sizes = {256 << 10, 1 << 20, 4 << 20, 16 << 20};
  std::vector<int> depths = {1, 4, 8, 16, 32, 64};
  std::string ops = "write,read";
  uint64_t file_bytes = uint64_t{1} << 30;
  bool fio = true;
  int rounds = 2;     // each runs both tools, in alternating order
  bool fixed = true;  // register the buffer pool (fixed-buffer I/O)
  bool huge = true;   // transparent huge pages for the buffer pool
};

int Main(int argc, char** argv) {
  Flags f;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto sizes = [](const std::string& list) {
      std::vector<uint64_t> out;
      for (absl::string_view s : absl::StrSplit(list, ',')) out.push_back(*ParseByteSize(s));
      return out;
    };
    if (a.rfind("--dir=", 0) == 0) {
      f.dir = a.substr(6);
    } else if (a.rfind("--sizes=", 0) == 0) {
      f.sizes = sizes(a.substr(8));
    } else if (a.rfind("--depths=", 0) == 0) {
      f.depths.clear();
      for (absl::string_view s : absl::StrSplit(a.substr(9), ',')) {
        int d;
        if (absl::SimpleAtoi(s, &d)) f.depths.push_back(d);
      }
    } else if (a.rfind("--file_bytes=", 0) == 0) {
      f.file_bytes = sizes(a.substr(13))[0];
    } else if (a.rfind("--rounds=", 0) == 0) {
      f.rounds = std::max(1, std::atoi(a.c_str() + 9));
    } else if (a == "--buffers=small") {
      f.huge = false;
    } else if (a == "--buffers=huge") {
      f.huge = true;
    } else if (a == "--no-fixed") {
      f.fixed = false;
    } else if (a == "--no-fio") {
      f.fio = false;
    } else if (a == "--tiny") {
      f.sizes = {256 << 10, 1 << 20};
      f.depths = {1, 8};
      f.file_bytes = 16 << 20;
      f.rounds = 1;
    } else if (a.rfind("--ops=", 0) == 0) {
      f.ops = a.substr(6);
    } else {
      std::fprintf(stderr, "unknown flag %s (see benches/nvme_bench.cc)\n", a.c_str());
      return 2;
    }
  }
  if (f.dir.empty()) {
    std::fprintf(stderr, "usage: nvme --dir=DIRECTORY [...]; DIRECTORY should be on the NVMe\n");
    return 2;
  }
  const std::string path = f.dir + "/offloadd_bench.dat";
  auto file = OpenIoFile(path, /*create=*/true, /*want_direct=*/true);
  if (!file.ok()) {
    std::fprintf(stderr, "%s\n", file.status().ToString().c_str());
    return 1;
  }
  std::printf("file %s, %llu MiB, %s; our buffers: %s pages (fio's: 4 KiB pages)\n", path.c_str(),
              static_cast<unsigned long long>(f.file_bytes >> 20),
              file->direct ? "O_DIRECT" : "buffered (no O_DIRECT here)",
              f.huge ? "2 MiB transparent huge" : "4 KiB");
  uint64_t max_size = 0;
  int max_depth = 0;
  for (uint64_t s : f.sizes) max_size = std::max(max_size, s);
  for (int d : f.depths) max_depth = std::max(max_depth, d);
  auto pool = HostMemory::Allocate(max_size * static_cast<uint64_t>(max_depth),
                                   f.huge ? Pages::kHuge : Pages::kSmall);
  if (!pool.ok()) return 1;
  std::memset(pool->data(), 0x5a, pool->size());

  IoOptions o;
  o.backend = "io_uring";
  o.rings = 1;
  o.request_bytes = static_cast<int64_t>(std::min<uint64_t>(max_size, 1 << 30));
  auto backend = MakeIoBackend(o);
  if (!backend.ok()) {
    std::fprintf(stderr, "%s\n", backend.status().ToString().c_str());
    return 1;
  }
  IoBackend& b = **backend;
  const int id = *b.AddFile(file->fd.get(), path);
  if (f.fixed && !b.AddBuffer(pool->data(), pool->size()).ok()) return 1;

  auto run = [&](IoOp op, uint64_t size, int depth) -> double {
    std::vector<IoRequest> reqs;
    for (uint64_t off = 0, k = 0; off < f.file_bytes; off += size, ++k) {
      reqs.push_back({op, id, off, pool->data() + (k % static_cast<uint64_t>(depth)) * size,
                      std::min(size, f.file_bytes - off)});
    }
    (void)b.SetRequestBytes(static_cast<int64_t>(size));
    (void)b.SetQueueDepth(depth);
    (void)b.SetSubmitBatch(std::min(depth, 8));
    auto start = Clock::now();
    absl::Status s = b.Run(reqs);
    const double t = SecondsSince(start);
    if (!s.ok()) {
      std::fprintf(stderr, "%s\n", s.ToString().c_str());
      return -1;
    }
    return static_cast<double>(f.file_bytes) / t;
  };

  // Prefill, so every timed write is an overwrite for both tools.
  if (run(IoOp::kWrite, max_size, std::min(max_depth, 16)) < 0) return 1;
  fsync(file->fd.get());

  int failures = 0;
  double worst_target_ratio = 1e9;
  std::vector<double> target_ratios;  // requests >= 1MiB at depth >= 8
  for (IoOp op : {IoOp::kWrite, IoOp::kRead}) {
    const bool write = op == IoOp::kWrite;
    if (f.ops.find(write ? "write" : "read") == std::string::npos) continue;
    std::printf("\n== %s (GB/s)\n%-9s %6s %10s %10s %8s\n", write ? "write" : "read", "request",
                "depth", "offloadd", "fio", "ratio");
    for (uint64_t size : f.sizes) {
      for (int depth : f.depths) {
        // Rounds alternate the order (ours, fio | fio, ours | ...) and each
        // keeps its best: whatever sits below the file (a VM's host cache,
        // the drive's own state) favours neither.
        double ours = -1, fio = -1;
        for (int round = 0; round < f.rounds; ++round) {
          for (int k = 0; k < 2; ++k) {
            if ((k == 0) == (round % 2 == 0)) {
              ours = std::max(ours, run(op, size, depth));
            } else if (f.fio) {
              fio = std::max(fio, FioBandwidth(path, write, size, depth, f.file_bytes));
            }
          }
        }
        if (ours < 0 || (f.fio && fio < 0)) ++failures;
        char ratio[16] = "-";
        if (fio > 0 && ours > 0) {
          std::snprintf(ratio, sizeof(ratio), "%.1f%%", 100 * ours / fio);
          if (size >= (1 << 20) && depth >= 8) {
            worst_target_ratio = std::min(worst_target_ratio, ours / fio);
            target_ratios.push_back(ours / fio);
          }
        }
        std::printf("%-9s %6d %10.3f %10.3f %8s\n",
                    FormatByteSize(static_cast<int64_t>(size)).c_str(), depth, ours / 1e9,
                    fio / 1e9, ratio);
      }
    }
  }
  if (f.fio && worst_target_ratio < 1e9) {
    std::sort(target_ratios.begin(), target_ratios.end());
    std::printf(
        "\nrequests >= 1MiB at depth >= 8 (%zu cells): median %.1f%%, worst %.1f%% of fio "
        "(target 95%%)\n",
        target_ratios.size(), 100 * target_ratios[target_ratios.size() / 2],
        100 * worst_target_ratio);
  }
  if (f.fio) {
    std::printf(
        "fio command per cell: fio --name=bench --filename=%s --ioengine=io_uring --direct=1 "
        "--rw=read|write --bs=SIZE --iodepth=DEPTH --size=%llu --fixedbufs --registerfiles "
        "--thread --numjobs=1\n",
        path.c_str(), static_cast<unsigned long long>(f.file_bytes));
  }
  unlink(path.c_str());

  // Checksum cost: XXH3-64 as the tier computes it (Checksum64: libxxhash's
  // run-time dispatch to the widest vector unit) against libxxhash's baseline
  // build (SSE2), alternating, each the best of 5: from the cache (a 1 MiB
  // stripe hashed 64 times) and from memory (each 1 MiB stripe of a buffer
  // larger than the caches once, as a stripe just read from the disk is).
  {
    {
      const size_t stripe = 1 << 20;
      const size_t cold_bytes = f.file_bytes <= (64u << 20) ? (64u << 20) : (512u << 20);
      auto buf = HostMemory::Allocate(cold_bytes);
      std::memset(buf->data(), 1, buf->size());
      uint64_t sink = 0;
      using HashFn = uint64_t (*)(const void*, size_t);
      const HashFn fns[2] = {Checksum64, Checksum64Baseline};
      double hot[2] = {0, 0}, cold[2] = {0, 0};
      for (int rep = 0; rep < 5; ++rep) {
        for (int k = 0; k < 2; ++k) {
          const int i = rep % 2 == 0 ? k : 1 - k;
          auto start = Clock::now();
          for (int r = 0; r < 64; ++r) sink += fns[i](buf->data(), stripe);
          hot[i] = std::max(hot[i], 64.0 * stripe / SecondsSince(start) / 1e9);
          start = Clock::now();
          for (size_t at = 0; at + stripe <= buf->size(); at += stripe) {
            sink += fns[i](buf->data() + at, stripe);
          }
          cold[i] = std::max(cold[i], static_cast<double>(buf->size()) / SecondsSince(start) / 1e9);
        }
      }
      std::printf(
          "\n== checksum (XXH3-64, 1 MiB stripes, one core, GB/s): from the cache %.1f, from "
          "memory "
          "%.1f (%zu MiB); libxxhash's baseline build %.1f and %.1f: %.2fx and %.2fx (sink %llx)\n",
          hot[0], cold[0], buf->size() >> 20, hot[1], cold[1], hot[0] / hot[1], cold[0] / cold[1],
          static_cast<unsigned long long>(sink & 0xf));
    }  // (the buffer freed before the swaps below)

    IoOptions so;
    so.queue_depth = 32;
    auto sb = MakeIoBackend(so);
    NvmeOptions swap;
    swap.dirs = f.dir;
    swap.bytes_per_dir = static_cast<int64_t>(std::min<uint64_t>(f.file_bytes, 512 << 20));
    swap.stripe_bytes = 16 << 20;
    auto space = SwapSpace::Create(swap, sb->get());
    if (!space.ok()) {
      std::fprintf(stderr, "%s\n", space.status().ToString().c_str());
      return 1;
    }
    const uint64_t extent =
        std::min<uint64_t>(static_cast<uint64_t>(swap.bytes_per_dir) / 2, 64 << 20);
    auto data = HostMemory::Allocate(extent);
    std::memset(data->data(), 3, extent);
    std::printf("%-14s %12s %12s\n", "swap 1 extent", "out GB/s", "in GB/s");
    for (bool checksum : {false, true}) {
      (*space)->SetChecksum(checksum);
      double out_best = 0, in_best = 0;
      for (int r = 0; r < 3; ++r) {
        auto start = Clock::now();
        auto eid = (*space)->Write(data->data(), extent);
        const double out = static_cast<double>(extent) / SecondsSince(start);
        start = Clock::now();
        absl::Status s = eid.ok() ? (*space)->Read(*eid, data->data()) : eid.status();
        const double in = static_cast<double>(extent) / SecondsSince(start);
        if (!s.ok() || !(*space)->Free(*eid).ok()) {
          std::fprintf(stderr, "%s\n", s.ToString().c_str());
          ++failures;
          break;
        }
        out_best = std::max(out_best, out);
        in_best = std::max(in_best, in);
      }
      std::printf("%-14s %12.3f %12.3f\n", checksum ? "checksum on" : "checksum off",
                  out_best / 1e9, in_best / 1e9);
    }
  }
  return failures == 0 ? 0 : 1;
}

}  // namespace
}  // namespace offload

int main(int argc, char** argv) {
  setvbuf(stdout, nullptr, _IOLBF, 0);  // progress shows as it goes
  return offload::Main(argc, argv);
}
