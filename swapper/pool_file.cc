#include "swapper/pool_file.h"

#include <fcntl.h>
#include <linux/magic.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/directory.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload {
namespace {

// The name a pool file taken over keeps while this process has it (it is
// no unnamed file then: without a name it could not be named again).
constexpr char kOwnName[] = "pool.memory";

}  // namespace

absl::Status CheckMemoryFileSystem(const std::string& dir) {
  struct statfs fs;
  if (statfs(dir.c_str(), &fs) != 0) return PosixError(absl::StrCat("statfs of ", dir), errno);
  if (fs.f_type != TMPFS_MAGIC) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "memory.pool_dir %s is not on tmpfs (its file system's type is 0x%x): elsewhere the "
        "pool's memory would be written back to a disk, or (ramfs) never given back",
        dir, static_cast<uint64_t>(fs.f_type)));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<PoolFile>> PoolFile::Create(const std::string& dir,
                                                           uint64_t region_bytes) {
  if (dir.empty() || dir[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("memory.pool_dir must be an absolute path, got '", dir, "'"));
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("stat of ", dir), errno);
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat("memory.pool_dir ", dir, " is not a directory"));
  }
  if (!PrivateToThisUser(st)) {
    return absl::PermissionDeniedError(
        absl::StrCat("memory.pool_dir ", dir, " must belong to this user (uid ", geteuid(),
                     ") and be writable by no one else: it holds every session's state"));
  }
  RETURN_IF_ERROR(CheckMemoryFileSystem(dir));
  // One offloadd per directory: another one's start would take this one's
  // kept sessions for litter (ReopenKeptSessions removes names no kept
  // session of its own holds).
  UniqueFd dir_fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dir_fd.valid()) return PosixError(absl::StrCat("opening ", dir), errno);
  if (flock(dir_fd.get(), LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "memory.pool_dir ", dir, " is in use by another offloadd: each needs its own"));
    }
    return PosixError(absl::StrCat("locking ", dir), errno);
  }
  // A name an earlier offloadd's taken-over file kept, if it died: its kept
  // names, if any, still hold what was kept.
  unlink(absl::StrCat(dir, "/", kOwnName).c_str());
  UniqueFd fd(open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600));
  if (!fd.valid()) return PosixError(absl::StrCat("creating an unnamed file in ", dir), errno);
  if (ftruncate(fd.get(), static_cast<off_t>(region_bytes)) != 0) {
    return PosixError(absl::StrCat("sizing the pool's file in ", dir), errno);
  }
  const uint64_t huge = SharedHugePageBytes();
  ASSIGN_OR_RETURN(HostMemory mapping,
                   HostMemory::MapShared(fd.get(), 0, region_bytes,
                                         huge > 0 ? Pages::kHuge : Pages::kSystemDefault));
  return std::unique_ptr<PoolFile>(
      new PoolFile(dir, std::move(dir_fd), std::move(fd), std::move(mapping)));
}

PoolFile::~PoolFile() {
  absl::MutexLock lock(&mu_);
  if (!own_name_.empty()) unlink(own_name_.c_str());
  if (!linked_) return;  // no kept session names it: it goes with the descriptor
  // What no kept checkpoint names (nor a kept session not reopened) goes
  // now, not when the last name does.
  std::vector<std::pair<uint64_t, uint64_t>> kept(retained_.begin(), retained_.end());
  kept.insert(kept.end(), unclaimed_.begin(), unclaimed_.end());
  std::sort(kept.begin(), kept.end());
  uint64_t at = 0;
  for (const auto& [offset, length] : kept) {
    if (offset > at) Punch(at, offset - at);
    at = std::max(at, offset + length);
  }
  if (top_ > at) Punch(at, top_ - at);
}

void PoolFile::Punch(uint64_t offset, uint64_t length) const {
  if (fallocate(fd_.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(length)) != 0) {
    // Zero for the next lease all the same (its pages stay).
    std::memset(data_ + offset, 0, length);
  }
}

