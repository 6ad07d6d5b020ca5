#include "checkpoint/format.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "base/directory.h"
#include "base/unique_fd.h"
#include "checkpoint/export.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/tensor_index.h"
#include "cpu_adam/dtype.h"
#include "gtest/gtest.h"

namespace offload::checkpoint {
namespace {

using ::offload::checkpoint::v1::MASTER;
using ::offload::checkpoint::v1::PARAMS;

std::string TempDir() {
  std::string t =
      absl::StrCat(getenv("TEST_TMPDIR") ? getenv("TEST_TMPDIR") : "/tmp", "/ckpt_XXXXXX");
  return mkdtemp(t.data());
}

// `dir`, open (it exists and passes the ownership check).
Directory Opened(const std::string& dir) {
  absl::StatusOr<Directory> d = Directory::Open(dir);
  EXPECT_TRUE(d.ok()) << d.status();
  return *std::move(d);
}

// Writes one session's checkpoint: slice [offset, offset + values.size())
// of tensor "w" (shape 3x5), master = values, in records of `chunk`
// elements; `edit` changes its manifest before it is committed.
absl::Status WriteSession(const Directory& dir, const std::string& name, uint64_t offset,
                          const std::vector<float>& values, uint64_t chunk, uint64_t steps = 7,
                          bool keep_previous = false,
                          const std::function<void(Manifest*)>& edit = nullptr) {
  auto writer = DataFileWriter::Create(dir, StemFor(name));
  if (!writer.ok()) return writer.status();
  Manifest m;
  m.set_format_version(kFormatVersion);
  m.set_session_name(name);
  m.set_steps(steps);
  m.set_data_file(writer->name());
  PartitionRecord* p = m.add_partitions();
  p->set_name("w");
  p->set_tensor("w");
  p->add_shape(3);
  p->add_shape(5);
  p->set_offset(offset);
  p->set_numel(values.size());
  p->set_param_dtype(static_cast<uint32_t>(DType::kFp32));
  p->set_master_initialized(true);
  uint64_t at = 0;
  for (uint64_t b = 0; b < values.size(); b += chunk) {
    const uint64_t n = std::min<uint64_t>(chunk, values.size() - b);
    Record* r = p->add_records();
    r->set_kind(MASTER);
    r->set_begin(b);
    r->set_elems(n);
    r->set_offset(at);
    r->set_bytes(n * 4);
    r->set_xxh3(Hash(values.data() + b, n * 4));
    if (absl::Status s = writer->Write(
            at, absl::MakeConstSpan(reinterpret_cast<const std::byte*>(values.data() + b), n * 4));
        !s.ok()) {
      return s;
    }
    at += n * 4;
  }
  m.set_data_bytes(at);
  if (edit) edit(&m);
  if (absl::Status s = writer->Sync(); !s.ok()) return s;
  return CommitManifest(dir, StemFor(name), m, keep_previous);
}
absl::Status WriteSession(const std::string& dir, const std::string& name, uint64_t offset,
                          const std::vector<float>& values, uint64_t chunk, uint64_t steps = 7,
                          bool keep_previous = false,
                          const std::function<void(Manifest*)>& edit = nullptr) {
  return WriteSession(Opened(dir), name, offset, values, chunk, steps, keep_previous, edit);
}

TEST(StemTest, KeepsSafeBytesOnly) {
  EXPECT_EQ(StemFor("job_rank0"), "job_rank0");  // safe names stay as they are
  // Others get a hash of the whole name: never two sessions on one stem.
  const std::string a = StemFor("job/rank0"), b = StemFor("job_rank0"), c = StemFor("job:rank0");
  EXPECT_EQ(a.substr(0, 10), "job_rank0-");
  EXPECT_EQ(a.size(), 26u);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  const std::string longer(60, 'x');
  EXPECT_NE(StemFor(longer + "/rank0"), StemFor(longer + "/rank1"));
  EXPECT_LE(StemFor(longer + "/rank0").size(), 48u + 17u);
  EXPECT_EQ(StemFor("../x").substr(0, 12), "session.._x-");
}

TEST(CheckpointFormatTest, TwoRanksConsolidateAndExport) {
  const std::string dir = TempDir();
  std::vector<float> all(16);
  for (int i = 0; i < 16; ++i) all[i] = 0.5f * i - 3;
  // Two ranks of 8 (the last padded past the 15 elements), records of 3.
  ASSERT_TRUE(WriteSession(dir, "job/rank0", 0, {all.begin(), all.begin() + 8}, 3).ok());
  ASSERT_TRUE(WriteSession(dir, "job/rank1", 8, {all.begin() + 8, all.end()}, 3).ok());
  auto index = TensorIndex::Load(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  ASSERT_EQ((*index)->tensors().size(), 1u);
  EXPECT_EQ((*index)->tensors().at("w").numel, 15u);
  std::vector<float> got(11);
  ASSERT_TRUE(ReadWeights(**index, "w", 2, 11, got.data()).ok());
  for (int i = 0; i < 11; ++i) EXPECT_EQ(got[i], all[2 + i]) << i;

  const std::string out = dir + "/w.safetensors";
  auto summary = ExportSafetensors(**index, out);
  ASSERT_TRUE(summary.ok()) << summary.status();
  EXPECT_EQ(summary->tensors, 1u);
  // Read back by the format's definition.
  std::ifstream f(out, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), n);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_NE(header.find("\"w\":{\"dtype\":\"F32\",\"shape\":[3,5],\"data_offsets\":[0,60]}"),
            std::string::npos)
      << header;
  std::vector<float> data(15);
  f.read(reinterpret_cast<char*>(data.data()), 60);
  ASSERT_TRUE(f.good());
  for (int i = 0; i < 15; ++i) EXPECT_EQ(data[i], all[i]);
  EXPECT_EQ(f.peek(), EOF);
}

// One rank's last checkpoint did not complete: the directory holds its
// sessions at different steps, and restoring or exporting all would mix
// them. Refused, naming what each holds and the step all do.
TEST(CheckpointFormatTest, SessionsAtDifferentStepsAreNotMixed) {
  const std::string dir = TempDir();
  const std::vector<float> a(8, 1.0f), b(8, 2.0f);
  for (uint64_t steps : {3, 4}) {
    ASSERT_TRUE(WriteSession(dir, "job/rank0", 0, a, 3, steps, /*keep_previous=*/true).ok());
  }
  ASSERT_TRUE(WriteSession(dir, "job/rank1", 8, b, 3, 3, /*keep_previous=*/true).ok());
  auto mixed = TensorIndex::Load(dir);
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kFailedPrecondition) << mixed.status();
  EXPECT_TRUE(absl::StrContains(mixed.status().message(), "'job/rank0' 4 (and 3)"))
      << mixed.status();
  EXPECT_TRUE(absl::StrContains(mixed.status().message(), "'job/rank1' 3")) << mixed.status();
  EXPECT_TRUE(absl::StrContains(mixed.status().message(), "step 3: ask for it")) << mixed.status();
  auto at3 = TensorIndex::Load(dir, 3);
  ASSERT_TRUE(at3.ok()) << at3.status();
  EXPECT_EQ((*at3)->manifests().size(), 2u);
}

TEST(CheckpointFormatTest, MissingSliceAndOverlapAreRefused) {
  const std::string dir = TempDir();
  ASSERT_TRUE(WriteSession(dir, "rank0", 0, std::vector<float>(8, 1.0f), 8).ok());
  auto index = TensorIndex::Load(dir);
  ASSERT_TRUE(index.ok());
  EXPECT_EQ(ExportSafetensors(**index, dir + "/x.safetensors").status().code(),
            absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(access((dir + "/x.safetensors").c_str(), F_OK), 0);  // nothing written
  ASSERT_TRUE(WriteSession(dir, "other", 4, std::vector<float>(8, 2.0f), 8).ok());
  EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(CheckpointFormatTest, CorruptionIsDataLoss) {
  const std::string dir = TempDir();
  ASSERT_TRUE(WriteSession(dir, "r", 0, std::vector<float>(15, 1.5f), 4).ok());
  auto manifest = ReadManifest(dir + "/r.manifest");
  ASSERT_TRUE(manifest.ok());
  // A flipped byte in the data.
  {
    const std::string data = dir + "/" + manifest->data_file();
    int fd = open(data.c_str(), O_RDWR);
    char c = 0x7f;
    ASSERT_EQ(pwrite(fd, &c, 1, 21), 1);
    close(fd);
  }
  auto index = TensorIndex::Load(dir);
  ASSERT_TRUE(index.ok());
  std::vector<float> got(15);
  absl::Status read = ReadWeights(**index, "w", 0, 15, got.data());
  EXPECT_EQ(read.code(), absl::StatusCode::kDataLoss) << read;
  // A flipped byte in the manifest, and a truncated one.
  {
    int fd = open((dir + "/r.manifest").c_str(), O_RDWR);
    char c = 0;
    ASSERT_EQ(pread(fd, &c, 1, 30), 1);
    c ^= 1;
    ASSERT_EQ(pwrite(fd, &c, 1, 30), 1);
    close(fd);
  }
  EXPECT_EQ(ReadManifest(dir + "/r.manifest").status().code(), absl::StatusCode::kDataLoss);
  ASSERT_EQ(truncate((dir + "/r.manifest").c_str(), 20), 0);
  EXPECT_EQ(ReadManifest(dir + "/r.manifest").status().code(), absl::StatusCode::kDataLoss);
}

TEST(CheckpointFormatTest, AnInterruptedCheckpointLeavesThePreviousOne) {
  const std::string dir = TempDir();
  ASSERT_TRUE(WriteSession(dir, "r", 0, std::vector<float>(15, 1.0f), 15).ok());
  // The next one crashed after writing its data, before its manifest.
  auto writer = DataFileWriter::Create(Opened(dir), "r");
  ASSERT_TRUE(writer.ok());
  std::vector<float> junk(15, 9.0f);
  ASSERT_TRUE(
      writer->Write(0, absl::MakeConstSpan(reinterpret_cast<std::byte*>(junk.data()), 60)).ok());
  std::ofstream(dir + "/r.manifest.tmp") << "torn";
  auto index = TensorIndex::Load(dir);
  ASSERT_TRUE(index.ok()) << index.status();
  std::vector<float> got(15);
  ASSERT_TRUE(ReadWeights(**index, "w", 0, 15, got.data()).ok());
  for (float v : got) EXPECT_EQ(v, 1.0f);
  // The next checkpoint that commits removes the leftovers.
  ASSERT_TRUE(WriteSession(dir, "r", 0, std::vector<float>(15, 2.0f), 15).ok());
  EXPECT_NE(access(writer->path().c_str(), F_OK), 0);
  int data_files = 0;
  for (int g = 0; g < 4; ++g) {
    data_files += access(absl::StrCat(dir, "/r.", g, ".data").c_str(), F_OK) == 0;
  }
  EXPECT_EQ(data_files, 1);
}

// Automatic checkpoints keep the one they replace: a restore names the step
// it wants and gets the latest or the previous checkpoint that has it; older
// ones, and their data, are gone.
TEST(CheckpointFormatTest, ThePreviousCheckpointStaysWhereAsked) {
  const std::string dir = TempDir();
  for (uint64_t step = 1; step <= 3; ++step) {
    ASSERT_TRUE(WriteSession(dir, "job/rank1", 0, std::vector<float>(15, 1.0f * step), 15, step,
                             /*keep_previous=*/true)
                    .ok());
  }
  const std::string stem = StemFor("job/rank1");
  EXPECT_EQ(CheckpointSteps(dir, stem), (std::vector<uint64_t>{3, 2}));
  std::vector<float> got(15);
  for (uint64_t step : {3, 2}) {
    auto index = TensorIndex::Load(dir, step);
    ASSERT_TRUE(index.ok()) << index.status();
    ASSERT_TRUE(ReadWeights(**index, "w", 0, 15, got.data()).ok());
    for (float v : got) ASSERT_EQ(v, 1.0f * step);
  }
  auto latest = TensorIndex::Load(dir);
  ASSERT_TRUE(latest.ok()) << latest.status();
  ASSERT_TRUE(ReadWeights(**latest, "w", 0, 15, got.data()).ok());
  EXPECT_EQ(got[0], 3.0f);
  const absl::Status gone = TensorIndex::Load(dir, 1).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kNotFound) << gone;
  EXPECT_TRUE(absl::StrContains(gone.message(), "has step 3 and step 2")) << gone;
  int data_files = 0;
  for (int g = 0; g < 4; ++g) {
    data_files += access(absl::StrCat(dir, "/", stem, ".", g, ".data").c_str(), F_OK) == 0;
  }
  EXPECT_EQ(data_files, 2);
  // Without keep_previous, the previous one is as it was and the replaced
  // one's data goes.
  ASSERT_TRUE(WriteSession(dir, "job/rank1", 0, std::vector<float>(15, 4.0f), 15, 4).ok());
  EXPECT_EQ(CheckpointSteps(dir, stem), (std::vector<uint64_t>{4, 2}));
  EXPECT_TRUE(TensorIndex::Load(dir, 2).ok());
  EXPECT_EQ(TensorIndex::Load(dir, 3).status().code(), absl::StatusCode::kNotFound);
}

// A latest manifest the disk corrupted: the previous checkpoint is what a
// restore of its step reads, and a restore of the latest says which step
// is intact.
TEST(CheckpointFormatTest, AnUnreadableLatestCheckpointLeavesThePreviousOneRestorable) {
  const std::string dir = TempDir();
  for (uint64_t step = 1; step <= 2; ++step) {
    ASSERT_TRUE(WriteSession(dir, "job/rank0", 0, std::vector<float>(15, 1.0f * step), 15, step,
                             /*keep_previous=*/true)
                    .ok());
  }
  const std::string manifest = dir + "/" + StemFor("job/rank0") + ".manifest";
  {
    std::fstream f(manifest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(20);
    char c = 0;
    f.read(&c, 1);
    f.seekp(20);
    c = static_cast<char>(c ^ 0xFF);
    f.write(&c, 1);
  }
  EXPECT_EQ(CheckpointSteps(dir, StemFor("job/rank0")), (std::vector<uint64_t>{1}));
  const absl::Status latest = ReadManifests(dir).status();
  EXPECT_EQ(latest.code(), absl::StatusCode::kDataLoss) << latest;
  EXPECT_TRUE(absl::StrContains(latest.message(), "of step 1) is intact: restore_steps 1"))
      << latest;
  auto previous = TensorIndex::Load(dir, 1);
  ASSERT_TRUE(previous.ok()) << previous.status();
  std::vector<float> got(15);
  ASSERT_TRUE(ReadWeights(**previous, "w", 0, 15, got.data()).ok());
  EXPECT_EQ(got[0], 1.0f);
}

TEST(CheckpointFormatTest, WritersOfOneStemNeverLoseTheNewerCheckpoint) {
  const std::string dir = TempDir();
  // A checkpoint of "job/rank0" from before stems were hashed, then one
  // from now: the older one goes (else the tensor would be there twice).
  {
    ASSERT_TRUE(WriteSession(dir, "job/rank0", 0, std::vector<float>(15, 1.0f), 15).ok());
    const std::string hashed = StemFor("job/rank0");
    auto m = ReadManifest(dir + "/" + hashed + ".manifest");
    ASSERT_TRUE(m.ok());
    // Move it to the old name, as the previous version wrote it.
    ASSERT_EQ(
        rename((dir + "/" + hashed + ".manifest").c_str(), (dir + "/job_rank0.manifest").c_str()),
        0);
    ASSERT_TRUE(WriteSession(dir, "job/rank0", 0, std::vector<float>(15, 2.0f), 15).ok());
    EXPECT_NE(access((dir + "/job_rank0.manifest").c_str(), F_OK), 0);
    auto index = TensorIndex::Load(dir);
    ASSERT_TRUE(index.ok()) << index.status();
  }
  // Two writers of one stem: the older generation may not replace the
  // newer commit; a crashed attempt's temporary manifest is collected.
  auto older = DataFileWriter::Create(Opened(dir), "s");
  auto newer = DataFileWriter::Create(Opened(dir), "s");
  ASSERT_TRUE(older.ok() && newer.ok());
  std::ofstream(dir + "/s.manifest." + older->name() + ".tmp") << "torn";
  Manifest m;
  m.set_format_version(kFormatVersion);
  m.set_session_name("s");
  m.set_data_file(newer->name());
  ASSERT_TRUE(CommitManifest(Opened(dir), "s", m).ok());
  EXPECT_NE(access((dir + "/s.manifest." + older->name() + ".tmp").c_str(), F_OK), 0);
  m.set_data_file(older->name());
  EXPECT_EQ(CommitManifest(Opened(dir), "s", m).code(), absl::StatusCode::kAborted);
  EXPECT_EQ(ReadManifest(dir + "/s.manifest")->data_file(), newer->name());
}

// Commits into one directory take turns: one waits while another holds
// the directory (between its check for a newer manifest and its cleanup, a
// second writer of the stem would otherwise commit and have its data file
// removed from under its manifest).
TEST(CheckpointFormatTest, CommitsIntoOneDirectoryTakeTurns) {
  const std::string dir = TempDir();
  UniqueFd other(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  ASSERT_EQ(flock(other.get(), LOCK_EX), 0);  // another writer's commit, under way
  std::atomic<bool> committed{false};
  std::thread writer([&] {
    EXPECT_TRUE(WriteSession(dir, "r", 0, std::vector<float>(15, 1.0f), 15).ok());
    committed = true;
  });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_FALSE(committed.load());
  EXPECT_FALSE(std::filesystem::exists(dir + "/r.manifest"));
  ASSERT_EQ(flock(other.get(), LOCK_UN), 0);
  writer.join();
  EXPECT_TRUE(committed.load());
  EXPECT_TRUE(ReadManifest(dir + "/r.manifest").ok());
}

TEST(CheckpointFormatTest, HostileManifestsAndDirectoriesAreRefused) {
  const std::string dir = TempDir();
  ASSERT_TRUE(WriteSession(dir, "r", 0, std::vector<float>(15, 1.0f), 15).ok());
  // A manifest claiming a 1 TB record (validly framed and hashed).
  auto m = ReadManifest(dir + "/r.manifest");
  ASSERT_TRUE(m.ok());
  m->mutable_partitions(0)->mutable_records(0)->set_bytes(uint64_t{1} << 40);
  ASSERT_TRUE(CommitManifest(Opened(dir), "r", *m).ok());
  EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kDataLoss);
  m->mutable_partitions(0)->mutable_records(0)->set_bytes(60);
  m->mutable_partitions(0)->set_numel(uint64_t{1} << 50);
  ASSERT_TRUE(CommitManifest(Opened(dir), "r", *m).ok());
  EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kDataLoss);
  m->mutable_partitions(0)->set_numel(15);
  m->mutable_partitions(0)->add_shape(uint64_t{1} << 38);  // 3 x 5 x 2^38 > 2^40
  ASSERT_TRUE(CommitManifest(Opened(dir), "r", *m).ok());
  EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kDataLoss);
  m->mutable_partitions(0)->clear_shape();
  // A data file outside the manifest's directory (read from, or removed at
  // a later commit, wherever offloadd may).
  // (Framed and hashed as CommitManifest does, which would not write it.)
  auto write_raw = [&](const Manifest& manifest) {
    std::string payload;
    ASSERT_TRUE(manifest.SerializeToString(&payload));
    const uint64_t length = payload.size(), hash = Hash(payload.data(), payload.size());
    std::ofstream out(dir + "/r.manifest", std::ios::binary | std::ios::trunc);
    out.write("OFLDCKP1", 8);
    out.write(reinterpret_cast<const char*>(&length), 8);
    out.write(reinterpret_cast<const char*>(&hash), 8);
    out << payload;
  };
  const std::string valid = m->data_file();
  write_raw(*m);
  ASSERT_TRUE(ReadManifest(dir + "/r.manifest").ok());  // (the framing is right)
  for (const char* outside : {"../../etc/passwd", "..", "/etc/passwd"}) {
    m->set_data_file(outside);
    write_raw(*m);
    EXPECT_EQ(ReadManifest(dir + "/r.manifest").status().code(), absl::StatusCode::kDataLoss)
        << outside;
    EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kDataLoss) << outside;
  }
  m->set_data_file(valid);
  ASSERT_TRUE(CommitManifest(Opened(dir), "r", *m).ok());
  // A directory others may write is refused, for reading and writing.
  ASSERT_EQ(chmod(dir.c_str(), 0777), 0);
  EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(Directory::Prepare(dir).status().code(), absl::StatusCode::kPermissionDenied);
}

