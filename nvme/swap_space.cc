#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "xxhash.h"

namespace offload {

absl::StatusOr<std::unique_ptr<SwapSpace>> SwapSpace::Create(const NvmeOptions& options,
                                                              IoBackend* backend) {
  const std::vector<std::string> dirs = options.DirList();
  if (dirs.empty()) {
    return absl::InvalidArgumentError("the NVMe tier needs at least one directory");
  }
  std::unique_ptr<SwapSpace> space(new SwapSpace(options, backend));
  for (const std::string& dir : dirs) {
    auto file = std::make_unique<File>();
    const std::string path = absl::StrCat(dir, "/", kFileName);
    ASSIGN_OR_RETURN(file->io, OpenIoFile(path, /*create=*/true, options.direct_io));
    if (flock(file->io.fd.get(), LOCK_EX | LOCK_NB) != 0) {
      return errno == EWOULDBLOCK
                 ? absl::FailedPreconditionError(
                       absl::StrCat(path, " is in use by another offloadd"))
                 : PosixError(absl::StrCat("locking ", path), errno);
    }
    space->alignment_ = std::max(space->alignment_, file->io.alignment);
    space->files_.push_back(std::move(file));
  }
  const uint64_t align = space->alignment_;
  if (options.stripe_bytes <= 0 || static_cast<uint64_t>(options.stripe_bytes) % align != 0) {
    return absl::InvalidArgumentError(absl::StrCat("stripe_bytes ", options.stripe_bytes,
                                                   " must be a positive multiple of ", align));
  }
  const uint64_t size =
      options.bytes_per_dir > 0 ? static_cast<uint64_t>(options.bytes_per_dir) / align * align : 0;
  if (size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("bytes_per_dir ", options.bytes_per_dir, " is below one block of ", align));
  }
  for (auto& f : space->files_) {
    // Scratch contents: start from an empty file, then claim the space.
    if (ftruncate(f->io.fd.get(), 0) != 0) {
      return PosixError(absl::StrCat("truncating ", f->io.path), errno);
    }
    int rc = fallocate(f->io.fd.get(), 0, 0, static_cast<off_t>(size));
    if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) {
      LogWarning("%s: fallocate unsupported; space is not reserved in advance", f->io.path);
      rc = ftruncate(f->io.fd.get(), static_cast<off_t>(size));
    }
    if (rc != 0) {
      const int err = errno;
      unlink(f->io.path.c_str());
      return PosixError(absl::StrCat("preallocating ", size, " bytes for ", f->io.path), err);
    }
    f->capacity = f->free = size;
    f->holes[0] = size;
    ASSIGN_OR_RETURN(f->backend_id, backend->AddFile(f->io.fd.get(), f->io.path));
  }
  return space;
}

SwapSpace::~SwapSpace() {
  for (auto& f : files_) unlink(f->io.path.c_str());
}

void SwapSpace::SetChecksum(bool on) {
  absl::MutexLock lock(&mu_);
  checksum_ = on;
}

absl::StatusOr<SwapSpace::Extent> SwapSpace::Allocate(uint64_t bytes) {
  const uint64_t total = RoundUp(bytes, alignment_);
  const uint64_t stripe = static_cast<uint64_t>(options_.stripe_bytes);
  const size_t n = files_.size();
  absl::MutexLock lock(&mu_);
  Extent e;
  e.bytes = bytes;
  e.first = next_first_;
  next_first_ = (next_first_ + 1) % n;
  // Stripe s goes to file (first + s) % n; sum each file's share.
  std::vector<uint64_t> share(n, 0);
  for (uint64_t off = 0, s = 0; off < total; off += stripe, ++s) {
    share[(e.first + s) % n] += std::min(stripe, total - off);
  }
  for (size_t k = 0; k < n; ++k) {
    const size_t j = (e.first + k) % n;
    if (share[j] == 0) continue;
    File& f = *files_[j];
    auto hole = f.holes.begin();
    while (hole != f.holes.end() && hole->second < share[j]) ++hole;
    if (hole == f.holes.end()) {
      for (const Segment& seg : e.segments) ReturnSegment(seg);  // what it took so far
      std::vector<std::string> free;
      for (const auto& g : files_) free.push_back(absl::StrCat(g->io.path, ": ", g->free));
      return absl::ResourceExhaustedError(absl::StrCat(
          "NVMe tier full: an extent of ", bytes, " bytes needs ", share[j], " contiguous bytes in ",
          f.io.path, "; free bytes per file: ", absl::StrJoin(free, ", ")));
    }
    const uint64_t offset = hole->first, length = hole->second;
    f.holes.erase(hole);
    if (length > share[j]) f.holes[offset + share[j]] = length - share[j];
    f.free -= share[j];
    e.segments.push_back({static_cast<int>(j), offset, share[j]});
  }
  return e;
}

