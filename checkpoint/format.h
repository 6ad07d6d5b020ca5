// The files of a session checkpoint, and how they are written so that a
// crash at any point leaves the previous checkpoint valid.
//
// A checkpoint directory holds, per session written into it (its "stem",
// a file-name-safe form of the session's name):
//   <stem>.manifest        what the checkpoint holds (proto/checkpoint.proto),
//                          framed: "OFLDCKP1", payload length (u64 LE),
//                          payload XXH3-64 (u64 LE), payload
//   <stem>.<gen>.data      the records' bytes, each with its own XXH3-64 in
//                          the manifest
// Writing one checkpoint, in order:
//   1. a new data file <stem>.<gen>.data (gen above every existing one,
//      created exclusively), its records written, then fsync;
//   2. the manifest written to <stem>.manifest.tmp, fsync;
//   3. rename over <stem>.manifest, fsync of the directory: the commit point;
//   4. the data files of <stem> the manifest no longer names are removed.
// A crash before 3 leaves the old manifest, naming the old data file, which
// nothing has touched; leftovers of the crashed attempt go at the next
// checkpoint of the stem (4).
//
// Keeping the previous generation (a job's checkpoints, automatic or its
// own: its ranks may be a checkpoint apart when offloadd dies, or a disk
// fills, between their commits), 3
// links the old manifest aside before its rename and, after it, renames
// that link over <stem>.previous; 4 keeps the data file <stem>.previous
// names. A crash at any point leaves a valid <stem>.manifest and, after the
// first checkpoint kept so, a valid <stem>.previous naming an older one (a
// crash between the two renames: the one before the replaced one).
//
// Reading verifies the frame, the payload's hash and each record's hash:
// DATA_LOSS names the file, the offset and what did not match.
//
// A directory is opened once (Directory), checked on what was opened, and
// its files are then reached through that descriptor only.
//
// Data files are written and read around the page cache (O_DIRECT) where
// the file system allows it and a transfer's memory and offset are aligned
// to kDirectAlignment: the whole aligned blocks of a record directly, its
// last partial block through the page cache (a record's blocks never
// overlap another's unless records share a block, and then those bytes go
// through the page cache on both sides). A writer that starts records on
// aligned offsets (the daemon's, on 4 KiB or the page size if larger) gets
// nearly all of a checkpoint direct: buffered writeback ran at a third of
// the disk's speed (benches/checkpoint). A direct transfer that fails is
// done again through the page cache, where a lasting error shows with its
// context; the first such fallback of a file is logged with its errno.
//
// Thread-safety: DataFileWriter::Write may be called from several threads
// at once (disjoint ranges); everything else is a plain function or
// single-threaded object.
#ifndef OFFLOADD_CHECKPOINT_FORMAT_H_
#define OFFLOADD_CHECKPOINT_FORMAT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/unique_fd.h"
#include "proto/checkpoint.pb.h"

namespace offload::checkpoint {

using Manifest = ::offload::checkpoint::v1::Manifest;
using PartitionRecord = ::offload::checkpoint::v1::Partition;
using Record = ::offload::checkpoint::v1::Record;
using RecordKind = ::offload::checkpoint::v1::RecordKind;

inline constexpr uint32_t kFormatVersion = 1;
// What O_DIRECT transfers of data files are aligned to (memory, offset,
// length): the largest logical block size of common disks.
inline constexpr uint64_t kDirectAlignment = 4096;

// A stem for session `name`: its letters, digits, '-', '_' and '.' kept,
// every other byte (a '/' of "job/rank0" included) made '_', at most 48
// bytes; where that changed the name, '-' and 16 hex digits of its hash
// follow ("torch/rank0": torch_rank0-<hash>); "session-<hash>" for an
// empty name.
std::string StemFor(absl::string_view session_name);

// PERMISSION_DENIED unless `dir` belongs to this user (or root) and no one
// else may write it: another user could plant or swap checkpoint files.
absl::Status CheckOwnDirectory(const std::string& dir);

// A checkpoint directory, open. CheckOwnDirectory's rules are checked on
// the directory that was opened, and every file of its checkpoints is then
// created, read, linked, renamed and removed relative to it: the path
// replaced by a link after the check (by anyone who may write one of its
// parents) changes nothing. Copies share one descriptor.
class Directory {
 public:
  // The existing directory at `path` (links in it followed).
  // INVALID_ARGUMENT if it is not a directory, PERMISSION_DENIED if it
  // fails the check.
  static absl::StatusOr<Directory> Open(const std::string& path);
  // Open, creating it (mode 0700, parents too) if missing.
  // INVALID_ARGUMENT for a relative path.
  static absl::StatusOr<Directory> Prepare(const std::string& path);

  // The path it was opened by, and `name` in it: for messages.
  const std::string& path() const { return path_; }
  std::string PathOf(absl::string_view name) const;
  int fd() const { return fd_->get(); }
  // Where the directory lies now, as the kernel resolves it (not the path
  // it was opened by, which may have been replaced since).
  absl::StatusOr<std::string> Location() const;
  // The names in it, sorted, without "." and "..".
  std::vector<std::string> List() const;
  // fsync of the directory: entries created, renamed or removed in it are
  // durable once this returns.
  absl::Status Sync() const;