// A checkpoint directory named through a symlink loop is the caller's
// error (INVALID_ARGUMENT), not offloadd's (INTERNAL).
TEST(CheckpointFormatTest, ADirectoryThroughASymlinkLoopIsAnInvalidArgument) {
  const std::string base = TempDir();
  const std::string a = base + "/a", b = base + "/b";
  ASSERT_EQ(symlink(b.c_str(), a.c_str()), 0);
  ASSERT_EQ(symlink(a.c_str(), b.c_str()), 0);
  EXPECT_EQ(Directory::Open(a + "/ckpt").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Directory::Prepare(a + "/ckpt").status().code(), absl::StatusCode::kInvalidArgument);
}

// A checkpoint is written into, and read from, the directory that passed
// the check: its path made a link to one anyone may write, after it was
// opened, changes nothing.
TEST(CheckpointFormatTest, ADirectoryIsCheckedOnceAndUsedAsOpened) {
  const std::string dir = TempDir(), moved = dir + ".moved", planted = TempDir();
  ASSERT_EQ(chmod(planted.c_str(), 0777), 0);  // what another user could offer
  const Directory opened = Opened(dir);
  ASSERT_EQ(rename(dir.c_str(), moved.c_str()), 0);
  ASSERT_EQ(symlink(planted.c_str(), dir.c_str()), 0);
  ASSERT_TRUE(WriteSession(opened, "r", 0, std::vector<float>(15, 1.0f), 15).ok());
  EXPECT_TRUE(ListDirectory(planted).empty());
  EXPECT_EQ(ListDirectory(moved).size(), 2u);  // r.manifest, r.0.data
  auto manifests = ReadManifests(opened);
  ASSERT_TRUE(manifests.ok()) << manifests.status();
  ASSERT_EQ(manifests->size(), 1u);
  // Its manifests and data, planted where the path now leads, are not read.
  ASSERT_TRUE(WriteSession(Opened(moved), "s", 0, std::vector<float>(15, 2.0f), 15).ok());
  for (const std::string& name : ListDirectory(moved)) {
    if (absl::StartsWith(name, "s.")) {
      ASSERT_EQ(rename((moved + "/" + name).c_str(), (planted + "/" + name).c_str()), 0);
    }
  }
  manifests = ReadManifests(opened);
  ASSERT_TRUE(manifests.ok()) << manifests.status();
  EXPECT_EQ(manifests->size(), 1u);
  EXPECT_EQ(ReadManifests(dir).status().code(), absl::StatusCode::kPermissionDenied);
  // Where it is now, for the checks made on locations.
  auto location = opened.Location();
  ASSERT_TRUE(location.ok()) << location.status();
  EXPECT_EQ(*location, moved);
}

