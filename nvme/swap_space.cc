#include "nvme/swap_space.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/checksum.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

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
    // One directory named twice (another path to it): its file would be
    // locked against itself, "in use by another offloadd".
    struct stat st;
    if (fstat(file->io.fd.get(), &st) != 0)
      return PosixError(absl::StrCat("stat of ", path), errno);
    for (const auto& earlier : space->files_) {
      struct stat e;
      if (fstat(earlier->io.fd.get(), &e) == 0 && e.st_dev == st.st_dev && e.st_ino == st.st_ino) {
        return absl::InvalidArgumentError(absl::StrCat("nvme.dirs names one directory twice: ", dir,
                                                       " and the one of ", earlier->io.path));
      }
    }
    if (flock(file->io.fd.get(), LOCK_EX | LOCK_NB) != 0) {
      return errno == EWOULDBLOCK ? absl::FailedPreconditionError(
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
    // The space of a swap file a just-stopped offloadd unlinked at its exit
    // comes back to the filesystem some milliseconds later (7-35 ms were
    // seen): ENOSPC is the answer only once it persists for kSpaceWait.
    const absl::Time deadline = absl::Now() + kSpaceWait;
    int rc, err = 0;  // fallocate's (not a later call's)
    for (bool said = false;; said = true) {
      rc = fallocate(f->io.fd.get(), 0, 0, static_cast<off_t>(size));
      err = rc == 0 ? 0 : errno;
      if (rc == 0 || err != ENOSPC || absl::Now() >= deadline) break;
      if (!said) {
        LogInfo("%s: no room yet for %d bytes; waiting up to %s for space being freed", f->io.path,
                size, absl::FormatDuration(kSpaceWait));
      }
      if (ftruncate(f->io.fd.get(), 0) != 0) break;  // what it got goes back meanwhile
      absl::SleepFor(absl::Milliseconds(20));
    }
    if (rc != 0 && (err == EOPNOTSUPP || err == ENOSYS)) {
      LogWarning("%s: fallocate unsupported; space is not reserved in advance", f->io.path);
      rc = ftruncate(f->io.fd.get(), static_cast<off_t>(size));
      err = rc == 0 ? 0 : errno;
    }
    if (rc != 0) {
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
    // One hole for the file's share where there is one; else pieces of
    // whole stripes from the first holes (a stripe never spans two), the
    // share's tail in the last: a tier whose free bytes are scattered
    // still holds what was admitted to it.
    auto hole = f.holes.begin();
    while (hole != f.holes.end() && hole->second < share[j]) ++hole;
    if (hole != f.holes.end()) {
      TakeSegment(f, static_cast<int>(j), hole, share[j], &e);
      continue;
    }
    uint64_t need = share[j];
    for (auto h = f.holes.begin(); h != f.holes.end() && need > 0;) {
      const uint64_t take = h->second >= need ? need : h->second / stripe * stripe;
      auto next = std::next(h);
      if (take > 0) {
        const uint64_t at = h->first;
        TakeSegment(f, static_cast<int>(j), h, take, &e);
        next = f.holes.upper_bound(at);  // (the hole's rest, if any, stays before the next)
        need -= take;
      }
      h = next;
    }
    if (need > 0) {
      for (const Segment& seg : e.segments) ReturnSegment(seg);  // what it took so far
      std::vector<std::string> free;
      for (const auto& g : files_) free.push_back(absl::StrCat(g->io.path, ": ", g->free));
      return absl::ResourceExhaustedError(
          absl::StrCat("NVMe tier full: an extent of ", bytes, " bytes needs ", share[j],
                       " bytes in ", f.io.path, " (in whole stripes of ", stripe,
                       "); free bytes per file: ", absl::StrJoin(free, ", ")));
    }
  }
  return e;
}

void SwapSpace::TakeSegment(File& f, int file, std::map<uint64_t, uint64_t>::iterator hole,
                            uint64_t length, Extent* e) {
  const uint64_t offset = hole->first, size = hole->second;
  f.holes.erase(hole);
  if (size > length) f.holes[offset + length] = size - length;
  f.free -= length;
  e->segments.push_back({file, offset, length});
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
  // Each file's segments in order (one, or pieces of whole stripes), the
  // one the next stripe goes to, and how far into it.
  std::vector<std::vector<const Segment*>> segs(n);
  for (const Segment& s : e.segments) segs[static_cast<size_t>(s.file)].push_back(&s);
  std::vector<size_t> at(n, 0);
  std::vector<uint64_t> used(n, 0);
  std::vector<IoRequest> out;
  for (uint64_t off = 0, s = 0; off < total; off += stripe, ++s) {
    const size_t j = (e.first + s) % n;
    const uint64_t len = std::min(stripe, total - off);
    if (used[j] + len > segs[j][at[j]]->length) {  // this piece is full: the next
      ++at[j];
      used[j] = 0;
    }
    out.push_back({op, files_[j]->backend_id, segs[j][at[j]]->offset + used[j],
                   buffer == nullptr ? nullptr : buffer + off, len});
    used[j] += len;
  }
  return out;
}

size_t SwapSpace::StripeCount(const Extent& e) const {
  return static_cast<size_t>((RoundUp(e.bytes, alignment_) + stripe_bytes() - 1) / stripe_bytes());
}

uint64_t SwapSpace::StripeDataBytes(const Extent& e, size_t r) const {
  const uint64_t at = r * stripe_bytes();
  return at >= e.bytes ? 0 : std::min(stripe_bytes(), e.bytes - at);
}

absl::Status SwapSpace::Annotate(const absl::Status& s, const std::string& what) const {
  if (s.ok()) return s;
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.message()));
}

