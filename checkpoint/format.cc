#include "checkpoint/format.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <optional>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "base/checksum.h"
#include "base/directory.h"
#include "base/file_io.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"

namespace offload::checkpoint {
namespace {

constexpr char kMagic[8] = {'O', 'F', 'L', 'D', 'C', 'K', 'P', '1'};
constexpr size_t kHeaderBytes = 24;  // magic, length, hash
constexpr uint64_t kMaxManifestBytes = uint64_t{1} << 28;
// The largest record (one block kind of one chunk) a manifest may name:
// far above the daemon's chunks (placement.state_chunk_bytes), far below
// what would exhaust memory when read.
constexpr uint64_t kMaxRecordBytes = uint64_t{1} << 30;

absl::Status WriteAll(int fd, const void* data, size_t bytes, uint64_t offset,
                      const std::string& path) {
  if (const int e = PwriteAll(fd, data, bytes, offset); e != 0) {
    return PosixError(absl::StrCat("writing ", bytes, " bytes to ", path, " at offset ", offset),
                      e);
  }
  return absl::OkStatus();
}

absl::Status ReadAll(int fd, void* data, size_t bytes, uint64_t offset, const std::string& path) {
  size_t missing = 0;
  const int e = PreadAll(fd, data, bytes, offset, &missing);
  if (e == -1) {
    return absl::DataLossError(absl::StrCat(path, " ends at offset ", offset + bytes - missing,
                                            ", ", missing, " bytes short: the file is truncated"));
  }
  if (e != 0) {
    return PosixError(absl::StrCat("reading ", bytes, " bytes of ", path, " at offset ", offset),
                      e);
  }
  return absl::OkStatus();
}

// The file open as `fd` opened again with O_DIRECT (and `flags`): the same
// file, whatever its name means by now; -1 where the file system has no
// O_DIRECT.
UniqueFd OpenDirect(int fd, int flags) {
  return UniqueFd(open(absl::StrCat("/proc/self/fd/", fd).c_str(), flags | O_DIRECT | O_CLOEXEC));
}

// Moves the leading bytes of a transfer of `bytes` at `data` and `offset`
// that O_DIRECT can take (its whole blocks, where memory and offset are
// aligned) through `direct_fd` with `transfer(direct_fd, n)` (0 or an
// errno); returns how many it moved. 0 where none could go direct, or the
// transfer failed (a file's first failure is logged with its errno): the
// caller then moves every byte through the page cache, where a lasting
// error (EINVAL: the device's blocks are larger than kDirectAlignment;
// ENOSPC, EIO, a truncated file) shows again with its context.
template <typename Transfer>
uint64_t TransferDirect(int direct_fd, DirectStats* stats, const std::string& path, const char* op,
                        const void* data, uint64_t bytes, uint64_t offset, Transfer transfer) {
  if (direct_fd < 0 || reinterpret_cast<uintptr_t>(data) % kDirectAlignment != 0 ||
      offset % kDirectAlignment != 0) {
    return 0;
  }
  const uint64_t direct = bytes / kDirectAlignment * kDirectAlignment;
  if (direct == 0) return 0;
  if (const int error = transfer(direct_fd, direct); error != 0) {
    if (!stats->fell_back.exchange(true)) {
      LogWarning("checkpoint: a direct %s of %s failed (%s); through the page cache instead", op,
                 path, error > 0 ? std::strerror(error) : "end of file");
    }
    return 0;
  }
  stats->bytes += direct;
  return direct;
}

// The generation of `name` if it is a data file of `stem`.
std::optional<uint64_t> DataGeneration(absl::string_view name, absl::string_view stem) {
  if (!absl::ConsumePrefix(&name, stem) || !absl::ConsumePrefix(&name, ".") ||
      !absl::ConsumeSuffix(&name, ".data")) {
    return std::nullopt;
  }
  uint64_t gen;
  if (!absl::SimpleAtoi(name, &gen)) return std::nullopt;
  return gen;
}

}  // namespace

uint64_t Hash(const void* data, size_t bytes) { return Checksum64(data, bytes); }

namespace {

// The first `bytes` of `name` with every byte but letters, digits, '-',
// '_' and '.' made '_'; "session" in front of an empty or hidden one.
std::string Sanitized(absl::string_view name, size_t bytes) {
  std::string stem;
  for (char c : name.substr(0, bytes)) {
    const bool keep = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                      c == '-' || c == '_' || c == '.';
    stem.push_back(keep ? c : '_');
  }
  if (stem.empty() || stem[0] == '.') stem.insert(0, "session");
  return stem;
}

// The stem before names that change got a hash.
std::string LegacyStem(absl::string_view session_name) { return Sanitized(session_name, 64); }

}  // namespace

std::string StemFor(absl::string_view session_name) {
  std::string stem = Sanitized(session_name, 48);
  // Names that did not survive as they are ("job/rank0", long ones) get a
  // hash of the whole name, so that two sessions never share a stem.
  if (stem != session_name) {
    absl::StrAppend(&stem, "-",
                    absl::Hex(Hash(session_name.data(), session_name.size()), absl::kZeroPad16));
  }
  return stem;
}

namespace {

// CheckOwnDirectory's rules, on what `st` describes.
absl::Status CheckOwn(const struct stat& st, const std::string& dir) {
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a directory"));
  }
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "checkpoint directory ", dir, " belongs to uid ", st.st_uid, ", not to this user (uid ",
        geteuid(), "): another user could plant or replace checkpoint files there"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("checkpoint directory ", dir,
                     " is writable by other users: they could plant or replace "
                     "checkpoint files there; chmod go-w it or choose another"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status CheckOwnDirectory(const std::string& dir) {
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("stat of ", dir), errno);
  return CheckOwn(st, dir);
}

absl::StatusOr<Directory> Directory::Open(const std::string& path) {
  auto fd = std::make_shared<UniqueFd>(open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd->get() < 0 && errno == ENOTDIR) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a directory"));
  }
  if (fd->get() < 0) return PosixError(absl::StrCat("opening ", path), errno);
  struct stat st;
  if (fstat(fd->get(), &st) != 0) return PosixError(absl::StrCat("stat of ", path), errno);
  RETURN_IF_ERROR(CheckOwn(st, path));
  return Directory(path, std::move(fd));
}

absl::StatusOr<Directory> Directory::Prepare(const std::string& path) {
  if (path.empty() || path[0] != '/') {
    return absl::InvalidArgumentError(
        absl::StrCat("checkpoint directory must be an absolute path, got '", path, "'"));
  }
  // Each missing parent, then the directory itself; each one made durable
  // in its parent (its entry could vanish in a crash otherwise, and the
  // checkpoints in it with it).
  size_t parent_end = 0;  // where the last prefix's parent ends ("/": 1)
  for (size_t slash = 1; slash <= path.size(); ++slash) {
    if (slash != path.size() && path[slash] != '/') continue;
    const std::string prefix = path.substr(0, slash);
    if (mkdir(prefix.c_str(), 0700) == 0) {
      RETURN_IF_ERROR(SyncDirectory(path.substr(0, std::max<size_t>(parent_end, 1))));
    } else if (errno != EEXIST) {
      return PosixError(absl::StrCat("creating checkpoint directory ", prefix), errno);
    }
    parent_end = slash;
  }
  return Open(path);
}

std::string Directory::PathOf(absl::string_view name) const {
  return absl::StrCat(path_, "/", name);
}

absl::StatusOr<std::string> Directory::Location() const {
  const std::string link = absl::StrCat("/proc/self/fd/", fd());
  char buf[PATH_MAX + 1];
  const ssize_t n = readlink(link.c_str(), buf, PATH_MAX);
  if (n < 0) return PosixError(absl::StrCat("where ", path_, " lies now (", link, ")"), errno);
  return std::string(buf, static_cast<size_t>(n));
}

std::vector<std::string> Directory::List() const { return ListDirectory(fd()); }

absl::Status Directory::Sync() const {
  if (fsync(fd()) != 0) return PosixError(absl::StrCat("fsync of directory ", path_), errno);
  return absl::OkStatus();
}

absl::StatusOr<DataFileWriter> DataFileWriter::Create(const Directory& dir,
                                                      const std::string& stem) {
  uint64_t gen = 0;
  for (const std::string& name : dir.List()) {
    if (auto g = DataGeneration(name, stem)) gen = std::max(gen, *g + 1);
  }
  for (;; ++gen) {  // another writer of the same stem may race us: O_EXCL decides
    std::string name = absl::StrCat(stem, ".", gen, ".data");
    UniqueFd fd(
        openat(dir.fd(), name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (fd.get() >= 0) {
      UniqueFd direct = OpenDirect(fd.get(), O_WRONLY);
      return DataFileWriter(dir, std::move(fd), std::move(direct), std::move(name));
    }
    if (errno != EEXIST) return PosixError(absl::StrCat("creating ", dir.PathOf(name)), errno);
  }
}

absl::Status DataFileWriter::Write(uint64_t offset, absl::Span<const std::byte> bytes) const {
  const uint64_t direct = TransferDirect(
      direct_fd_.get(), direct_stats_.get(), path_, "write", bytes.data(), bytes.size(), offset,
      [&](int fd, uint64_t n) { return PwriteAll(fd, bytes.data(), n, offset); });
  return WriteAll(fd_.get(), bytes.data() + direct, bytes.size() - direct, offset + direct, path_);
}

absl::Status DataFileWriter::Reserve(uint64_t bytes) const {
  if (bytes == 0 || fallocate(fd_.get(), 0, 0, static_cast<off_t>(bytes)) == 0) {
    return absl::OkStatus();
  }
  if (errno == EOPNOTSUPP || errno == ENOSYS) return absl::OkStatus();
  return PosixError(absl::StrCat("reserving ", bytes, " bytes for ", path_), errno);
}

absl::Status DataFileWriter::Sync() const {
  if (fsync(fd_.get()) != 0) return PosixError(absl::StrCat("fsync of ", path_), errno);
  return absl::OkStatus();
}

void DataFileWriter::Remove() const { unlinkat(dir_.fd(), name_.c_str(), 0); }

namespace {

absl::Mutex& CommitMutex() {
  static absl::Mutex* const mu = new absl::Mutex;  // never destroyed
  return *mu;
}

}  // namespace

absl::Status CommitManifest(const Directory& dir, const std::string& stem, const Manifest& manifest,
                            bool keep_previous) {
  std::string payload;
  if (!manifest.SerializeToString(&payload)) {
    return absl::InternalError("serialising a checkpoint manifest failed");
  }
  char header[kHeaderBytes];
  std::memcpy(header, kMagic, 8);
  const uint64_t length = payload.size(), hash = Hash(payload.data(), payload.size());
  std::memcpy(header + 8, &length, 8);  // x86-64 and aarch64 Linux: little-endian
  std::memcpy(header + 16, &hash, 8);
  const int dfd = dir.fd();
  const std::string final_name = absl::StrCat(stem, ".manifest");
  const std::string previous_name = absl::StrCat(stem, ".previous");
  // One temporary name per data file: two writers of a stem never share it.
  const std::string tmp_name = absl::StrCat(final_name, ".", manifest.data_file(), ".tmp");
  const std::string final_path = dir.PathOf(final_name);
  const std::string previous_path = dir.PathOf(previous_name);
  const std::string tmp_path = dir.PathOf(tmp_name);
  // The data file's directory entry is durable before the manifest naming it.
  RETURN_IF_ERROR(dir.Sync());
  // One commit at a time in a directory (writers of one stem: sessions of
  // one name, or unnamed ones): between another's check for a newer
  // manifest and its rename, this one could commit, and its cleanup then
  // remove the data file that other's manifest names. This process's
  // commits take turns under one mutex; other processes' through a flock
  // of the directory (a descriptor of its own: flock excludes open files),
  // where the file system has it (NFS and Lustre may not: then this
  // process's alone, said once).
  absl::MutexLock one_at_a_time(&CommitMutex());
  UniqueFd lock_fd(openat(dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (lock_fd.get() < 0) return PosixError(absl::StrCat("opening ", dir.path()), errno);
  if (flock(lock_fd.get(), LOCK_EX) != 0) {
    const int err = errno;
    if (err != EBADF && err != ENOLCK && err != ENOSYS && err != EOPNOTSUPP && err != EINVAL) {
      return PosixError(absl::StrCat("locking ", dir.path(), " for a commit"), err);
    }
    static std::atomic<bool> said{false};
    if (!said.exchange(true)) {
      LogWarning(
          "checkpoint: %s cannot be locked (%s): commits of other processes into it are "
          "not kept apart (this offloadd's are)",
          dir.path(), std::strerror(err));
    }
  }
  const std::optional<uint64_t> mine = DataGeneration(manifest.data_file(), stem);
  absl::Status written = [&]() -> absl::Status {
    UniqueFd fd(
        openat(dfd, tmp_name.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (fd.get() < 0) return PosixError(absl::StrCat("creating ", tmp_path), errno);
    RETURN_IF_ERROR(WriteAll(fd.get(), header, kHeaderBytes, 0, tmp_path));
    RETURN_IF_ERROR(WriteAll(fd.get(), payload.data(), payload.size(), kHeaderBytes, tmp_path));
    if (fsync(fd.get()) != 0) return PosixError(absl::StrCat("fsync of ", tmp_path), errno);
    // Another writer of this stem (a session of the same name) committed a
    // newer checkpoint meanwhile: this older one must not replace it.
    if (absl::StatusOr<Manifest> current = ReadManifest(dir, final_name); current.ok()) {
      const std::optional<uint64_t> theirs = DataGeneration(current->data_file(), stem);
      if (theirs.has_value() && mine.has_value() && *theirs > *mine) {
        return absl::AbortedError(
            absl::StrCat(final_path, " names a newer checkpoint (", current->data_file(),
                         ") of a session of the same name, committed meanwhile"));
      }
    }
    // The one replaced stays as <stem>.previous: linked aside first, and
    // renamed over the older one only once the new one is in, so that a
    // crash in between leaves the new manifest and the older previous one
    // (never two names of one checkpoint).
    std::string link_tmp;
    struct stat st;
    if (keep_previous && fstatat(dfd, final_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      link_tmp = absl::StrCat(previous_name, ".", manifest.data_file(), ".tmp");
      unlinkat(dfd, link_tmp.c_str(), 0);
      if (linkat(dfd, final_name.c_str(), dfd, link_tmp.c_str(), 0) != 0) {
        return PosixError(absl::StrCat("linking ", final_path, " to ", link_tmp), errno);
      }
    }
    if (renameat(dfd, tmp_name.c_str(), dfd, final_name.c_str()) != 0) {
      const int err = errno;
      if (!link_tmp.empty()) unlinkat(dfd, link_tmp.c_str(), 0);
      return PosixError(absl::StrCat("renaming ", tmp_path, " to ", final_path), err);
    }
    if (!link_tmp.empty() && renameat(dfd, link_tmp.c_str(), dfd, previous_name.c_str()) != 0) {
      // Committed; only the previous one is not kept.
      LogWarning(
          "checkpoint %s: the previous one is not kept: %s", final_path,
          PosixError(absl::StrCat("renaming ", link_tmp, " to ", previous_path), errno).ToString());
      unlinkat(dfd, link_tmp.c_str(), 0);
    }
    return absl::OkStatus();
  }();
  if (!written.ok()) {
    unlinkat(dfd, tmp_name.c_str(), 0);
    return written;
  }
  RETURN_IF_ERROR(dir.Sync());
  // Committed. The stem's older data files are garbage now (a newer one is
  // another writer's, still being filled), and so are temporary manifests
  // of older attempts that crashed; the previous checkpoint's data file
  // stays while <stem>.previous names it.
  std::optional<uint64_t> keep;
  if (absl::StatusOr<Manifest> previous = ReadManifest(dir, previous_name); previous.ok()) {
    keep = DataGeneration(previous->data_file(), stem);
  }
  const std::string tmp_prefix = absl::StrCat(stem, ".manifest.");
  for (const std::string& name : dir.List()) {
    absl::string_view n = name;
    std::optional<uint64_t> gen = DataGeneration(n, stem);
    if (!gen.has_value() && absl::ConsumePrefix(&n, tmp_prefix) &&
        absl::ConsumeSuffix(&n, ".tmp")) {
      gen = DataGeneration(n, stem);
    }
    if (!gen.has_value() && absl::StartsWith(name, absl::StrCat(stem, ".previous.")) &&
        absl::EndsWith(name, ".tmp")) {
      unlinkat(dfd, name.c_str(), 0);  // a link a crash left
      continue;
    }
    if (gen.has_value() && mine.has_value() && *gen < *mine && gen != keep) {
      unlinkat(dfd, name.c_str(), 0);
    }
  }
  // A checkpoint of this session written before stems carried a hash
  // (<name>.manifest with the name as it was) would hold its tensors twice.
  const std::string legacy = LegacyStem(manifest.session_name());
  if (legacy != stem) {
    const std::string legacy_manifest = absl::StrCat(legacy, ".manifest");
    if (absl::StatusOr<Manifest> old = ReadManifest(dir, legacy_manifest);
        old.ok() && old->session_name() == manifest.session_name()) {
      unlinkat(dfd, legacy_manifest.c_str(), 0);
      unlinkat(dfd, old->data_file().c_str(), 0);
    }
  }
  return absl::OkStatus();
}

namespace {

// The manifest open as `fd` (named `path` in messages), verified.
absl::StatusOr<Manifest> ReadManifestFrom(const UniqueFd& fd, const std::string& path) {
  if (fd.get() < 0) return PosixError(absl::StrCat("opening ", path), errno);
  char header[kHeaderBytes];
  RETURN_IF_ERROR(ReadAll(fd.get(), header, kHeaderBytes, 0, path));
  if (std::memcmp(header, kMagic, 8) != 0) {
    return absl::DataLossError(absl::StrCat(path, " is not an offloadd checkpoint manifest"));
  }
  uint64_t length, hash;
  std::memcpy(&length, header + 8, 8);
  std::memcpy(&hash, header + 16, 8);
  struct stat st;
  if (fstat(fd.get(), &st) != 0) return PosixError(absl::StrCat("stat of ", path), errno);
  // Checked before anything is allocated for it.
  if (length > kMaxManifestBytes || length > static_cast<uint64_t>(st.st_size) - kHeaderBytes) {
    return absl::DataLossError(
        absl::StrCat(path, " claims a ", length, "-byte manifest in ", st.st_size, " bytes"));
  }
  std::string payload(length, '\0');
  RETURN_IF_ERROR(ReadAll(fd.get(), payload.data(), length, kHeaderBytes, path));
  if (Hash(payload.data(), payload.size()) != hash) {
    return absl::DataLossError(absl::StrCat(path, ": the manifest's checksum does not match"));
  }
  Manifest manifest;
  if (!manifest.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat(path, ": the manifest does not parse"));
  }
  if (manifest.format_version() != kFormatVersion) {
    return absl::FailedPreconditionError(absl::StrCat(path, " has format version ",
                                                      manifest.format_version(),
                                                      "; this offloadd "
                                                      "reads version ",
                                                      kFormatVersion));
  }
  // Its data file is a name in the manifest's own directory, not a path: a
  // manifest naming "../x" would have offloadd read (or, committing over a
  // legacy manifest, remove) a file anywhere it may.
  const std::string& data = manifest.data_file();
  if (data == "." || data == ".." || data.find('/') != std::string::npos ||
      data.find('\0') != std::string::npos) {
    return absl::DataLossError(absl::StrCat(path, " names a data file outside its directory ('",
                                            absl::CHexEscape(data), "')"));
  }
  return manifest;
}

}  // namespace

absl::StatusOr<Manifest> ReadManifest(const std::string& path) {
  return ReadManifestFrom(UniqueFd(open(path.c_str(), O_RDONLY | O_CLOEXEC)), path);
}

absl::StatusOr<Manifest> ReadManifest(const Directory& dir, const std::string& name) {
  return ReadManifestFrom(UniqueFd(openat(dir.fd(), name.c_str(), O_RDONLY | O_CLOEXEC)),
                          dir.PathOf(name));
}

absl::StatusOr<std::vector<std::pair<std::string, Manifest>>> ReadManifests(
    const std::string& dir, std::optional<uint64_t> steps) {
  ASSIGN_OR_RETURN(Directory d, Directory::Open(dir));
  return ReadManifests(d, steps);
}

absl::StatusOr<std::vector<std::pair<std::string, Manifest>>> ReadManifests(
    const Directory& dir, std::optional<uint64_t> steps) {
  std::vector<std::pair<std::string, Manifest>> out;
  for (const std::string& name : dir.List()) {
    absl::string_view stem = name;
    if (!absl::ConsumeSuffix(&stem, ".manifest")) continue;
    absl::StatusOr<Manifest> latest = ReadManifest(dir, name);
    if (latest.ok() && (!steps.has_value() || latest->steps() == *steps)) {
      out.emplace_back(dir.PathOf(name), *std::move(latest));
      continue;
    }
    // Of another step than asked, or unreadable (a disk's corruption): the
    // stem's kept previous checkpoint, if it is the step asked for.
    const std::string previous_name = absl::StrCat(stem, ".previous");
    absl::StatusOr<Manifest> p = ReadManifest(dir, previous_name);
    if (p.ok() && steps.has_value() && p->steps() == *steps) {
      out.emplace_back(dir.PathOf(previous_name), *std::move(p));
      continue;
    }
    if (!latest.ok()) {
      if (!p.ok()) return latest.status();
      return absl::Status(
          latest.status().code(),
          absl::StrCat(latest.status().message(), "; the checkpoint kept before it (",
                       previous_name, ", of step ", p->steps(), ") is intact: restore_steps ",
                       p->steps(), " restores it"));
    }
    return absl::NotFoundError(
        absl::StrCat("no checkpoint of step ", *steps, " of '", latest->session_name(), "' in ",
                     dir.path(), " (it has step ", latest->steps(),
                     p.ok() ? absl::StrCat(" and step ", p->steps()) : std::string(), ")"));
  }
  if (out.empty()) {
    return absl::NotFoundError(absl::StrCat("no checkpoint (*.manifest) in ", dir.path()));
  }
  return out;
}

std::vector<uint64_t> CheckpointSteps(const Directory& dir, const std::string& stem) {
  std::vector<uint64_t> steps;
  for (const char* suffix : {".manifest", ".previous"}) {
    absl::StatusOr<Manifest> m = ReadManifest(dir, absl::StrCat(stem, suffix));
    if (m.ok()) steps.push_back(m->steps());
  }
  return steps;
}

std::vector<uint64_t> CheckpointSteps(const std::string& dir, const std::string& stem) {
  absl::StatusOr<Directory> d = Directory::Open(dir);
  return d.ok() ? CheckpointSteps(*d, stem) : std::vector<uint64_t>();
}

absl::StatusOr<DataFileReader> DataFileReader::Open(const Directory& dir, const std::string& name,
                                                    const std::string& memory_path) {
  const std::string path = dir.PathOf(name);
  UniqueFd fd(openat(dir.fd(), name.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError(absl::StrCat("opening checkpoint data ", path), errno);
  UniqueFd direct = OpenDirect(fd.get(), O_RDONLY);
  DataFileReader reader(std::move(fd), std::move(direct), path);
  if (!memory_path.empty()) {
    reader.memory_fd_.reset(open(memory_path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (!reader.memory_fd_.valid()) {
      return PosixError(absl::StrCat("opening the kept memory file ", memory_path, " (", path,
                                     "'s manifest names it)"),
                        errno);
    }
    struct stat st;
    if (fstat(reader.memory_fd_.get(), &st) != 0) {
      return PosixError(absl::StrCat("stat of ", memory_path), errno);
    }
    if (!PrivateToThisUser(st)) {
      return absl::PermissionDeniedError(absl::StrCat("the kept memory file ", memory_path,
                                                      " belongs to uid ", st.st_uid,
                                                      " or is writable by others: not read"));
    }
    reader.memory_path_ = memory_path;
  }
  return reader;
}

absl::Status CheckRecord(const Record& record, const std::string& path) {
  if (record.bytes() > kMaxRecordBytes || record.offset() > (uint64_t{1} << 50)) {
    return absl::DataLossError(absl::StrCat(path, ": a record of ", record.bytes(),
                                            " bytes at offset ", record.offset(),
                                            " (records hold at most ", kMaxRecordBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status DataFileReader::Read(const Record& record, void* dst) const {
  RETURN_IF_ERROR(CheckRecord(record, path_));
  auto* out = static_cast<std::byte*>(dst);
  if (record.has_memory_offset()) {
    if (!memory_fd_.valid()) {
      return absl::DataLossError(
          absl::StrCat(path_, ": a record kept in memory, and its manifest names no memory file"));
    }
    RETURN_IF_ERROR(
        ReadAll(memory_fd_.get(), out, record.bytes(), record.memory_offset(), memory_path_));
    if (Hash(dst, record.bytes()) != record.xxh3()) {
      return absl::DataLossError(absl::StrCat(memory_path_, ": the ", record.bytes(),
                                              " bytes at offset ", record.memory_offset(),
                                              " do not match their checksum"));
    }
    return absl::OkStatus();
  }
  const uint64_t direct = TransferDirect(direct_fd_.get(), direct_stats_.get(), path_, "read", dst,
                                         record.bytes(), record.offset(), [&](int fd, uint64_t n) {
                                           size_t missing = 0;
                                           return PreadAll(fd, out, n, record.offset(), &missing);
                                         });
  RETURN_IF_ERROR(
      ReadAll(fd_.get(), out + direct, record.bytes() - direct, record.offset() + direct, path_));
  if (Hash(dst, record.bytes()) != record.xxh3()) {
    return absl::DataLossError(absl::StrCat(path_, ": the ", record.bytes(), " bytes at offset ",
                                            record.offset(), " do not match their checksum"));
  }
  return absl::OkStatus();
}

}  // namespace offload::checkpoint
