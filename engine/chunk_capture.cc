#include "engine/chunk_capture.h"

#include <utility>

namespace offload {

void ChunkCapture::Add(uint64_t id, std::vector<int> kinds, uint64_t chunks) {
  absl::MutexLock lock(&mu_);
  partitions_[id] = Partition{std::move(kinds), std::vector<ChunkState>(chunks)};
}

void ChunkCapture::Capture(uint64_t id, uint64_t chunk) {
  std::vector<int> kinds;
  {
    absl::MutexLock lock(&mu_);
    for (;;) {
      if (finished_) return;
      auto it = partitions_.find(id);
      if (it == partitions_.end() || chunk >= it->second.chunks.size()) return;
      ChunkState& state = it->second.chunks[chunk];
      if (state == ChunkState::kDone) return;
      if (state == ChunkState::kPending && !status_.ok()) {
        state = ChunkState::kDone;  // the checkpoint failed already: no more I/O for it
        return;
      }
      if (state == ChunkState::kPending) {
        state = ChunkState::kCapturing;
        kinds = it->second.kinds;
        ++running_;
        break;
      }
      changed_.Wait(&mu_);  // another thread is capturing it
    }
  }
  // Outside the lock: swap-ins and file writes take time.
  absl::Status status;
  for (int kind : kinds) {
    status = read_(id, chunk, kind, sink_, &staging_);
    if (!status.ok()) break;
  }
  absl::MutexLock lock(&mu_);
  partitions_[id].chunks[chunk] = ChunkState::kDone;  // failed or not, nobody waits for it again
  if (!status.ok() && status_.ok()) status_ = status;
  --running_;
  changed_.SignalAll();
}

absl::Status ChunkCapture::Finish() {
  absl::MutexLock lock(&mu_);
  finished_ = true;
  while (running_ > 0) changed_.Wait(&mu_);
  return status_;
}

}  // namespace offload
