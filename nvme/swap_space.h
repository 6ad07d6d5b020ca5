// The NVMe tier's layout: one preallocated swap file per directory (one
// directory per device), an extent allocator over them, and per-extent
// checksums.
//
// An extent is written in stripes of stripe_bytes, round-robin across the
// directories (as ZeRO-Infinity stripes over several NVMe paths), so one
// swap-out or swap-in keeps every device busy. Each file's share of an
// extent is contiguous. Writes go to fresh space; Rewrite frees the old
// space only after the new write succeeded, so a failed write (ENOSPC, EIO)
// never damages data already swapped out.
//
// Integrity: with `checksum` on, a 64-bit XXH3 of each stripe of the data
// is recorded at swap-out and checked at swap-in; a mismatch is DATA_LOSS
// naming the extent, the file and the offset. Each stripe is hashed as soon
// as its own transfer completes, while the extent's other stripes are still
// in flight (RequestDone), so hashing overlaps the I/O instead of following
// (reads) or preceding (writes) the whole of it.
//
// Buffers handed to Write/Read must be aligned to alignment() and span
// RoundUp(bytes, alignment()) bytes (the arena's page-aligned regions do).
//
// Thread-safety: all methods are safe from any thread; I/O runs without the
// allocator lock. Operations on one extent must not overlap (its owner
// serialises them); Free while a Read of the same extent runs is a bug the
// checksum would at least report.
#ifndef OFFLOADD_NVME_SWAP_SPACE_H_
#define OFFLOADD_NVME_SWAP_SPACE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "nvme/dio.h"
#include "nvme/io_backend.h"
#include "nvme/nvme_options.h"

namespace offload {

struct SwapDirStats {
  std::string path;  // the swap file
  bool direct = false;
  uint64_t capacity = 0;
  uint64_t free = 0;
};

struct SwapStats {
  std::vector<SwapDirStats> dirs;
  uint64_t capacity = 0;
  uint64_t free = 0;
  uint64_t extents = 0;
  uint32_t alignment = 0;
};

class SwapSpace {
 public:
  static constexpr char kFileName[] = "offloadd.swap";

  // Creates (or reuses) <dir>/offloadd.swap in each directory, locks it
  // against other daemons, preallocates it and registers it with `backend`,
  // which must outlive this object. RESOURCE_EXHAUSTED if a filesystem
  // lacks the space; FAILED_PRECONDITION if another process holds a file.
  static absl::StatusOr<std::unique_ptr<SwapSpace>> Create(const NvmeOptions& options,
                                                           IoBackend* backend);
  // Closes and removes the swap files (their contents are scratch).
  ~SwapSpace();

  uint32_t alignment() const { return alignment_; }

  // Swaps `bytes` from `src` out to fresh space; returns the new extent.
  absl::StatusOr<uint64_t> Write(const void* src, uint64_t bytes);
  // Replaces extent `id`'s contents (copy-on-write; on failure the old
  // contents stay readable).
  absl::Status Rewrite(uint64_t id, const void* src, uint64_t bytes);
  // Swaps extent `id` in to `dst`, verifying its checksum.
  absl::Status Read(uint64_t id, void* dst);
  absl::Status Free(uint64_t id);

  // Bytes extent `id` holds (NOT_FOUND if unknown).
  absl::StatusOr<uint64_t> ExtentBytes(uint64_t id) const;

  void SetChecksum(bool on);
  SwapStats Stats() const;

 private:
  struct Segment {
    int file;  // index into files_
    uint64_t offset;
    uint64_t length;
  };
  struct Extent {
    uint64_t bytes = 0;
    std::vector<Segment> segments;  // one per file, in stripe order from `first`
    size_t first = 0;               // file of stripe 0
    bool has_checksum = false;
    std::vector<uint64_t> checksums;  // XXH3-64 of each stripe (Plan's requests)
  };
  struct File {
    IoFile io;
    int backend_id = -1;
    uint64_t capacity = 0;
    uint64_t free = 0;
    std::map<uint64_t, uint64_t> holes;  // offset -> length, coalesced
  };

  SwapSpace(const NvmeOptions& options, IoBackend* backend)
      : options_(options), backend_(backend), checksum_(options.checksum) {}

  absl::StatusOr<Extent> Allocate(uint64_t bytes) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const Extent& e) ABSL_LOCKS_EXCLUDED(mu_);
  // Puts a segment back into its file's holes, coalescing neighbours.
  void ReturnSegment(const Segment& seg) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::vector<IoRequest> Plan(const Extent& e, IoOp op, std::byte* buffer) const;
  // XXH3-64 of stripe `r` of the extent's data at `buffer` (its bytes, not
  // the alignment's padding after them).
  static uint64_t StripeHash(const Extent& e, const std::vector<IoRequest>& plan, size_t r,
                             const std::byte* buffer);
  absl::StatusOr<Extent> WriteNew(const void* src, uint64_t bytes);
  absl::Status Annotate(const absl::Status& s, const std::string& what) const;

  const NvmeOptions options_;
  IoBackend* const backend_;
  uint32_t alignment_ = 4096;
  std::vector<std::unique_ptr<File>> files_;  // fixed after Create

  mutable absl::Mutex mu_;
  bool checksum_ ABSL_GUARDED_BY(mu_);
  size_t next_first_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t next_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, Extent> extents_ ABSL_GUARDED_BY(mu_);
  // Holes and free bytes of every file live under mu_ as well.
};

}  // namespace offload

#endif  // OFFLOADD_NVME_SWAP_SPACE_H_
