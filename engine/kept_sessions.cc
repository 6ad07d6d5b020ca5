#include "engine/kept_sessions.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/directory.h"
#include "base/log.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"
#include "checkpoint/format.h"
#include "proto/checkpoint.pb.h"

namespace offload {
namespace {

constexpr char kPreservedFile[] = "session.binpb";

// Keeps the session `kept` in `sub`.
absl::Status KeepOne(SessionManager& sessions, const SessionManager::KeptSession& kept,
                     const std::string& sub) {
  ASSIGN_OR_RETURN(SessionManager::CheckpointOutcome written,
                   sessions.Checkpoint(SessionKey{kept.key.id, ""}, sub, /*background=*/false));
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
  for (uint64_t partition : kept.partition_ids) record.add_partition_ids(partition);
  return WriteFileAtomically(sub, kPreservedFile, record.SerializeAsString());
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
  RETURN_IF_ERROR(sessions.Reopen(kept, sub));
  return kept.key.id;
}

}  // namespace

int KeepSessions(SessionManager& sessions, const std::string& dir) {
  const std::vector<uint64_t> ids = sessions.SessionIds();
  if (ids.empty()) return 0;
  // No call through a ring from here on: what a trainer saw answered is in
  // what is kept, what it saw refused is not.
  sessions.DrainRings(absl::Seconds(2));
  if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    LogWarning("cannot keep the sessions: %s",
               PosixError(absl::StrCat("creating ", dir), errno).ToString());
    return 0;
  }
  int kept = 0;
  for (uint64_t id : ids) {
    const std::string sub = absl::StrCat(dir, "/", id);
    absl::StatusOr<SessionManager::KeptSession> session = sessions.QuiesceForKeeping(id);
    absl::Status status = session.ok() ? KeepOne(sessions, *session, sub) : session.status();
    if (status.ok()) {
      ++kept;
      continue;
    }
    LogWarning("session %d ('%s') is not kept across the restart: %s", static_cast<int64_t>(id),
               session.ok() ? session->name : "", status.ToString());
    // Reopened from there and not resumed since: that copy stays.
    if (!sessions.ReopenedFrom(id, sub)) RemoveDirectoryOfFiles(sub);
  }
  return kept;
}

int ReopenKeptSessions(SessionManager& sessions, const std::string& dir) {
  if (absl::Status own = checkpoint::CheckOwnDirectory(dir); !own.ok()) {
    LogWarning("sessions kept in %s are not reopened: %s", dir, own.ToString());
    return 0;
  }
  std::vector<uint64_t> reopened;
  for (const std::string& name : ListDirectory(dir)) {
    const std::string sub = absl::StrCat(dir, "/", name);
    absl::StatusOr<uint64_t> id = ReopenOne(sessions, sub);
    if (id.ok()) {
      reopened.push_back(*id);
    } else {
      LogWarning(
          "a session kept across the restart in %s was not reopened (left there: "
          "OpenSession's restore_from takes it): %s",
          sub, id.status().ToString());
    }
  }
  // Their leases start together, once every one is back.
  sessions.StartReconnectLeases(reopened);
  return static_cast<int>(reopened.size());
}

}  // namespace offload