void SwapSpace::ReturnSegment(const Segment& seg) {
  File& f = *files_[static_cast<size_t>(seg.file)];
  auto it = f.holes.emplace(seg.offset, seg.length).first;
  f.free += seg.length;
  auto next = std::next(it);
  if (next != f.holes.end() && it->first + it->second == next->first) {
    it->second += next->second;
    f.holes.erase(next);
  }
  if (it != f.holes.begin()) {
    auto prev = std::prev(it);
    if (prev->first + prev->second == it->first) {
      prev->second += it->second;
      f.holes.erase(it);
    }
  }
}

void SwapSpace::Release(const Extent& e) {
  absl::MutexLock lock(&mu_);
  for (const Segment& seg : e.segments) ReturnSegment(seg);
}

std::vector<IoRequest> SwapSpace::Plan(const Extent& e, IoOp op, std::byte* buffer) const {
  const uint64_t total = RoundUp(e.bytes, alignment_);
  const uint64_t stripe = static_cast<uint64_t>(options_.stripe_bytes);
  const size_t n = files_.size();
  // Each file's segment, and how far into it the next stripe goes.
  std::vector<const Segment*> seg(n, nullptr);
  for (const Segment& s : e.segments) seg[static_cast<size_t>(s.file)] = &s;
  std::vector<uint64_t> used(n, 0);
  std::vector<IoRequest> out;
  for (uint64_t off = 0, s = 0; off < total; off += stripe, ++s) {
    const size_t j = (e.first + s) % n;
    const uint64_t len = std::min(stripe, total - off);
    out.push_back({op, files_[j]->backend_id, seg[j]->offset + used[j], buffer + off, len});
    used[j] += len;
  }
  return out;
}

uint64_t SwapSpace::StripeHash(const Extent& e, const std::vector<IoRequest>& plan, size_t r,
                               const std::byte* buffer) {
  const auto* begin = static_cast<const std::byte*>(plan[r].buffer);
  const uint64_t at = static_cast<uint64_t>(begin - buffer);
  const uint64_t bytes = at >= e.bytes ? 0 : std::min(plan[r].length, e.bytes - at);
  return XXH3_64bits(begin, bytes);
}

absl::Status SwapSpace::Annotate(const absl::Status& s, const std::string& what) const {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::StatusOr<SwapSpace::Extent> SwapSpace::WriteNew(const void* src, uint64_t bytes) {
  if (bytes == 0) return absl::InvalidArgumentError("cannot swap out an empty extent");
  if (reinterpret_cast<uintptr_t>(src) % alignment_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("swap-out buffer must be aligned to ", alignment_, " bytes"));
  }
  ASSIGN_OR_RETURN(Extent e, Allocate(bytes));
  bool checksum;
  {
    absl::MutexLock lock(&mu_);
    checksum = checksum_;
  }
  auto* data = static_cast<std::byte*>(const_cast<void*>(src));
  const std::vector<IoRequest> requests = Plan(e, IoOp::kWrite, data);
  RequestDone hash;
  if (checksum) {
    e.has_checksum = true;
    e.checksums.assign(requests.size(), 0);
    // Each stripe once written (a buffer that changes meanwhile makes the
    // block's owner discard this copy: the swapper's version check).
    hash = [&](size_t r) { e.checksums[r] = StripeHash(e, requests, r, data); };
  }
  absl::Status s = backend_->Run(requests, hash);
  if (!s.ok()) {
    Release(e);  // nothing else refers to this space
    return Annotate(s, absl::StrCat("swapping out ", bytes, " bytes"));
  }
  return e;
}

