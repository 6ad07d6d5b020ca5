// The NVMe tier's layout: one preallocated swap file per directory (one
// directory per device), an extent allocator over them, and per-extent
// checksums.
//
// An extent is written in stripes of stripe_bytes, round-robin across the
// directories (as ZeRO-Infinity stripes over several NVMe paths), so one
// swap-out or swap-in keeps every device busy. Each file's share of an
// extent is contiguous. Writes go to fresh space; Rewrite frees the old
// space only after the new write succeeded, so a failed write (ENOSPC, EIO)
// never damages data already swapped out. Where the tier has no room for a
// second copy, Rewrite writes over the first instead (logged once, counted
// in SwapStats::in_place_rewrites): a training's state rewritten every step
// may fill the tier it was admitted to. A failed write in place leaves the
// extent unreadable (DATA_LOSS), never read as a mix of old and new bytes;
// an extent must not be freed while it is rewritten.
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
// Staged transfers (ReadStaged, WriteStaged, RewriteStaged) move an extent
// through a small staging buffer of the caller's, a window of whole stripes
// at a time, instead of through one buffer holding all of it: for data the
// caller keeps where direct I/O into it is slow (shared memory on 4 KiB
// pages, each of which costs a page fault to map) and moves with a copy
// (pread/pwrite of the shared file) instead. Checksums are the same per
// stripe, computed and verified in the staging buffer.
//
// Thread-safety: all methods are safe from any thread; I/O runs without the
// allocator lock. Operations on one extent must not overlap (its owner
// serialises them); Free while a Read of the same extent runs is a bug the
// checksum would at least report.
#ifndef OFFLOADD_NVME_SWAP_SPACE_H_
#define OFFLOADD_NVME_SWAP_SPACE_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
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
  uint64_t in_place_rewrites = 0;  // Rewrites without room for a second copy
};

class SwapSpace {
 public:
  static constexpr char kFileName[] = "offloadd.swap";

  // Creates (or reuses) <dir>/offloadd.swap in each directory, locks it
  // against other daemons, preallocates it and registers it with `backend`,
  // which must outlive this object. RESOURCE_EXHAUSTED if a filesystem
  // lacks the space for kSpaceWait (the space of a swap file a just-stopped
  // offloadd unlinked comes back some milliseconds after its exit);
  // FAILED_PRECONDITION if another process holds a file.
  static constexpr absl::Duration kSpaceWait = absl::Seconds(2);
  static absl::StatusOr<std::unique_ptr<SwapSpace>> Create(const NvmeOptions& options,
                                                           IoBackend* backend);
  // Closes and removes the swap files (their contents are scratch).
  ~SwapSpace();

  uint32_t alignment() const { return alignment_; }
  uint64_t stripe_bytes() const { return static_cast<uint64_t>(options_.stripe_bytes); }

  // One window of a staged transfer: `chunk` holds (read) or must be filled
  // with (write) the extent's bytes [offset, offset + chunk.size()). An
  // error stops the transfer and is returned with its code (and context).
  using StagedChunk = absl::FunctionRef<absl::Status(uint64_t offset, absl::Span<std::byte> chunk)>;

  // Swaps `bytes` from `src` out to fresh space; returns the new extent.
  absl::StatusOr<uint64_t> Write(const void* src, uint64_t bytes);
  // Replaces extent `id`'s contents (copy-on-write; on failure the old
  // contents stay readable; in place where there is no room, see above).
  absl::Status Rewrite(uint64_t id, const void* src, uint64_t bytes);
  // Swaps extent `id` in to `dst`, verifying its checksum.
  absl::Status Read(uint64_t id, void* dst);
  // As Write, Rewrite and Read, through `staging` (aligned to alignment(),
  // at least stripe_bytes() long; a window is as many whole stripes as it
  // holds): Write calls `source` to fill each window before writing it;
  // ReadStaged verifies each window's stripes before handing it to `sink`,
  // so `sink` never sees bytes that failed their checksum. A failed read
  // may have handed earlier windows to `sink`.
  absl::StatusOr<uint64_t> WriteStaged(uint64_t bytes, absl::Span<std::byte> staging,
                                       StagedChunk source);
  absl::Status RewriteStaged(uint64_t id, uint64_t bytes, absl::Span<std::byte> staging,
                             StagedChunk source);
  absl::Status ReadStaged(uint64_t id, absl::Span<std::byte> staging, StagedChunk sink);
  absl::Status Free(uint64_t id);

