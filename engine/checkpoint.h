// Writing a session's checkpoint, and restoring one into a new session.
//
// Writing (CheckpointWriter), in the format of checkpoint/format.h:
//   1. Begin: PartitionStore::BeginCheckpoint at a step boundary (waits for a
//      running step and accumulations) takes the set's image and starts
//      copy-on-write; the data file is created and laid out (one record per
//      block kind per chunk). This is the only pause training sees.
//   2. Finish: every chunk is captured into the data file (chunks a step or
//      an accumulation reached first were captured by it, before changing
//      them); then fsync, the manifest committed by rename, EndCheckpoint.
//      The data file is allocated whole first (DataFileWriter::Reserve).
//      Training goes on meanwhile; the checkpoint holds the state as of 1.
// A failure (I/O, a swap-in, cancellation) removes the new data file and
// leaves the previous checkpoint as it was.
//
// Restoring (CheckpointRestore): the directory's manifests, every session
// that wrote into it, are indexed by tensor (checkpoint/tensor_index.h).
// The new session takes the session-level state (steps, loss scaler, the
// delayed update, placement) of the manifest with its name, else of the
// first; each partition it registers takes its elements from whichever
// checkpointed slices of its tensor hold them, so the number of sessions
// (ranks) may differ from the checkpoint's, and training continues bit for
// bit as it would have.
//
// Thread-safety: a CheckpointWriter is driven by one thread (its Write is
// called from others); a CheckpointRestore is immutable after Open.
#ifndef OFFLOADD_ENGINE_CHECKPOINT_H_
#define OFFLOADD_ENGINE_CHECKPOINT_H_

#include <sys/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "checkpoint/format.h"
#include "checkpoint/tensor_index.h"
#include "engine/loss_scaler.h"
#include "engine/partition_store.h"
#include "swapper/pool_file.h"

namespace offload {

// What a session holds beyond its partition set.
struct SessionCheckpointState {
  std::string name;
  const LossScaler* scaler = nullptr;  // null without loss scaling
  int64_t delayed_update_after = -1;   // the automatic switch-on still to come
  // The checkpoint this one replaces stays beside it (<stem>.previous):
  // automatic checkpoints, so that a job's ranks find a step they all have.
  bool keep_previous = false;
  // Threads capturing its chunks in Finish (its caller and helpers it
  // starts), so as many writes, and with state on NVMe swap-ins, in
  // flight: a disk's bandwidth may need depth (fio on this project's VMs:
  // 16 MiB direct writes 1.45 GB/s one at a time, 3.67 GB/s 32 at once).
  int capture_threads = 1;
  // Keeping a session across a restart of offloadd with its pool in a file
  // (memory.pool_dir): a chunk whose bytes lie in `by_reference` (linked
  // as `memory_file`) is named there (Record.memory_offset, the extent
  // retained: PoolFile::Retain) instead of written; the rest, and what is
  // captured elsewhere (copied out of NVMe), is written as usual.
  PoolFile* by_reference = nullptr;
  std::string memory_file;
  // Who opened the session, where not offloadd's own user (Manifest.opened_by).
  std::optional<uid_t> user;
};

struct CheckpointSummary {
  std::string manifest;  // its path
  uint64_t partitions = 0;
  uint64_t bytes = 0;             // of the data file
  uint64_t referenced_bytes = 0;  // of those, named in the memory file (by_reference)
  uint64_t steps = 0;             // the session's, at the checkpoint
  uint64_t pause_us = 0;          // step 1: waiting for the step boundary and the image
  uint64_t wall_us = 0;
};

class CheckpointWriter : public ChunkSink {
 public:
  // Step 1, into `dir` (checkpoint::Directory::Prepare). `set` must
  // outlive the writer.
  static absl::StatusOr<std::unique_ptr<CheckpointWriter>> Begin(
      PartitionStore* set, const SessionCheckpointState& state, checkpoint::Directory dir);
  ~CheckpointWriter() override;

  // Step 2. Checks `cancelled` between chunks (CANCELLED).
  absl::StatusOr<CheckpointSummary> Finish(const std::atomic<bool>* cancelled = nullptr);
  // What is known after Begin: sizes, steps, the pause.
  const CheckpointSummary& begun() const { return summary_; }

  absl::Status Write(uint64_t id, uint64_t chunk, int block_kind,
                     absl::Span<const std::byte> bytes) override;

 private:
  CheckpointWriter(PartitionStore* set, checkpoint::Directory dir, std::string stem,
                   checkpoint::DataFileWriter file, const SessionCheckpointState& state)
      : set_(set),
        dir_(std::move(dir)),
        stem_(std::move(stem)),
        file_(std::move(file)),
        keep_previous_(state.keep_previous),
        capture_threads_(std::max(1, state.capture_threads)),
        by_reference_(state.by_reference) {}

  // Constant after Begin.
  PartitionStore* const set_;
  const checkpoint::Directory dir_;
  const std::string stem_;
  const checkpoint::DataFileWriter file_;
  const bool keep_previous_;
  const int capture_threads_;
  PoolFile* const by_reference_;
  std::atomic<uint64_t> referenced_bytes_{0};
  SetImage image_;
  // Partition id -> its index in image_ and manifest_.partitions().
  absl::flat_hash_map<uint64_t, size_t> index_;
  CheckpointSummary summary_;
  int64_t began_ns_ = 0;
  bool ended_ = false;  // EndCheckpoint called
  // Set once the layout above is complete: a call capturing a chunk the
  // moment copy-on-write starts waits for it.
  absl::Notification laid_out_;

  absl::Mutex mu_;
  checkpoint::Manifest manifest_ ABSL_GUARDED_BY(mu_);  // records' hashes filled by Write
};

class CheckpointRestore {
 public:
  // INVALID_ARGUMENT for a relative path; the index's errors (NOT_FOUND
  // without manifests, DATA_LOSS for a corrupted one, FAILED_PRECONDITION
  // for overlapping ones).
  // With `steps`, the checkpoint taken after that many steps (a kept
  // previous one where the latest is later: checkpoint::ReadManifests).
  static absl::StatusOr<std::unique_ptr<CheckpointRestore>> Open(
      const std::string& dir, const std::string& session_name,
      std::optional<uint64_t> steps = std::nullopt);

  // The session-level state to take.
  const checkpoint::Manifest& session_manifest() const { return *session_; }
  // The loss scaler's options and state, if the checkpoint had one.
  std::optional<std::pair<LossScalingOptions, LossScaler::State>> loss_scaler() const;
  // The state of a partition registered with `spec`: NOT_FOUND if the
  // checkpoint has no such tensor, FAILED_PRECONDITION if its slices do
  // not cover it, disagree with it (dtype), or hold pending gradients
  // sliced otherwise. The result reads from this object: keep it alive.
  absl::StatusOr<RestoredState> StateFor(const PartitionSpec& spec) const;

 private:
  std::unique_ptr<checkpoint::TensorIndex> index_;
  const checkpoint::Manifest* session_ = nullptr;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_CHECKPOINT_H_
