// Copy-on-write for one checkpoint of a partition store: each chunk of each
// partition in the checkpoint's image goes to the sink exactly once, as it
// was when the checkpoint began, whoever gets to it first: the writer
// walking every chunk, or a call about to change the chunk (the store
// notifies Capture before it changes one). A Capture of a chunk another
// thread is capturing waits for it; after the first failure, chunks not
// captured yet are given up (no more I/O for a failed checkpoint), and
// Finish returns that failure.
//
//   ChunkCapture capture(sink, read_block);   // PartitionStore::BeginCheckpoint
//   capture.Add(id, kinds, chunks);           // every partition in the image
//   capture.Capture(id, chunk);               // the writer, or before a change
//   capture.Finish();                         // PartitionStore::EndCheckpoint
//
// The capture knows which chunks went; where a block rests and how it is
// read is the store's (ReadBlock).
//
// Thread-safety: thread-safe. ReadBlock runs without the capture's lock,
// from every thread that captures.
#ifndef OFFLOADD_ENGINE_CHUNK_CAPTURE_H_
#define OFFLOADD_ENGINE_CHUNK_CAPTURE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "base/host_memory.h"
#include "engine/checkpoint_image.h"

namespace offload {

class ChunkCapture {
 public:
  // A buffer for blocks the host pool cannot take in, copied out of where
  // they rest instead (allocated by the first ReadBlock that needs it; one
  // at a time uses it). It lives as long as the capture.
  struct Staging {
    absl::Mutex mu;
    HostMemory memory ABSL_GUARDED_BY(mu);
  };
  // Gives block `block_kind` of chunk `chunk` of partition `id` to `sink`.
  using ReadBlock = std::function<absl::Status(uint64_t id, uint64_t chunk, int block_kind,
                                               ChunkSink* sink, Staging* staging)>;

  ChunkCapture(ChunkSink* sink, ReadBlock read) : sink_(sink), read_(std::move(read)) {}
  ChunkCapture(const ChunkCapture&) = delete;
  ChunkCapture& operator=(const ChunkCapture&) = delete;

  // Before any Capture: partition `id`, its `chunks` chunks, each of the
  // block kinds `kinds` (in the order they are written).
  void Add(uint64_t id, std::vector<int> kinds, uint64_t chunks) ABSL_LOCKS_EXCLUDED(mu_);
  // Chunk `chunk` of partition `id` to the sink unless done (waiting if
  // another thread is at it); nothing for a partition or chunk not added,
  // or once Finish began.
  void Capture(uint64_t id, uint64_t chunk) ABSL_LOCKS_EXCLUDED(mu_);
  // Once no Capture runs: the first failure of any, else OK. Captures
  // after it do nothing.
  absl::Status Finish() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  enum class ChunkState : uint8_t { kPending, kCapturing, kDone };
  struct Partition {
    std::vector<int> kinds;
    std::vector<ChunkState> chunks;
  };

  ChunkSink* const sink_;
  const ReadBlock read_;
  Staging staging_;

  absl::Mutex mu_;
  absl::CondVar changed_;  // a capture ended
  absl::flat_hash_map<uint64_t, Partition> partitions_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_CHUNK_CAPTURE_H_