absl::Status SwapSpace::CheckBuffers(const Buffers& b, bool write) const {
  const char* what = write ? "swap-out" : "swap-in";
  if (b.whole != nullptr) {
    if (reinterpret_cast<uintptr_t>(b.whole) % alignment_ != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(what, " buffer must be aligned to ", alignment_, " bytes"));
    }
    return absl::OkStatus();
  }
  if (reinterpret_cast<uintptr_t>(b.staging.data()) % alignment_ != 0 ||
      b.staging.size() < stripe_bytes()) {
    return absl::InvalidArgumentError(absl::StrCat(what, " staging buffer of ", b.staging.size(),
                                                   " bytes must be aligned to ", alignment_,
                                                   " bytes and hold a stripe of ", stripe_bytes()));
  }
  return absl::OkStatus();
}

absl::Status SwapSpace::Transfer(
    const Extent& e, IoOp op, const Buffers& b,
    const std::function<void(size_t r, const std::byte* data)>& done,
    const std::function<absl::Status(size_t first, size_t end)>& verify) const {
  if (b.whole != nullptr) {
    const std::vector<IoRequest> requests = Plan(e, op, b.whole);
    RequestDone heard;
    if (done) {
      heard = [&](size_t r) { done(r, static_cast<const std::byte*>(requests[r].buffer)); };
    }
    RETURN_IF_ERROR(backend_->Run(requests, heard));
    return verify ? verify(0, requests.size()) : absl::OkStatus();
  }
  const uint64_t stripe = stripe_bytes();
  const size_t per_window = b.staging.size() / stripe;
  std::vector<IoRequest> requests = Plan(e, op, nullptr);  // buffers set per window
  for (size_t first = 0; first < requests.size(); first += per_window) {
    const size_t end = std::min(requests.size(), first + per_window);
    const uint64_t from = first * stripe;
    // The window's stripes land at the start of the staging buffer.
    absl::Span<IoRequest> window(&requests[first], end - first);
    uint64_t data = 0, padded = 0;
    for (size_t r = first; r < end; ++r) {
      requests[r].buffer = b.staging.data() + (r * stripe - from);
      data += StripeDataBytes(e, r);
      padded += requests[r].length;
    }
    if (op == IoOp::kWrite) {
      RETURN_IF_ERROR((*b.chunk)(from, b.staging.first(data)));
      // The alignment's padding after the last bytes: zeros, not whatever
      // the staging buffer held before.
      std::memset(b.staging.data() + data, 0, padded - data);
    }
    RequestDone heard;
    if (done) {
      heard = [&](size_t k) { done(first + k, static_cast<const std::byte*>(window[k].buffer)); };
    }
    RETURN_IF_ERROR(backend_->Run(window, heard));
    if (op == IoOp::kRead) {
      if (verify) RETURN_IF_ERROR(verify(first, end));
      RETURN_IF_ERROR((*b.chunk)(from, b.staging.first(data)));
    }
  }
  return absl::OkStatus();
}