absl::Status PoolFile::TakeOver(const std::string& path,
                                const std::vector<std::pair<uint64_t, uint64_t>>& kept) {
  {
    absl::MutexLock lock(&mu_);
    if (taken_ != 0 || linked_ || !own_name_.empty()) {
      return absl::FailedPreconditionError(
          "the pool's file has extents taken already, or is a kept one already");
    }
  }
  UniqueFd fd(open(path.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return PosixError(absl::StrCat("opening the kept pool file ", path), errno);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return PosixError(absl::StrCat("stat of ", path), errno);
  if (!S_ISREG(st.st_mode) || !PrivateToThisUser(st)) {
    return absl::PermissionDeniedError(
        absl::StrCat(path, " is not a pool file of this user's: not taken over"));
  }
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  uint64_t end = 0;
  for (const auto& [offset, bytes] : kept) {
    const uint64_t length = RoundUpToPage(bytes);
    if (offset % PageSize() != 0 || offset + length > static_cast<uint64_t>(st.st_size)) {
      return absl::DataLossError(
          absl::StrCat("a kept range of ", bytes, " bytes at ", offset, " does not fit ", path));
    }
    ranges.emplace_back(offset, length);
    end = std::max(end, offset + length);
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].first + ranges[i - 1].second) {
      return absl::DataLossError(
          absl::StrCat("kept ranges overlap at ", ranges[i].first, " in ", path));
    }
  }
  ASSIGN_OR_RETURN(
      HostMemory mapping,
      HostMemory::MapShared(fd.get(), 0, static_cast<uint64_t>(st.st_size),
                            SharedHugePageBytes() > 0 ? Pages::kHuge : Pages::kSystemDefault));
  // A name of its own while this process has it (the kept ones go as their
  // sessions are reopened): without one it could not be named again.
  const std::string own = absl::StrCat(dir_, "/", kOwnName);
  unlink(own.c_str());
  if (link(path.c_str(), own.c_str()) != 0) {
    return PosixError(absl::StrCat("naming the kept pool file ", own), errno);
  }
  absl::MutexLock lock(&mu_);
  own_name_ = own;
  fd_ = std::move(fd);
  mapping_ = std::move(mapping);
  data_ = mapping_.data();
  region_ = mapping_.size();
  free_.clear();
  by_length_.clear();
  unclaimed_.clear();
  claimed_.clear();
  reopening_ = true;
  // What no kept range holds (an earlier offloadd's unkept leases, if it
  // died before punching them) goes.
  uint64_t at = 0;
  for (const auto& [offset, length] : ranges) {
    if (offset > at) {
      Punch(at, offset - at);
      FreeLocked(at, offset - at);
    }
    unclaimed_[offset] = length;
    at = offset + length;
  }
  // And past them (an earlier offloadd stopped before punching its leases).
  if (region_ > end) Punch(end, region_ - end);
  top_ = end;
  return absl::OkStatus();
}

absl::StatusOr<PoolFile::Extent> PoolFile::Claim(uint64_t offset, uint64_t bytes) {
  const uint64_t length = RoundUpToPage(bytes);
  absl::MutexLock lock(&mu_);
  auto it = unclaimed_.upper_bound(offset);
  if (it == unclaimed_.begin()) {
    return absl::FailedPreconditionError(absl::StrCat("no kept bytes at ", offset));
  }
  --it;
  const uint64_t begin = it->first, end = it->first + it->second;
  if (offset < begin || offset + length > end) {
    return absl::FailedPreconditionError(
        absl::StrCat("the ", bytes, " bytes at ", offset, " are not kept, or claimed already"));
  }
  // Pages for what the kept bytes left as holes (never touched): a full
  // tmpfs says so here, not with SIGBUS later.
  if (fallocate(fd_.get(), 0, static_cast<off_t>(offset), static_cast<off_t>(length)) != 0) {
    return PosixError(absl::StrCat("the kept bytes at ", offset, " of the pool's file"), errno);
  }
  unclaimed_.erase(it);
  if (offset > begin) unclaimed_[begin] = offset - begin;
  if (end > offset + length) unclaimed_[offset + length] = end - offset - length;
  // (A claim after the reopening is its session's for good.)
  if (reopening_) claimed_.insert(offset);
  taken_ += length;
  claimed_bytes_ += length;
  return Extent{data_ + offset, offset, length};
}

void PoolFile::ReleaseUnclaimed(const std::vector<std::pair<uint64_t, uint64_t>>& keep) {
  std::vector<std::pair<uint64_t, uint64_t>> held;
  for (const auto& [offset, bytes] : keep) held.emplace_back(offset, RoundUpToPage(bytes));
  std::sort(held.begin(), held.end());
  std::vector<std::pair<uint64_t, uint64_t>> go;  // pieces of unclaimed ranges not held
  {
    absl::MutexLock lock(&mu_);
    claimed_.clear();  // the reopened sessions' blocks are theirs for good
    reopening_ = false;
    std::map<uint64_t, uint64_t> stay;
    for (const auto& [offset, length] : unclaimed_) {
      uint64_t at = offset;
      const uint64_t end = offset + length;
      for (const auto& [h, hl] : held) {
        if (h + hl <= at || h >= end) continue;
        if (h > at) go.emplace_back(at, h - at);
        const uint64_t b = std::max(h, at), e = std::min(h + hl, end);
        stay[b] = e - b;
        at = e;
      }
      if (end > at) go.emplace_back(at, end - at);
    }
    unclaimed_.swap(stay);
  }
  for (const auto& [offset, length] : go) Punch(offset, length);
  absl::MutexLock lock(&mu_);
  for (const auto& [offset, length] : go) FreeLocked(offset, length);
}

uint64_t PoolFile::claimed_bytes() const {
  absl::MutexLock lock(&mu_);
  return claimed_bytes_;
}

bool PoolFile::IsFile(const std::string& path) const {
  return SameFile(path, absl::StrCat("/proc/self/fd/", fd_.get()));
}

