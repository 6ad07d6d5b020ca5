// Sessions kept across a restart of offloadd (server.reconnect_lease_seconds
// > 0): the stopping daemon writes each one into <dir>/<session id>/, its
// checkpoint at a step boundary and what reopening it needs (the
// PreservedSession record of proto/checkpoint.proto: id, token, name, its
// partitions' ids); the next daemon reopens them before it takes any call,
// detached, for their trainers to resume (ResumeSession).
//
//   Daemon::Shutdown:  KeepSessions(engine->sessions(), dir);
//   Daemon::Start:     ReopenKeptSessions(engine->sessions(), dir);
//
// `dir` is <data_dir>/preserved on the disk, or server.memory_keep_dir on a
// memory filesystem where the sessions fit (CheckRoomToKeepInMemory).
//
// The files are this module's; what a session holds and how it is reopened
// is the SessionManager's (its KeptSession calls).
//
// Thread-safety: each function is one pass over the directory; call them
// when no other keeper runs on `dir` (the daemon's start and stop).
#ifndef OFFLOADD_ENGINE_KEPT_SESSIONS_H_
#define OFFLOADD_ENGINE_KEPT_SESSIONS_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "base/memory_limit.h"
#include "engine/session_manager.h"

namespace offload {

// Once the daemon takes no more calls: ends every session's ring calls
// (SessionManager::DrainRings), then keeps each session in <dir>/<id>/ (a
// running background checkpoint ends first; its trainer's holds go).
// Returns how many it kept; one it cannot keep (its checkpoint fails, it
// closed meanwhile) is logged and goes, as it would without keeping.
int KeepSessions(SessionManager& sessions, const std::string& dir);

// At start, before any call: reopens every session kept in `dir` (which
// must be this user's alone: checkpoint::CheckOwnDirectory), then starts
// their reconnect leases together. One it cannot reopen is logged and left
// there (a checkpoint: OpenSession's restore_from takes it). Returns how
// many it reopened.
int ReopenKeptSessions(SessionManager& sessions, const std::string& dir);

// Whether keeping `bytes` of sessions in a directory of a memory filesystem
// (server.memory_keep_dir) whose filesystem has `fs_free` bytes free fits:
// in it, in the host's available memory and in this process's cgroup (a
// memory filesystem's pages are charged to whoever writes them, and they
// stay while the next offloadd restores the same bytes), each with a tenth
// to spare. OK, or RESOURCE_EXHAUSTED saying what is short.
absl::Status CheckRoomToKeepInMemory(uint64_t bytes, uint64_t fs_free, const MemoryLimit& memory);

}  // namespace offload

#endif  // OFFLOADD_ENGINE_KEPT_SESSIONS_H_