absl::Status SwapSpace::CheckWrite(uint64_t bytes, const Buffers& b) const {
  if (bytes == 0) return absl::InvalidArgumentError("cannot swap out an empty extent");
  return CheckBuffers(b, /*write=*/true);
}

absl::StatusOr<SwapSpace::Extent> SwapSpace::WriteNew(uint64_t bytes, const Buffers& b) {
  RETURN_IF_ERROR(CheckWrite(bytes, b));
  ASSIGN_OR_RETURN(Extent e, Allocate(bytes));
  return FillNew(std::move(e), b);
}

absl::StatusOr<SwapSpace::Extent> SwapSpace::FillNew(Extent e, const Buffers& b) {
  absl::Status s = Fill(e, b);
  if (!s.ok()) {
    Release(e);  // nothing else refers to this space
    return Annotate(s, absl::StrCat("swapping out ", e.bytes, " bytes"));
  }
  return e;
}

absl::Status SwapSpace::Fill(Extent& e, const Buffers& b) {
  bool checksum;
  {
    absl::MutexLock lock(&mu_);
    checksum = checksum_;
  }
  std::function<void(size_t, const std::byte*)> hash;
  if (checksum) {
    e.has_checksum = true;
    e.checksums.assign(StripeCount(e), 0);
    // Each stripe once written (a buffer that changes meanwhile makes the
    // block's owner discard this copy: the swapper's version check).
    hash = [&](size_t r, const std::byte* data) {
      e.checksums[r] = Checksum64(data, StripeDataBytes(e, r));
    };
  }
  return Transfer(e, IoOp::kWrite, b, hash, nullptr);
}

uint64_t SwapSpace::Register(Extent e) {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  extents_[id] = std::move(e);
  return id;
}

absl::StatusOr<uint64_t> SwapSpace::Write(const void* src, uint64_t bytes) {
  ASSIGN_OR_RETURN(Extent e, WriteNew(bytes, Buffers::Whole(src)));
  return Register(std::move(e));
}

absl::StatusOr<uint64_t> SwapSpace::WriteStaged(uint64_t bytes, absl::Span<std::byte> staging,
                                                StagedChunk source) {
  ASSIGN_OR_RETURN(Extent e, WriteNew(bytes, Buffers::Staged(staging, source)));
  return Register(std::move(e));
}

absl::Status SwapSpace::Rewrite(uint64_t id, const void* src, uint64_t bytes) {
  return RewriteFrom(id, bytes, Buffers::Whole(src));
}

absl::Status SwapSpace::RewriteStaged(uint64_t id, uint64_t bytes, absl::Span<std::byte> staging,
                                      StagedChunk source) {
  return RewriteFrom(id, bytes, Buffers::Staged(staging, source));
}