absl::StatusOr<PoolFile::Extent> PoolFile::Take(uint64_t bytes, uint64_t align) {
  const uint64_t length = RoundUp(std::max<uint64_t>(bytes, 1), align);
  uint64_t start = 0;
  {
    absl::MutexLock lock(&mu_);
    bool found = false;
    // Best fit among what was given back, at an aligned start.
    for (auto it = by_length_.lower_bound(length); it != by_length_.end(); ++it) {
      const uint64_t begin = it->second, end = begin + it->first;
      start = RoundUp(begin, align);
      if (start + length > end) continue;
      by_length_.erase(it);
      free_.erase(begin);
      if (start > begin) FreeLocked(begin, start - begin);
      if (end > start + length) FreeLocked(start + length, end - start - length);
      found = true;
      break;
    }
    if (!found) {
      start = RoundUp(top_, align);
      if (start + length > region_ || start + length < start) {
        return absl::ResourceExhaustedError(absl::StrCat("the pool's file in ", dir_,
                                                         " has no room for ", bytes,
                                                         " bytes more (", taken_, " taken)"));
      }
      if (start > top_) FreeLocked(top_, start - top_);
      top_ = start + length;
    }
    taken_ += length;
  }
  // Its pages now: a full tmpfs says ENOSPC here, not SIGBUS at a touch.
  if (fallocate(fd_.get(), 0, static_cast<off_t>(start), static_cast<off_t>(length)) != 0) {
    const int err = errno;
    Punch(start, length);  // what it did allocate
    absl::MutexLock lock(&mu_);
    taken_ -= length;
    FreeLocked(start, length);
    return absl::ResourceExhaustedError(
        absl::StrCat("the pool's file in ", dir_, " cannot have ", length,
                     " bytes more: ", PosixError("fallocate", err).message()));
  }
  return Extent{data_ + start, start, length};
}

void PoolFile::FreeLocked(uint64_t offset, uint64_t length) {
  // Merged with its neighbours.
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + length == next->first) {
    length += next->second;
    auto range = by_length_.equal_range(next->second);
    for (auto it = range.first; it != range.second; ++it) {
      if (it->second == next->first) {
        by_length_.erase(it);
        break;
      }
    }
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      auto range = by_length_.equal_range(prev->second);
      for (auto it = range.first; it != range.second; ++it) {
        if (it->second == prev->first) {
          by_length_.erase(it);
          break;
        }
      }
      offset = prev->first;
      length += prev->second;
      free_.erase(prev);
    }
  }
  free_[offset] = length;
  by_length_.emplace(length, offset);
}

bool PoolFile::Give(const Extent& extent) {
  {
    absl::MutexLock lock(&mu_);
    taken_ -= extent.length;
    // A kept checkpoint names it: it stays as it is until the process ends.
    if (retained_.contains(extent.offset)) return true;
    // Claimed by a session whose reopening failed: kept for a later one.
    if (claimed_.erase(extent.offset) != 0) {
      unclaimed_[extent.offset] = extent.length;
      return false;
    }
  }
  // Outside the lock (freeing pages takes a while); the extent is the
  // caller's alone until listed free.
  Punch(extent.offset, extent.length);
  absl::MutexLock lock(&mu_);
  FreeLocked(extent.offset, extent.length);
  return false;
}

std::optional<uint64_t> PoolFile::OffsetOf(const void* p, uint64_t bytes) const {
  const auto* b = static_cast<const std::byte*>(p);
  if (b < data_ || bytes > region_ || static_cast<uint64_t>(b - data_) > region_ - bytes) {
    return std::nullopt;
  }
  return static_cast<uint64_t>(b - data_);
}

absl::Status PoolFile::Link(const std::string& path) {
  absl::MutexLock lock(&mu_);
  // Through /proc: an unnamed (O_TMPFILE) file may be named that way
  // without CAP_DAC_READ_SEARCH, and a taken-over one has a name of its own.
  const std::string from = absl::StrCat("/proc/self/fd/", fd_.get());
  if (linkat(AT_FDCWD, from.c_str(), AT_FDCWD, path.c_str(), AT_SYMLINK_FOLLOW) != 0) {
    return PosixError(absl::StrCat("naming the pool's file ", path), errno);
  }
  linked_ = true;
  return absl::OkStatus();
}

bool PoolFile::linked() const {
  absl::MutexLock lock(&mu_);
  return linked_;
}

void PoolFile::Retain(uint64_t offset, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  uint64_t& length = retained_[offset];
  length = std::max(length, RoundUpToPage(bytes));
}

uint64_t PoolFile::taken_bytes() const {
  absl::MutexLock lock(&mu_);
  return taken_;
}

uint64_t PoolFile::resident_bytes() const {
  struct stat st;
  if (fstat(fd_.get(), &st) != 0) return 0;
  return static_cast<uint64_t>(st.st_blocks) * 512;
}

}  // namespace offload