// Records written and read around the page cache (aligned memory and
// offsets, a partial last block) and through it (unaligned memory, records
// sharing a block) round-trip alike, side by side in one file, read back
// from the disk. Also in a tmpfs directory, which takes O_DIRECT from Linux
// 6.6 on and refuses it before (then everything goes through the page
// cache, and round-trips the same).
TEST(CheckpointFormatTest, DirectAndBufferedRecordsRoundTripSideBySide) {
  for (const std::string& dir : {TempDir(), std::string()}) {
    std::string where = dir;
    if (where.empty()) {  // tmpfs, where the machine has /dev/shm
      char shm[] = "/dev/shm/ckpt_XXXXXX";
      if (mkdtemp(shm) == nullptr) continue;
      where = shm;
    }
    SCOPED_TRACE(where);
    auto writer = DataFileWriter::Create(Opened(where), "s");
    ASSERT_TRUE(writer.ok()) << writer.status();
    struct Free {
      void operator()(std::byte* p) const { std::free(p); }
    };
    constexpr uint64_t kBytes = 3 * kDirectAlignment + 100;  // a partial last block
    std::unique_ptr<std::byte[], Free> aligned(
        static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, 4 * kDirectAlignment)));
    for (uint64_t i = 0; i < kBytes; ++i) aligned[i] = static_cast<std::byte>(i * 7 + 1);
    std::vector<std::byte> unaligned(kBytes + 1);
    for (uint64_t i = 0; i < kBytes; ++i) unaligned[i + 1] = static_cast<std::byte>(i * 5 + 3);
    // Record 0 at 0 (direct), record 1 right after it in the same block
    // (buffered), record 2 at the next aligned offset (direct).
    std::vector<Record> records(3);
    const uint64_t offsets[] = {0, kBytes, 2 * 4 * kDirectAlignment};
    const std::byte* sources[] = {aligned.get(), unaligned.data() + 1, aligned.get()};
    for (int r = 0; r < 3; ++r) {
      records[r].set_offset(offsets[r]);
      records[r].set_bytes(kBytes);
      records[r].set_xxh3(Hash(sources[r], kBytes));
    }
    // Out of order, as captures are: record 1 before record 0, so that a
    // direct write of 0 that ran past its whole blocks would show.
    for (int r : {1, 2, 0}) {
      ASSERT_TRUE(writer->Write(offsets[r], absl::MakeConstSpan(sources[r], kBytes)).ok());
    }
    ASSERT_TRUE(writer->Sync().ok());
    // Records 0 and 2 went direct, all but their last partial block.
    EXPECT_EQ(writer->direct_bytes(), writer->direct() ? 6 * kDirectAlignment : 0);
    if (!dir.empty()) {
      EXPECT_TRUE(writer->direct());  // TEST_TMPDIR: ext4 on this project's machines
    }
    {  // read back from the disk, not the page cache
      UniqueFd fd(open(writer->path().c_str(), O_RDONLY | O_CLOEXEC));
      ASSERT_GE(fd.get(), 0);
      posix_fadvise(fd.get(), 0, 0, POSIX_FADV_DONTNEED);
    }
    auto reader = DataFileReader::Open(Opened(where), writer->name());
    ASSERT_TRUE(reader.ok()) << reader.status();
    std::unique_ptr<std::byte[], Free> into(
        static_cast<std::byte*>(std::aligned_alloc(kDirectAlignment, 4 * kDirectAlignment)));
    for (int r = 0; r < 3; ++r) {
      for (bool aligned_dst : {true, false}) {
        std::byte* dst = into.get() + (aligned_dst ? 0 : 8);
        std::memset(into.get(), 0, 4 * kDirectAlignment);
        absl::Status read = reader->Read(records[r], dst);
        ASSERT_TRUE(read.ok()) << "record " << r << ": " << read;
        EXPECT_EQ(std::memcmp(dst, sources[r], kBytes), 0) << "record " << r;
      }
    }
    if (dir.empty()) {
      unlink(writer->path().c_str());
      rmdir(where.c_str());
    }
  }
}