absl::Status SwapSpace::RewriteFrom(uint64_t id, uint64_t bytes, const Buffers& b) {
  Extent current;
  {
    absl::MutexLock lock(&mu_);
    auto it = extents_.find(id);
    if (it == extents_.end()) return absl::NotFoundError(absl::StrCat("no extent ", id));
    current = it->second;
  }
  RETURN_IF_ERROR(CheckWrite(bytes, b));
  absl::StatusOr<Extent> allocated = Allocate(bytes);
  if (!allocated.ok() && RoundUp(bytes, alignment_) == RoundUp(current.bytes, alignment_)) {
    // No room for a second copy (a tier filled with state rewritten every
    // step): over the first one. Its caller keeps the bytes in memory
    // until this succeeds and reads the old copy no more.
    return RewriteInPlace(id, std::move(current), bytes, b);
  }
  ASSIGN_OR_RETURN(Extent e, std::move(allocated));
  ASSIGN_OR_RETURN(Extent fresh, FillNew(std::move(e), b));
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

absl::Status SwapSpace::RewriteInPlace(uint64_t id, Extent e, uint64_t bytes, const Buffers& b) {
  e.bytes = bytes;
  e.torn = false;
  const bool first = in_place_rewrites_.fetch_add(1, std::memory_order_relaxed) == 0;
  if (first) {
    LogWarning(
        "NVMe tier: no free space for a second copy of an extent of %d bytes; rewriting in "
        "place from now on where needed (a write that fails then loses the old copy, which "
        "the swapper no longer needs). Size the tier above what is placed there to avoid it",
        static_cast<int64_t>(bytes));
  }
  absl::Status s = Fill(e, b);
  absl::MutexLock lock(&mu_);
  auto it = extents_.find(id);
  if (it == extents_.end()) return s;  // freed meanwhile (its space with it)
  if (!s.ok()) {
    it->second.torn = true;  // partly overwritten: never read as it was
    return Annotate(s, absl::StrCat("rewriting extent ", id, " in place (", bytes, " bytes)"));
  }
  it->second = std::move(e);
  return absl::OkStatus();
}

absl::Status SwapSpace::Read(uint64_t id, void* dst) { return ReadInto(id, Buffers::Whole(dst)); }

absl::Status SwapSpace::ReadStaged(uint64_t id, absl::Span<std::byte> staging, StagedChunk sink) {
  return ReadInto(id, Buffers::Staged(staging, sink));
}

absl::Status SwapSpace::ReadInto(uint64_t id, const Buffers& b) {
  Extent e;
  {
    absl::MutexLock lock(&mu_);
    auto it = extents_.find(id);
    if (it == extents_.end()) return absl::NotFoundError(absl::StrCat("no extent ", id));
    e = it->second;
  }
  if (e.torn) {
    return absl::DataLossError(absl::StrCat("extent ", id,
                                            " was being rewritten in place (the NVMe tier had no "
                                            "room for a second copy) when that write failed"));
  }
  RETURN_IF_ERROR(CheckBuffers(b, /*write=*/false));
  std::vector<uint64_t> got;
  std::function<void(size_t, const std::byte*)> hash;
  std::function<absl::Status(size_t, size_t)> verify;
  if (e.has_checksum) {
    got.assign(e.checksums.size(), 0);
    hash = [&](size_t r, const std::byte* data) {
      got[r] = Checksum64(data, StripeDataBytes(e, r));
    };
    verify = [&](size_t first, size_t end) -> absl::Status {
      for (size_t r = first; r < end; ++r) {
        if (got[r] != e.checksums[r]) return Mismatch(e, r, got[r]);
      }
      return absl::OkStatus();
    };
  }
  return Annotate(Transfer(e, IoOp::kRead, b, hash, verify),
                  absl::StrCat("swapping in extent ", id, " (", e.bytes, " bytes)"));
}

absl::Status SwapSpace::Mismatch(const Extent& e, size_t r, uint64_t got) const {
  const IoRequest q = Plan(e, IoOp::kRead, nullptr)[r];
  return absl::DataLossError(
      absl::StrCat("checksum mismatch: stripe ", r, " (", q.length, " bytes at ",
                   files_[(e.first + r) % files_.size()]->io.path, " offset ", q.offset,
                   ") expected ", absl::Hex(e.checksums[r]), ", read ", absl::Hex(got)));
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

void SwapSpace::AddBuffer(void* base, uint64_t length) {
  // Registration failing (RLIMIT_MEMLOCK) only costs plain I/O, which the
  // backend logs.
  backend_->AddBuffer(base, length).IgnoreError();
}

void SwapSpace::RemoveBuffer(void* base, uint64_t length) { backend_->RemoveBuffer(base, length); }

SwapStats SwapSpace::Stats() const {
  absl::MutexLock lock(&mu_);
  SwapStats s;
  s.alignment = alignment_;
  s.extents = extents_.size();
  s.in_place_rewrites = in_place_rewrites_.load(std::memory_order_relaxed);
  for (const auto& f : files_) {
    s.dirs.push_back({f->io.path, f->io.direct, f->capacity, f->free});
    s.capacity += f->capacity;
    s.free += f->free;
  }
  return s;
}

}  // namespace offload
