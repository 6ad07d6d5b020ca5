// Sessions kept across a restart of offloadd (server.reconnect_lease_seconds
// > 0): the stopping daemon writes each one into <dir>/<session id>/, its
// checkpoint at a step boundary and what reopening it needs (the
// PreservedSession record of proto/checkpoint.proto: id, token, name, its
// partitions' ids); the next daemon reopens them before it takes any call,
// detached, for their trainers to resume (ResumeSession).
//
// Where the host pool is a file on a memory file system (memory.pool_dir),
// what a session holds in it is not written: the file gets a name per kept
// session, <pool dir>/kept-<id>.memory, and the checkpoint names offsets in
// it (SessionCheckpointState::by_reference). The next daemon's pool takes
// that file over and the reopened sessions' blocks take their bytes where
// they are (nothing copied); then the names and <dir>/<id>/ go (the copy is
// gone: the session holds it). What is elsewhere (on NVMe, in the arena)
// is written and read as before.
//
//   Daemon::Shutdown:  KeepSessions(engine->sessions(), dir, engine->pool().file());
//   Daemon::Start:     ReopenKeptSessions(engine->sessions(), dir, engine->pool().file());
//
// The files are this module's; what a session holds and how it is reopened
// is the SessionManager's (its KeptSession calls).
//
// Thread-safety: each function is one pass over the directory; call them
// when no other keeper runs on `dir` (the daemon's start and stop).
#ifndef OFFLOADD_ENGINE_KEPT_SESSIONS_H_
#define OFFLOADD_ENGINE_KEPT_SESSIONS_H_

#include <functional>
#include <string>

#include "engine/session_manager.h"
#include "swapper/pool_file.h"

namespace offload {

// Once the daemon takes no more calls: ends every session's ring calls
// (SessionManager::DrainRings), then keeps each session in <dir>/<id>/ (a
// running background checkpoint ends first; its trainer's holds go).
// Returns how many it kept; one it cannot keep (its checkpoint fails, it
// closed meanwhile) is logged and goes, as it would without keeping.
// With `memory` (the pool's file), host-resident state is kept by reference.
struct KeptBytes {
  uint64_t referenced = 0;  // named in the pool's file
  uint64_t written = 0;     // written into <dir>
  int lost = 0;             // sessions open that could not be kept (logged)
};
// `before_each`, if set, hears of each session before it is kept (the
// daemon tells systemd to wait longer).
using EachKeptSession = std::function<void(uint64_t id)>;
int KeepSessions(SessionManager& sessions, const std::string& dir, PoolFile* memory = nullptr,
                 KeptBytes* bytes = nullptr, const EachKeptSession& before_each = nullptr);

// At start, before any call: reopens every session kept in `dir` (which
// must be this user's alone: checkpoint::CheckOwnDirectory), then starts
// their reconnect leases together. One it cannot reopen is logged and left
// there (a checkpoint: OpenSession's restore_from takes it). Returns how
// many it reopened. With `memory` (the pool's file, memory.pool_dir): where
// the sessions kept in memory are all in one file, the pool takes it over
// (PoolFile::TakeOver) and their blocks take their bytes where they are,
// checked against their checksums; what no reopened session claimed goes,
// except the ranges of a session kept there that cannot be reopened: they
// stay, with its directory (logged; a later start, or restore_from of the
// directory, takes them; outside the pool's budget meanwhile), and its
// automatic checkpoints stay too. Kept memory in another file is read
// (copied) and punched out. Names of kept memory no directory in `dir` holds any more
// are removed.
// `before_each` as for KeepSessions, before each session is reopened.
int ReopenKeptSessions(SessionManager& sessions, const std::string& dir, PoolFile* memory = nullptr,
                       const EachKeptSession& before_each = nullptr);

}  // namespace offload

#endif  // OFFLOADD_ENGINE_KEPT_SESSIONS_H_