 private:
  Directory(std::string path, std::shared_ptr<const UniqueFd> fd)
      : path_(std::move(path)), fd_(std::move(fd)) {}
  std::string path_;
  std::shared_ptr<const UniqueFd> fd_;
};
// DATA_LOSS for a record no checkpoint writes (larger than 1 GiB, or past
// 2^50 bytes): checked before anything is allocated for it.
absl::Status CheckRecord(const Record& record, const std::string& path);

// What a data file's direct transfers did (shared by moves of its owner).
struct DirectStats {
  std::atomic<uint64_t> bytes{0};
  std::atomic<bool> fell_back{false};  // the first fallback is logged
};

class DataFileWriter {
 public:
  // Creates <dir>/<stem>.<gen>.data, gen above every data file of the stem.
  static absl::StatusOr<DataFileWriter> Create(const Directory& dir, const std::string& stem);

  DataFileWriter(DataFileWriter&&) = default;
  DataFileWriter& operator=(DataFileWriter&&) = default;

  // Writes `bytes` at `offset` (short writes resumed), directly where
  // aligned (see above).
  absl::Status Write(uint64_t offset, absl::Span<const std::byte> bytes) const;
  // Allocates the file's first `bytes` (fallocate), so that a file system
  // without the room says so before anything is written
  // (RESOURCE_EXHAUSTED, ENOSPC). OK without doing anything where fallocate
  // is not supported.
  absl::Status Reserve(uint64_t bytes) const;
  // Whether the file system took O_DIRECT for this file, and how many
  // bytes went that way.
  bool direct() const { return direct_fd_.get() >= 0; }
  uint64_t direct_bytes() const { return direct_stats_->bytes.load(); }
  // fsync.
  absl::Status Sync() const;
  // Removes the file from its directory (a checkpoint that failed).
  void Remove() const;
  // The file's name in the directory, and its path (for messages).
  const std::string& name() const { return name_; }
  const std::string& path() const { return path_; }

 private:
  DataFileWriter(Directory dir, UniqueFd fd, UniqueFd direct_fd, std::string name)
      : dir_(std::move(dir)),
        fd_(std::move(fd)),
        direct_fd_(std::move(direct_fd)),
        name_(std::move(name)),
        path_(dir_.PathOf(name_)) {}
  Directory dir_;
  UniqueFd fd_;
  UniqueFd direct_fd_;  // the same file opened O_DIRECT; -1 where unsupported
  std::string name_, path_;
  std::shared_ptr<DirectStats> direct_stats_ = std::make_shared<DirectStats>();
};

// Steps 2-4 above: commits `manifest` (which names its data file) as the
// checkpoint of `stem` in `dir`; with `keep_previous`, the checkpoint it
// replaces stays as <stem>.previous. Commits into one directory take turns
// (flock of the directory), in this process and across processes.
absl::Status CommitManifest(const Directory& dir, const std::string& stem, const Manifest& manifest,
                            bool keep_previous = false);

// One manifest, verified (DATA_LOSS for a torn or corrupted one,
// NOT_FOUND if it does not exist): at `path`, or `name` in `dir`.
absl::StatusOr<Manifest> ReadManifest(const std::string& path);
absl::StatusOr<Manifest> ReadManifest(const Directory& dir, const std::string& name);
// Every <stem>.manifest in `dir`, with its path, by name. NOT_FOUND if
// there is none. With `steps`, each stem's checkpoint taken after that many
// steps: its manifest's, else its kept previous one's (NOT_FOUND naming the
// stem and the steps it has if neither). The path form opens the directory
// first (Directory::Open).
absl::StatusOr<std::vector<std::pair<std::string, Manifest>>> ReadManifests(
    const Directory& dir, std::optional<uint64_t> steps = std::nullopt);
absl::StatusOr<std::vector<std::pair<std::string, Manifest>>> ReadManifests(
    const std::string& dir, std::optional<uint64_t> steps = std::nullopt);
// The steps of the checkpoints of `stem` in `dir`: its manifest's first,
// then its kept previous one's, if any (unreadable ones left out; none
// where the directory fails Directory::Open).
std::vector<uint64_t> CheckpointSteps(const Directory& dir, const std::string& stem);
std::vector<uint64_t> CheckpointSteps(const std::string& dir, const std::string& stem);

class DataFileReader {
 public:
  // The data file `name` in `dir`. With `memory_path` (a manifest's
  // memory_file), records with a memory_offset are read from that file: it
  // must belong to this user (or root) and be writable by no one else
  // (PERMISSION_DENIED).
  static absl::StatusOr<DataFileReader> Open(const Directory& dir, const std::string& name,
                                             const std::string& memory_path = "");
  DataFileReader(DataFileReader&&) = default;
  DataFileReader& operator=(DataFileReader&&) = default;

  // The record's bytes into `dst` (record.bytes() of them), verified;
  // directly where aligned (see above).
  absl::Status Read(const Record& record, void* dst) const;
  const std::string& path() const { return path_; }

 private:
  DataFileReader(UniqueFd fd, UniqueFd direct_fd, std::string path)
      : fd_(std::move(fd)), direct_fd_(std::move(direct_fd)), path_(std::move(path)) {}
  UniqueFd fd_;
  UniqueFd direct_fd_;  // -1 where the file system has no O_DIRECT
  std::string path_;
  UniqueFd memory_fd_;  // -1 without a memory file
  std::string memory_path_;
  std::shared_ptr<DirectStats> direct_stats_ = std::make_shared<DirectStats>();
};

uint64_t Hash(const void* data, size_t bytes);

}  // namespace offload::checkpoint

#endif  // OFFLOADD_CHECKPOINT_FORMAT_H_