// Reserve allocates the file's room up front; what the file system cannot
// hold fails then, naming the file. (A real full file system's
// RESOURCE_EXHAUSTED is tested on a small tmpfs in
// tests/daemon_system_test.cc.)
TEST(CheckpointFormatTest, ReserveAllocatesTheFileOrSaysWhyNot) {
  const std::string dir = TempDir();
  auto writer = DataFileWriter::Create(Opened(dir), "s");
  ASSERT_TRUE(writer.ok()) << writer.status();
  ASSERT_TRUE(writer->Reserve(1 << 20).ok());
  struct stat st;
  ASSERT_EQ(stat(writer->path().c_str(), &st), 0);
  EXPECT_GE(static_cast<uint64_t>(st.st_blocks) * 512, uint64_t{1} << 20);
  absl::Status huge = writer->Reserve(uint64_t{1} << 60);  // an exabyte
  EXPECT_FALSE(huge.ok());
  EXPECT_NE(huge.message().find(writer->path()), std::string::npos) << huge;
}

TEST(SafetensorsTest, EscapesNamesAndRefusesDuplicates) {
  EXPECT_EQ(JsonString("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
  const std::string dir = TempDir();
  auto fill = [](uint64_t, uint64_t, float* d) {
    d[0] = 1;
    return absl::OkStatus();
  };
  EXPECT_EQ(
      WriteSafetensors(dir + "/d.safetensors", {{"x", {1}, fill}, {"x", {1}, fill}}, {}).code(),
      absl::StatusCode::kInvalidArgument);
  // Sizes past what a file can hold are refused before anything is written.
  const uint64_t big = uint64_t{1} << 40;
  EXPECT_EQ(WriteSafetensors(dir + "/e.safetensors", {{"x", {big, big}, fill}}, {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::distance(std::filesystem::directory_iterator(dir),
                          std::filesystem::directory_iterator()),
            0);
}

// A tensor is written in chunks (memory bounded by the chunk, not the
// tensor: a tensor larger than the machine's memory exports), into a file
// of the export's own: one already beside the output (a stale temporary, or
// a link planted there) is neither followed nor truncated.
TEST(SafetensorsTest, WritesInChunksThroughAFileOfItsOwn) {
  const std::string dir = TempDir();
  const std::string out = dir + "/big.safetensors";
  const std::string planted = dir + "/planted";
  { std::ofstream(planted) << "keep"; }
  for (const char* suffix : {".tmp", ".tmp.0"}) {
    ASSERT_EQ(symlink(planted.c_str(), (out + suffix).c_str()), 0);
  }
  const uint64_t numel = 2 * kSafetensorsChunk + 5;
  std::vector<std::pair<uint64_t, uint64_t>> asked;
  auto fill = [&](uint64_t begin, uint64_t n, float* d) {
    asked.emplace_back(begin, n);
    for (uint64_t i = 0; i < n; ++i) d[i] = static_cast<float>((begin + i) % 1000);
    return absl::OkStatus();
  };
  ASSERT_TRUE(WriteSafetensors(out, {{"x", {numel}, fill}}, {}).ok());
  const std::vector<std::pair<uint64_t, uint64_t>> chunks = {
      {0, kSafetensorsChunk}, {kSafetensorsChunk, kSafetensorsChunk}, {2 * kSafetensorsChunk, 5}};
  EXPECT_EQ(asked, chunks);
  std::ifstream f(out, std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  f.seekg(static_cast<std::streamoff>(8 + n + 4 * (numel - 3)));
  float last[3];
  f.read(reinterpret_cast<char*>(last), sizeof(last));
  ASSERT_TRUE(f.good());
  for (int i = 0; i < 3; ++i) EXPECT_EQ(last[i], static_cast<float>((numel - 3 + i) % 1000));
  std::string kept;
  std::ifstream(planted) >> kept;
  EXPECT_EQ(kept, "keep");
  // A chunk's failure leaves nothing of the file, and no temporary.
  auto failing = [](uint64_t begin, uint64_t, float*) {
    return begin == 0 ? absl::OkStatus() : absl::DataLossError("chunk 2");
  };
  EXPECT_EQ(WriteSafetensors(dir + "/f.safetensors", {{"x", {numel}, failing}}, {}).code(),
            absl::StatusCode::kDataLoss);
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().filename().string().find("f.safetensors"), std::string::npos)
        << entry.path();
  }
}

// What the daemon never writes is refused as not its checkpoint, even with
// every record's checksum right: two records of one kind holding the same
// elements (counted twice, the rest would read as zeros), a parameter
// dtype offloadd does not have (read as nothing).
TEST(CheckpointFormatTest, RecordsTwiceAndUnknownDTypesAreDataLoss) {
  const std::vector<float> values(8, 1.25f);
  {
    const std::string dir = TempDir();
    ASSERT_TRUE(WriteSession(dir, "r", 0, values, 4, 7, false, [](Manifest* m) {
                  m->mutable_partitions(0)->mutable_records(1)->set_begin(0);
                }).ok());
    auto index = TensorIndex::Load(dir);
    EXPECT_EQ(index.status().code(), absl::StatusCode::kDataLoss) << index.status();
    EXPECT_TRUE(absl::StrContains(index.status().message(), "two records of MASTER"))
        << index.status();
  }
  {
    const std::string dir = TempDir();
    ASSERT_TRUE(WriteSession(dir, "r", 0, values, 4, 7, false, [](Manifest* m) {
                  m->mutable_partitions(0)->set_param_dtype(0);
                }).ok());
    EXPECT_EQ(TensorIndex::Load(dir).status().code(), absl::StatusCode::kDataLoss);
  }
  // A tensor far larger than its records (2^40 elements, one record of 8)
  // fails its export at the first chunk it lacks, not by running out of
  // memory; and weights asked for past the tensor's end are OUT_OF_RANGE.
  {
    const std::string dir = TempDir();
    ASSERT_TRUE(WriteSession(dir, "r", 0, values, 8, 7, false, [](Manifest* m) {
                  m->mutable_partitions(0)->clear_shape();
                  m->mutable_partitions(0)->set_numel(uint64_t{1} << 40);
                }).ok());
    auto index = TensorIndex::Load(dir);
    ASSERT_TRUE(index.ok()) << index.status();
    const std::string out = dir + "/x.safetensors";
    EXPECT_EQ(ExportSafetensors(**index, out).status().code(),
              absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(access(out.c_str(), F_OK), 0);
    std::vector<float> got(8);
    EXPECT_TRUE(ReadWeights(**index, "w", 0, 8, got.data()).ok());
    EXPECT_EQ(got[7], 1.25f);
    EXPECT_EQ(ReadWeights(**index, "w", (uint64_t{1} << 40) - 1, 2, got.data()).code(),
              absl::StatusCode::kOutOfRange);
  }
}

}  // namespace
}  // namespace offload::checkpoint