  // Bytes extent `id` holds (NOT_FOUND if unknown).
  absl::StatusOr<uint64_t> ExtentBytes(uint64_t id) const;

  void SetChecksum(bool on);
  SwapStats Stats() const;

  // Declares a long-lived I/O buffer (a staging buffer) to the I/O backend,
  // which registers it for fixed-buffer I/O where it can; RemoveBuffer
  // before unmapping it, with no I/O on it in flight.
  void AddBuffer(void* base, uint64_t length);
  void RemoveBuffer(void* base, uint64_t length);

 private:
  struct Segment {
    int file;  // index into files_
    uint64_t offset;
    uint64_t length;
  };
  struct Extent {
    uint64_t bytes = 0;
    // Per file in stripe order from `first`: one, or (the file's free space
    // scattered) several pieces of whole stripes, in the order they fill.
    std::vector<Segment> segments;
    size_t first = 0;  // file of stripe 0
    bool has_checksum = false;
    std::vector<uint64_t> checksums;  // XXH3-64 of each stripe (Plan's requests)
    bool torn = false;                // a rewrite in place failed: not readable
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
  // Takes `length` bytes from the start of `hole` (of file `file`, `f`) as
  // the next segment of `e`; the hole's rest stays a hole.
  void TakeSegment(File& f, int file, std::map<uint64_t, uint64_t>::iterator hole, uint64_t length,
                   Extent* e) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // One request per stripe, in order: stripe r holds the extent's bytes
  // from r * stripe_bytes(), at buffer + r * stripe_bytes().
  std::vector<IoRequest> Plan(const Extent& e, IoOp op, std::byte* buffer) const;
  size_t StripeCount(const Extent& e) const;
  // The extent's data bytes in stripe r (not the alignment's padding).
  uint64_t StripeDataBytes(const Extent& e, size_t r) const;
  absl::Status Mismatch(const Extent& e, size_t r, uint64_t got) const;
  // Gives a written extent its id.
  uint64_t Register(Extent e) ABSL_LOCKS_EXCLUDED(mu_);
  // Where a transfer's stripes are: one buffer holding the whole extent
  // (`whole`), or a staging buffer that `chunk` fills or drains a window of
  // stripes at a time.
  struct Buffers {
    std::byte* whole = nullptr;
    absl::Span<std::byte> staging;
    const StagedChunk* chunk = nullptr;

    static Buffers Whole(const void* buffer) {
      return {static_cast<std::byte*>(const_cast<void*>(buffer)), {}, nullptr};
    }
    static Buffers Staged(absl::Span<std::byte> staging, const StagedChunk& chunk) {
      return {nullptr, staging, &chunk};
    }
  };
  absl::Status CheckBuffers(const Buffers& b, bool write) const;
  // What a write of `bytes` from `b` needs (some bytes; CheckBuffers).
  absl::Status CheckWrite(uint64_t bytes, const Buffers& b) const;
  // Runs the extent's stripes through `b`: from one whole buffer in one
  // batch; staged, a window at a time: a write's `chunk` fills the window
  // before it runs; a read's window is checked by `verify(first, end)` (its
  // stripes' indices) and then drained by `chunk`. `done(r, data)` hears of
  // stripe r once transferred, `data` being where its bytes are.
  absl::Status Transfer(const Extent& e, IoOp op, const Buffers& b,
                        const std::function<void(size_t r, const std::byte* data)>& done,
                        const std::function<absl::Status(size_t first, size_t end)>& verify) const;
  absl::StatusOr<Extent> WriteNew(uint64_t bytes, const Buffers& b);
  absl::Status ReadInto(uint64_t id, const Buffers& b);
  absl::Status RewriteFrom(uint64_t id, uint64_t bytes, const Buffers& b);
  // Writes `b` into `e`'s space (its checksums with it).
  absl::Status Fill(Extent& e, const Buffers& b);
  // Fill of newly allocated space, released if it fails.
  absl::StatusOr<Extent> FillNew(Extent e, const Buffers& b);
  // Rewrite over extent `id`'s own space (`e`, a copy of it).
  absl::Status RewriteInPlace(uint64_t id, Extent e, uint64_t bytes, const Buffers& b);
  std::atomic<uint64_t> in_place_rewrites_{0};
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
