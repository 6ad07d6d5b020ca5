#include "engine/kept_sessions.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/directory.h"
#include "base/host_memory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "checkpoint/format.h"
#include "proto/checkpoint.pb.h"

namespace offload {
namespace {

constexpr char kPreservedFile[] = "session.binpb";
// Beside the kept sessions: "<id> <why>" a line, each session the stop
// could not keep (KeepSessions), for the next offloadd to say why.
constexpr char kNotKeptFile[] = "not-kept";

// The name a kept session's state has in the pool's file's directory.
std::string MemoryLinkFor(const std::string& memory_dir, uint64_t id) {
  return absl::StrCat(memory_dir, "/kept-", id, ".memory");
}

// Keeps the session `kept` in `sub`; with `memory`, what it holds in the
// pool's file stays there, named `link`.
absl::Status KeepOne(SessionManager& sessions, const SessionManager::KeptSession& kept,
                     const std::string& sub, PoolFile* memory, const std::string& link,
                     KeptBytes* bytes) {
  ASSIGN_OR_RETURN(SessionManager::CheckpointOutcome written,
                   sessions.CheckpointForKeeping(kept.key.id, sub, memory, link));
  bytes->referenced += written.summary.referenced_bytes;
  bytes->written += written.summary.bytes - written.summary.referenced_bytes;
  if (written.summary.partitions != kept.partition_ids.size()) {
    return absl::FailedPreconditionError(absl::StrCat("it has ", written.summary.partitions,
                                                      " partitions in its checkpoint, ",
                                                      kept.partition_ids.size(), " registered"));
  }
  checkpoint::v1::PreservedSession record;
  record.set_session_id(kept.key.id);
  record.set_token(kept.key.token);
  record.set_name(kept.name);
  record.set_restore_from(kept.restore_from);
  record.set_keep_for_resume(kept.keep_for_resume);
  if (kept.restore_steps.has_value()) record.set_restore_steps(*kept.restore_steps);
  if (kept.user.has_value()) record.set_user(*kept.user);
  if (kept.share_weight > 0) record.set_share_weight(static_cast<uint32_t>(kept.share_weight));
  for (uint64_t partition : kept.partition_ids) record.add_partition_ids(partition);
  return WriteFileAtomically(sub, kPreservedFile, record.SerializeAsString());
}

// The manifest of the session kept in `sub`, if it names a memory file.
std::optional<checkpoint::Manifest> KeptInMemory(const std::string& sub) {
  UniqueFd fd(
      open(absl::StrCat(sub, "/", kPreservedFile).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  checkpoint::v1::PreservedSession record;
  if (!fd.valid() || !record.ParseFromFileDescriptor(fd.get())) return std::nullopt;
  absl::StatusOr<checkpoint::Manifest> m = checkpoint::ReadManifest(
      absl::StrCat(sub, "/", checkpoint::StemFor(record.name()), ".manifest"));
  if (!m.ok() || m->memory_file().empty()) return std::nullopt;
  return *std::move(m);
}

// The ranges (offset, bytes) of `m`'s records kept in its memory file.
std::vector<std::pair<uint64_t, uint64_t>> MemoryRanges(const checkpoint::Manifest& m) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const checkpoint::PartitionRecord& p : m.partitions()) {
    for (const checkpoint::Record& r : p.records()) {
      if (r.has_memory_offset()) ranges.emplace_back(r.memory_offset(), r.bytes());
    }
  }
  return ranges;
}

// The session reopened from `sub` no longer needs its kept memory: the
// name goes, and `sub` with it (it no longer holds the session). In a file
// this pool took over (`memory`), the bytes are the session's blocks now;
// in another, they were read (copied) and are punched out here.
void ConsumeMemory(SessionManager& sessions, uint64_t id, const std::string& sub,
                   const checkpoint::Manifest& m, const PoolFile* memory) {
  if (memory == nullptr || !memory->IsFile(m.memory_file())) {
    UniqueFd fd(open(m.memory_file().c_str(), O_WRONLY | O_CLOEXEC | O_NOFOLLOW));
    for (const auto& [offset, bytes] : MemoryRanges(m)) {
      if (!fd.valid()) break;
      fallocate(fd.get(), FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, static_cast<off_t>(offset),
                static_cast<off_t>(RoundUpToPage(bytes)));
    }
  }
  if (unlink(m.memory_file().c_str()) != 0 && errno != ENOENT) {
    LogWarning("session %d's kept memory %s stays: %s", static_cast<int64_t>(id), m.memory_file(),
               PosixError("unlink", errno).ToString());
  }
  sessions.ForgetKeptCopy(id);
  RemoveDirectoryOfFiles(sub);
}

// Reopens the session kept in `sub`: its id.
absl::StatusOr<uint64_t> ReopenOne(SessionManager& sessions, const std::string& sub) {
  if (!IsDirectory(sub)) return absl::FailedPreconditionError("not a directory");
  const std::string path = absl::StrCat(sub, "/", kPreservedFile);
  UniqueFd fd(open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
  if (!fd.valid()) return PosixError(absl::StrCat("opening ", path), errno);
  checkpoint::v1::PreservedSession record;
  if (!record.ParseFromFileDescriptor(fd.get())) {
    return absl::DataLossError(absl::StrCat(path, " does not parse"));
  }
  SessionManager::KeptSession kept{SessionKey{record.session_id(), record.token()},
                                   record.name(),
                                   record.restore_from(),
                                   {record.partition_ids().begin(), record.partition_ids().end()},
                                   record.keep_for_resume(),
                                   std::nullopt,
                                   std::nullopt};
  if (record.has_restore_steps()) kept.restore_steps = record.restore_steps();
  if (record.has_user()) kept.user = record.user();
  if (record.has_share_weight()) {
    RETURN_IF_ERROR(SessionManager::CheckShareWeight(record.share_weight()));
    kept.share_weight = record.share_weight();
  }
  RETURN_IF_ERROR(sessions.Reopen(kept, sub));
  return kept.key.id;
}

}  // namespace

int KeepSessions(SessionManager& sessions, const std::string& dir, PoolFile* memory,
                 KeptBytes* bytes, const EachKeptSession& before_each) {
  KeptBytes unused;
  if (bytes == nullptr) bytes = &unused;
  const std::vector<uint64_t> ids = sessions.SessionIds();
  if (ids.empty()) return 0;
  // No call through a ring from here on: what a trainer saw answered is in
  // what is kept, what it saw refused is not.
  sessions.DrainRings(absl::Seconds(2));
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    LogWarning("cannot keep the sessions: %s",
               PosixError(absl::StrCat("creating ", dir), errno).ToString());
    bytes->lost += static_cast<int>(ids.size());
    return 0;
  }
  int kept = 0;
  for (uint64_t id : ids) {
    if (before_each) before_each(id);
    const std::string sub = absl::StrCat(dir, "/", id);
    absl::StatusOr<SessionManager::KeptSession> session = sessions.QuiesceForKeeping(id);
    // Named in the pool's file where it has one (written otherwise).
    std::string link;
    PoolFile* by_reference = nullptr;
    if (memory != nullptr && session.ok()) {
      link = MemoryLinkFor(memory->dir(), id);
      unlink(link.c_str());  // an earlier keep's, not taken
      if (absl::Status linked = memory->Link(link); linked.ok()) {
        by_reference = memory;
      } else {
        LogWarning("session %d is written, not kept in memory: %s", static_cast<int64_t>(id),
                   linked.ToString());
        link.clear();
      }
    }
    absl::Status status = session.ok() ? KeepOne(sessions, *session, sub, by_reference, link, bytes)
                                       : session.status();
    if (status.ok()) {
      ++kept;
      continue;
    }
    if (!link.empty()) unlink(link.c_str());
    // (Closed meanwhile, NOT_FOUND: nothing to keep. Anything else, a step
    // that stopped midway and cannot be finished among it, loses it.)
    if (session.ok() || !absl::IsNotFound(session.status())) ++bytes->lost;
    LogWarning("session %d ('%s') is not kept across the restart: %s", static_cast<int64_t>(id),
               session.ok() ? session->name : "", status.ToString());
    // Reopened from there and not resumed since: that copy stays.
    if (sessions.ReopenedFrom(id, sub)) continue;
    RemoveDirectoryOfFiles(sub);
    if (session.ok()) {
      // For the next offloadd to tell its trainer why (best effort: a full
      // disk may refuse this line too). One line: "<id> <why>".
      std::string why = status.ToString();
      std::replace(why.begin(), why.end(), '\n', ' ');
      const std::string line = absl::StrCat(id, " ", why, "\n");
      UniqueFd f(open(absl::StrCat(dir, "/", kNotKeptFile).c_str(),
                      O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600));
      if (f.valid()) (void)!write(f.get(), line.data(), line.size());
    }
  }
  return kept;
}

int ReopenKeptSessions(SessionManager& sessions, const std::string& dir, PoolFile* memory,
                       const EachKeptSession& before_each) {
  if (absl::Status own = checkpoint::CheckOwnDirectory(dir); !own.ok()) {
    LogWarning("sessions kept in %s are not reopened: %s", dir, own.ToString());
    return 0;
  }
  // What is kept in memory, and where. Where it is all in one file, this
  // pool takes that file over: the sessions take their bytes where they are.
  absl::flat_hash_map<std::string, checkpoint::Manifest> in_memory;  // by sub
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  std::string file;
  bool one_file = true;
  for (const std::string& name : ListDirectory(dir)) {
    const std::string sub = absl::StrCat(dir, "/", name);
    std::optional<checkpoint::Manifest> m = KeptInMemory(sub);
    if (!m.has_value()) continue;
    if (file.empty()) {
      file = m->memory_file();
    } else if (!SameFile(file, m->memory_file())) {
      one_file = false;
    }
    for (const auto& range : MemoryRanges(*m)) ranges.push_back(range);
    in_memory.emplace(sub, *std::move(m));
  }
  bool taken_over = false;
  if (memory != nullptr && !file.empty() && one_file) {
    absl::Status over = memory->TakeOver(file, ranges);
    taken_over = over.ok();
    if (!over.ok()) {
      LogWarning("the sessions kept in %s are copied out of it, not taken where they are: %s", file,
                 over.ToString());
    }
  }
  std::vector<uint64_t> reopened;
  std::vector<std::string> not_reopened;  // kept in the taken-over file
  // The sessions the stop could not keep, and why.
  absl::flat_hash_set<std::string> not_kept;
  if (std::ifstream lost(absl::StrCat(dir, "/", kNotKeptFile)); lost) {
    for (std::string line; std::getline(lost, line);) {
      uint64_t id = 0;
      const size_t space = line.find(' ');
      if (space == std::string::npos || !absl::SimpleAtoi(line.substr(0, space), &id)) continue;
      const std::string why = line.substr(space + 1);
      LogWarning("session %d was not kept across the restart by the offloadd before: %s",
                 static_cast<int64_t>(id), why);
      sessions.NotReopened(id, absl::StrCat("the offloadd before could not keep it across its "
                                            "stop: ",
                                            why));
      not_kept.insert(absl::StrCat(id));
    }
    unlink(absl::StrCat(dir, "/", kNotKeptFile).c_str());
  }
  for (const std::string& name : ListDirectory(dir)) {
    // (What a failed keep left is not a kept session.)
    if (name == kNotKeptFile || not_kept.contains(name)) continue;
    const std::string sub = absl::StrCat(dir, "/", name);
    if (before_each) {
      uint64_t named = 0;
      before_each(absl::SimpleAtoi(name, &named) ? named : 0);
    }
    absl::StatusOr<uint64_t> id = ReopenOne(sessions, sub);
    auto kept = in_memory.find(sub);
    if (id.ok()) {
      reopened.push_back(*id);
      if (kept != in_memory.end()) ConsumeMemory(sessions, *id, sub, kept->second, memory);
      continue;
    }
    if (taken_over && kept != in_memory.end()) not_reopened.push_back(sub);
    if (uint64_t named = 0; absl::SimpleAtoi(name, &named)) {
      sessions.NotReopened(named, absl::StrCat("offloadd kept it across its restart but could "
                                               "not reopen it: ",
                                               id.status().ToString()));
    }
    if (absl::IsNotFound(id.status()) && absl::StrContains(id.status().message(), "kept memory")) {
      // (memory.pool_dir emptied, as by a reboot: nothing can read it.)
      LogWarning(
          "a session kept across the restart in %s cannot be reopened: %s; its state went with "
          "that memory: remove %s (its automatic checkpoint, if any, is said below)",
          sub, id.status().ToString(), sub);
      continue;
    }
    LogWarning(
        "a session kept across the restart in %s was not reopened (left there for a later start "
        "that can reopen it; OpenSession's restore_from takes it too): %s",
        sub, id.status().ToString());
  }
  if (taken_over) {
    // The ranges of sessions not reopened stay, for a later start.
    std::vector<std::pair<uint64_t, uint64_t>> keep;
    for (const std::string& sub : not_reopened) {
      for (const auto& range : MemoryRanges(in_memory.at(sub))) keep.push_back(range);
    }
    memory->ReleaseUnclaimed(keep);
  }
  // Kept memory no kept session names any more (its directory went: a
  // lost session's cleanup, by hand) holds memory for no one.
  if (memory != nullptr) {
    const std::string& memory_dir = memory->dir();
    for (const std::string& name : ListDirectory(memory_dir)) {
      uint64_t id;
      absl::string_view rest = name;
      if (!absl::ConsumePrefix(&rest, "kept-") || !absl::ConsumeSuffix(&rest, ".memory") ||
          !absl::SimpleAtoi(rest, &id)) {
        continue;
      }
      if (!IsDirectory(absl::StrCat(dir, "/", id))) {
        unlink(absl::StrCat(memory_dir, "/", name).c_str());
        LogInfo("removed %s/%s: no session kept in %s names it", memory_dir, name, dir);
      }
    }
  }
  // Their leases start together, once every one is back.
  sessions.StartReconnectLeases(reopened);
  return static_cast<int>(reopened.size());
}

}  // namespace offload
