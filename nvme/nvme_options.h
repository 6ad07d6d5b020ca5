// The NVMe tier's settings: the swap files' layout and the I/O engine's. One
// light header (no liburing): the daemon's configuration, the swap space and
// the backends all use these same structs, and every range is defined once,
// here, for the registry binding and the components' own validation alike.
// Whether each setting can change while offloadd runs is declared where it
// is bound (BindNvmeTunables) and shown by `offloadctl config list`.
#ifndef OFFLOADD_NVME_NVME_OPTIONS_H_
#define OFFLOADD_NVME_NVME_OPTIONS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "base/config_registry.h"

namespace offload {

struct IoOptions {
  // "auto" (io_uring if the kernel allows it, else posix with a warning),
  // "io_uring" or "posix".
  std::string backend = "auto";

  // Requests in flight per ring (posix: per Run call). Deeper queues keep
  // NVMe busy; beyond ~32 they only add latency.
  int64_t queue_depth = 32;

  // Largest single read or write (a multiple of 4 KiB); bigger requests are
  // split. Large requests amortise per-I/O cost, small ones spread better
  // over queue slots and devices.
  int64_t request_bytes = int64_t{1} << 20;

  // Independent io_uring instances; each serves one Run() at a time, so this
  // bounds concurrent callers without contention.
  int64_t rings = 2;

  // Queue this many requests before each io_uring_submit (1 = submit each
  // at once). Larger batches save syscalls at high queue depth.
  int64_t submit_batch = 8;

  // A kernel thread polls the submission queue (no submit syscalls, one core
  // spinning while busy).
  bool sqpoll = false;

  // Worker threads of the posix fallback.
  int64_t posix_threads = 8;
};

struct NvmeOptions {
  // Comma-separated directories for swap files, one per NVMe device; extents
  // are striped over all of them. Empty (the default) means no NVMe tier.
  std::string dirs;

  // Space preallocated (fallocate) in each directory at start-up, rounded
  // down to the alignment. More space holds more offloaded state.
  int64_t bytes_per_dir = int64_t{8} << 30;

  // Striping unit across directories (a multiple of the alignment). Larger
  // stripes mean fewer, bigger requests; smaller ones spread a small extent
  // over more devices.
  int64_t stripe_bytes = int64_t{1} << 20;

  // Record an XXH3-64 checksum per stripe at swap-out and verify it at
  // swap-in. Costs hashing time (benches/RESULTS.md).
  bool checksum = true;

  // O_DIRECT where the filesystem supports it (else buffered, with a
  // warning).
  bool direct_io = true;

  IoOptions io;

  // `dirs` split at commas, blanks trimmed, empty entries dropped.
  std::vector<std::string> DirList() const;
};

// io_uring rings have 256 entries; the other backends use the same bound.
inline constexpr IntRange kQueueDepthRange{1, 256};
inline constexpr IntRange kSubmitBatchRange{1, 256};
inline constexpr IntRange kRingsRange{1, 64};
inline constexpr IntRange kPosixThreadsRange{1, 256};
// Also a multiple of kIoGranule.
inline constexpr IntRange kRequestBytesRange{4096, int64_t{1} << 30};
inline constexpr IntRange kBytesPerDirRange{int64_t{1} << 20, INT64_MAX};
inline constexpr IntRange kStripeBytesRange{4096, int64_t{1} << 30};
inline constexpr int64_t kIoGranule = 4096;

// INVALID_ARGUMENT naming the setting for anything out of range.
absl::Status ValidateIoOptions(const IoOptions& options);
absl::Status ValidateRequestBytes(int64_t bytes);

// Binds every field under "nvme.*". `options` must outlive `registry`.
void BindNvmeTunables(NvmeOptions* options, ConfigRegistry* registry);

}  // namespace offload

#endif  // OFFLOADD_NVME_NVME_OPTIONS_H_
