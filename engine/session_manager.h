// Sessions and their partitions: the daemon's core state, in engine types
// (the gRPC layer converts to and from these; see service.h).
//
// A session is one trainer process's connection. It owns a shared-memory
// arena (shm_arena.h) holding every partition's working parameters and
// gradient buffer, which the trainer maps. Each partition's fp32 master
// weights and Adam moments live in daemon-private memory, out of the
// trainer's reach.
//
// Partition life cycle:
//   Register  -> buffers allocated and zeroed; the trainer writes the initial
//                working parameters into its params region.
//   (trainer writes gradients, then) ReturnGradients -> marked ready.
//   Step      -> for every ready partition: on its first step the master
//                copy is initialised from the working copy; Adam updates the
//                master weights and moments and rewrites the working copy.
//                From then on the master copy is authoritative.
//   Fetch     -> where the (updated) working parameters are; waits for a
//                step in progress on the same session.
//
// Errors: NOT_FOUND for a session or partition that never existed,
// FAILED_PRECONDITION for a closed session or a call out of order,
// PERMISSION_DENIED for a wrong token or another session's partition,
// INVALID_ARGUMENT for malformed requests, RESOURCE_EXHAUSTED for budgets.
// A failed call changes nothing.
//
// Thread-safety: all methods are safe from any thread. Calls on different
// sessions proceed in parallel; calls on one session are serialised by that
// session's lock (a Step holds it while the optimizer runs).
#ifndef OFFLOADD_ENGINE_SESSION_MANAGER_H_
#define OFFLOADD_ENGINE_SESSION_MANAGER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/types/span.h"
#include "base/unique_fd.h"
#include "cpu_adam/adam.h"
#include "cpu_adam/dtype.h"
#include "cpu_adam/optimizer.h"
#include "engine/memory_budget.h"
#include "engine/stats.h"

namespace offload {

// What a caller presents to act on a session: its id and secret token.
struct SessionKey {
  uint64_t id = 0;
  std::string token;
};

struct OpenedSession {
  SessionKey key;
  uint64_t arena_capacity = 0;
};

struct PartitionSpec {
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
};

struct ArenaRegion {
  uint64_t offset = 0;
  uint64_t bytes = 0;
};

struct PartitionInfo {
  uint64_t id = 0;
  std::string name;
  uint64_t numel = 0;
  DType param_dtype = DType::kFp32;
  DType grad_dtype = DType::kFp32;
  ArenaRegion params;
  ArenaRegion grads;
  uint64_t step = 0;
};

struct StepSummary {
  uint64_t partitions_updated = 0;
  uint64_t params_updated = 0;
  // Non-finite gradients were found: nothing was updated, step counts did
  // not advance, and the partitions need fresh gradients.
  bool skipped = false;
  uint64_t nonfinite = 0;
};

struct SessionSummary {
  uint64_t id = 0;
  std::string name;
  uint64_t partitions = 0;
  uint64_t arena_bytes = 0;
  uint64_t steps = 0;
};

class SessionManager {
 public:
  static constexpr size_t kTokenBytes = 16;
  // Largest partition accepted (elements): keeps byte counts far from
  // overflow and catches garbage sizes.
  static constexpr uint64_t kMaxNumel = uint64_t{1} << 40;

  // `host`, `optimizer` and `stats` must outlive the manager.
  SessionManager(MemoryBudget* host, Optimizer* optimizer, Stats* stats,
                 uint64_t arena_capacity);
  ~SessionManager();

  absl::StatusOr<OpenedSession> Open(absl::string_view name);
  absl::Status Close(const SessionKey& key);

  absl::StatusOr<PartitionInfo> Register(const SessionKey& key, const PartitionSpec& spec);
  // An empty `ids` fetches every partition of the session.
  absl::StatusOr<std::vector<PartitionInfo>> Fetch(const SessionKey& key,
                                                   absl::Span<const uint64_t> ids);
  // `numel` and `grad_dtype` describe what the trainer wrote; they must match
  // the registration.
  absl::Status ReturnGradients(const SessionKey& key, uint64_t partition_id, uint64_t numel,
                               DType grad_dtype);
  // FAILED_PRECONDITION if no partition returned gradients since last step.
  // Either way the returned gradients are consumed: a skipped step (see
  // StepSummary) also needs new ones.
  absl::StatusOr<StepSummary> Step(const SessionKey& key, const AdamHyperparams& h);

  // A duplicate of the session's arena descriptor, for the arena channel.
  absl::StatusOr<UniqueFd> DupArenaFd(const SessionKey& key);

  // Closes session `id` because its trainer went away (no token: the arena
  // channel saw the trainer's connection close). False if it was not open.
  bool Abandon(uint64_t id);

  // Applies to sessions opened afterwards.
  void SetArenaCapacity(uint64_t bytes);

  std::vector<SessionSummary> Sessions() const;

 private:
  class Session;
  struct Partition;

  absl::StatusOr<std::shared_ptr<Session>> Find(const SessionKey& key) const;
  absl::Status CheckOwner(const Session& session, uint64_t partition_id) const;
  bool CloseById(uint64_t id) ABSL_LOCKS_EXCLUDED(mu_);

  MemoryBudget* const host_;
  Optimizer* const optimizer_;
  Stats* const stats_;

  mutable absl::Mutex mu_;
  uint64_t arena_capacity_ ABSL_GUARDED_BY(mu_);
  uint64_t next_session_id_ ABSL_GUARDED_BY(mu_) = 1;
  uint64_t next_partition_id_ ABSL_GUARDED_BY(mu_) = 1;
  absl::flat_hash_map<uint64_t, std::shared_ptr<Session>> sessions_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_set<uint64_t> closed_sessions_ ABSL_GUARDED_BY(mu_);
  // partition id -> owning session id, for telling "not yours" from "no such".
  absl::flat_hash_map<uint64_t, uint64_t> partition_owner_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_SESSION_MANAGER_H_
