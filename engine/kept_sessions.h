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
// The files are this module's; what a session holds and how it is reopened
// is the SessionManager's (its KeptSession calls).
//
// Thread-safety: each function is one pass over the directory; call them
// when no other keeper runs on `dir` (the daemon's start and stop).
#ifndef OFFLOADD_ENGINE_KEPT_SESSIONS_H_
#define OFFLOADD_ENGINE_KEPT_SESSIONS_H_

#include <string>

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

}  // namespace offload

#endif  // OFFLOADD_ENGINE_KEPT_SESSIONS_H_