absl::StatusOr<uint64_t> SwapSpace::Write(const void* src, uint64_t bytes) {
  ASSIGN_OR_RETURN(Extent e, WriteNew(src, bytes));
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  extents_[id] = std::move(e);
  return id;
}

absl::Status SwapSpace::Rewrite(uint64_t id, const void* src, uint64_t bytes) {
  {
    absl::MutexLock lock(&mu_);
    if (!extents_.contains(id)) return absl::NotFoundError(absl::StrCat("no extent ", id));
  }
  ASSIGN_OR_RETURN(Extent fresh, WriteNew(src, bytes));
  Extent old;
  {
    absl::MutexLock lock(&mu_);
    auto it = extents_.find(id);
    if (it == extents_.end()) {  // freed meanwhile: keep nothing
      old = std::move(fresh);
    } else {
      old = std::exchange(it->second, std::move(fresh));
    }
  }
  Release(old);
  return absl::OkStatus();
}

absl::Status SwapSpace::Read(uint64_t id, void* dst) {
  Extent e;
  {
    absl::MutexLock lock(&mu_);
    auto it = extents_.find(id);
    if (it == extents_.end()) return absl::NotFoundError(absl::StrCat("no extent ", id));
    e = it->second;
  }
  if (reinterpret_cast<uintptr_t>(dst) % alignment_ != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("swap-in buffer must be aligned to ", alignment_, " bytes"));
  }
  auto* data = static_cast<std::byte*>(dst);
  const std::vector<IoRequest> requests = Plan(e, IoOp::kRead, data);
  std::vector<uint64_t> got;
  RequestDone hash;
  if (e.has_checksum) {
    got.assign(requests.size(), 0);
    hash = [&](size_t r) { got[r] = StripeHash(e, requests, r, data); };
  }
  RETURN_IF_ERROR(Annotate(backend_->Run(requests, hash),
                           absl::StrCat("swapping in extent ", id, " (", e.bytes, " bytes)")));
  for (size_t r = 0; r < got.size(); ++r) {
    if (got[r] == e.checksums[r]) continue;
    const IoRequest& q = requests[r];
    return absl::DataLossError(absl::StrCat(
        "checksum mismatch swapping in extent ", id, " (", e.bytes, " bytes): stripe ", r,
        " (", q.length, " bytes at ", files_[(e.first + r) % files_.size()]->io.path,
        " offset ", q.offset, ") expected ", absl::Hex(e.checksums[r]), ", read ",
        absl::Hex(got[r])));
  }
  return absl::OkStatus();
}

absl::Status SwapSpace::Free(uint64_t id) {
  Extent e;
  {
    absl::MutexLock lock(&mu_);
    auto it = extents_.find(id);
    if (it == extents_.end()) return absl::NotFoundError(absl::StrCat("no extent ", id));
    e = std::move(it->second);
    extents_.erase(it);
  }
  Release(e);
  return absl::OkStatus();
}

absl::StatusOr<uint64_t> SwapSpace::ExtentBytes(uint64_t id) const {
  absl::MutexLock lock(&mu_);
  auto it = extents_.find(id);
  if (it == extents_.end()) return absl::NotFoundError(absl::StrCat("no extent ", id));
  return it->second.bytes;
}

SwapStats SwapSpace::Stats() const {
  absl::MutexLock lock(&mu_);
  SwapStats s;
  s.alignment = alignment_;
  s.extents = extents_.size();
  for (const auto& f : files_) {
    s.dirs.push_back({f->io.path, f->io.direct, f->capacity, f->free});
    s.capacity += f->capacity;
    s.free += f->free;
  }
  return s;
}

}  // namespace offload
