// The host pool's memory as one file on a memory file system (tmpfs), so
// that what it holds can outlive offloadd (memory.pool_dir): a SIGTERM stop
// keeps the sessions' state where it is, naming the file and offsets in
// their kept checkpoints, instead of writing it to disk, and the next
// offloadd reads it from there (engine/kept_sessions.h).
//
// The file is created unnamed (O_TMPFILE: it goes with the process unless
// Link names it), sparse, of kRegionBytes, and mapped once, shared; leases
// are page-aligned extents of it, taken best-fit from what was given back
// and then from the untouched rest. An extent given back is punched out of
// the file (its pages go to the kernel; it reads zeros when taken again).
// One mapping whatever the number of leases, so no slabs either.
//
// Keeping: Link gives the file a name, and Retain marks the extents kept
// checkpoints name (while their leases are pinned): given back, those stay
// as they are until the process ends. The destructor punches out
// everything else. Each extent's pages are allocated when it is taken
// (fallocate): a full tmpfs is an error then, not SIGBUS at a touch.
//
// Thread-safety: all methods are safe from any thread.
#ifndef OFFLOADD_SWAPPER_POOL_FILE_H_
#define OFFLOADD_SWAPPER_POOL_FILE_H_

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "base/host_memory.h"
#include "base/unique_fd.h"

namespace offload {

class PoolFile {
 public:
  // Address space (and file size) reserved: a pool never holds more than
  // this in its file (a lease that does not fit is the pool's ordinary
  // private memory instead).
  static constexpr uint64_t kRegionBytes = uint64_t{1} << 40;

  // A new unnamed file in `dir`, which must be this user's alone
  // (checkpoint-style: mode 0700) and on tmpfs (ramfs cannot punch holes):
  // INVALID_ARGUMENT naming the path and what it is otherwise
  // (PERMISSION_DENIED for one others may write); FAILED_PRECONDITION while
  // another PoolFile (another offloadd) has the directory; the errno's code
  // naming the call where the file cannot be made or mapped.
  static absl::StatusOr<std::unique_ptr<PoolFile>> Create(const std::string& dir,
                                                          uint64_t region_bytes = kRegionBytes);
  ~PoolFile();
  PoolFile(const PoolFile&) = delete;
  PoolFile& operator=(const PoolFile&) = delete;

  struct Extent {
    std::byte* data = nullptr;
    uint64_t offset = 0;  // in the file
    uint64_t length = 0;  // whole pages (or `align`s) the extent takes
  };
  // An extent of at least `bytes` (> 0), at an offset that is a multiple of
  // `align` (a power of two, at least the page size), zeroed.
  // RESOURCE_EXHAUSTED where the region has no such room.
  absl::StatusOr<Extent> Take(uint64_t bytes, uint64_t align);
  // Gives `extent` back: punched out and free for the next Take, unless it
  // is retained (then its memory stays: true) or was claimed by a reopening
  // that failed (a kept range again).
  bool Give(const Extent& extent);

  // Taking a kept file over (the next offloadd, engine/kept_sessions.h):
  // while no extent of this file is taken, makes the file at `path` (a
  // kept name of an earlier offloadd's pool file) this pool's file. Its
  // `kept` ranges (offset, bytes: what reopened sessions may Claim) stay;
  // every other byte below their end is punched out and free.
  // FAILED_PRECONDITION once extents are taken; the errno's code naming
  // the path where it cannot be opened or mapped (nothing changes then).
  absl::Status TakeOver(const std::string& path,
                        const std::vector<std::pair<uint64_t, uint64_t>>& kept);
  // The kept range [offset, offset + bytes) as an extent taken (zero
  // copies: a reopened session's block takes its bytes where they are).
  // FAILED_PRECONDITION unless it lies in a kept range not claimed yet.
  absl::StatusOr<Extent> Claim(uint64_t offset, uint64_t bytes);
  // Once the kept sessions are reopened: what they claimed is theirs for
  // good, and kept ranges no one claimed are punched out and free, except
  // those within `keep` (offset, bytes: sessions that could not be
  // reopened, kept for a later start), which stay as they are. (An extent
  // claimed and given back before this, by a reopening that failed, is a
  // kept range again.)
  void ReleaseUnclaimed(const std::vector<std::pair<uint64_t, uint64_t>>& keep);
  // Bytes Claim took since this file was taken over.
  uint64_t claimed_bytes() const;
  // Whether `path` names this pool's file.
  bool IsFile(const std::string& path) const;

  // Where [p, p + bytes) lies in the file, if it does.
  std::optional<uint64_t> OffsetOf(const void* p, uint64_t bytes) const;

  // Names the file `path` (a hard link: the same file under several names
  // is one copy); from then on the destructor leaves retained extents (and
  // kept ranges not claimed) and punches out the rest. The errno's code
  // naming the path.
  absl::Status Link(const std::string& path);
  bool linked() const;
  // Marks [offset, offset + bytes) as named by a kept checkpoint: the
  // destructor leaves it, and giving back its extent keeps its memory.
  void Retain(uint64_t offset, uint64_t bytes);

  // Bytes of extents taken and not given back, and of the file's pages in
  // memory (st_blocks; what the file system charges).
  uint64_t taken_bytes() const;
  uint64_t resident_bytes() const;
  const std::string& dir() const { return dir_; }

 private:
  PoolFile(std::string dir, UniqueFd dir_fd, UniqueFd fd, HostMemory mapping)
      : dir_(std::move(dir)),
        dir_lock_(std::move(dir_fd)),
        fd_(std::move(fd)),
        mapping_(std::move(mapping)),
        data_(mapping_.data()),
        region_(mapping_.size()) {}
  void FreeLocked(uint64_t offset, uint64_t length) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Punch(uint64_t offset, uint64_t length) const;

  const std::string dir_;
  const UniqueFd dir_lock_;  // flock'ed: one offloadd per directory
  // Replaced only by TakeOver, before any extent is taken (data_ and
  // region_ are read without the lock by OffsetOf, which callers of
  // TakeOver do not race with: it runs before the daemon serves).
  UniqueFd fd_;
  HostMemory mapping_;
  std::byte* data_;
  uint64_t region_;

  mutable absl::Mutex mu_;
  std::map<uint64_t, uint64_t> unclaimed_ ABSL_GUARDED_BY(mu_);  // offset -> length
  uint64_t top_ ABSL_GUARDED_BY(mu_) = 0;                        // never taken past this
  std::map<uint64_t, uint64_t> free_ ABSL_GUARDED_BY(mu_);       // offset -> length, below top_
  std::multimap<uint64_t, uint64_t> by_length_ ABSL_GUARDED_BY(mu_);  // length -> offset
  uint64_t taken_ ABSL_GUARDED_BY(mu_) = 0;
  bool linked_ ABSL_GUARDED_BY(mu_) = false;                    // a kept session names it
  std::string own_name_ ABSL_GUARDED_BY(mu_);                   // a taken-over file's (kOwnName)
  absl::flat_hash_set<uint64_t> claimed_ ABSL_GUARDED_BY(mu_);  // offsets, until released
  // Between TakeOver and ReleaseUnclaimed: a claim given back is kept again.
  bool reopening_ ABSL_GUARDED_BY(mu_) = false;
  uint64_t claimed_bytes_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<uint64_t, uint64_t> retained_ ABSL_GUARDED_BY(mu_);  // offset -> length
};

// Whether `dir` is on tmpfs: INVALID_ARGUMENT naming it and its file
// system's type otherwise.
absl::Status CheckMemoryFileSystem(const std::string& dir);

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_POOL_FILE_H_
