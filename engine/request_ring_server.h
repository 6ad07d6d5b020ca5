// The daemon's half of a session's request ring (ipc/request_ring.h): one
// thread, asleep on the mailbox's futex until the trainer posts, that
// copies the request out of shared memory, has `handler` perform it (the
// session manager's Fetch, Release and ReturnGradients: the same calls and
// checks as over gRPC), and writes the answer back.
//
// Nothing in the mailbox is trusted: the request is copied out before it is
// checked (count within kMaxItems, a known op), so a trainer rewriting it
// meanwhile changes nothing; it can only make its own calls fail.
//
// Thread-safety: Stop may be called from any thread, also from inside the
// handler (the session closed by the call it runs): then the thread is let
// go instead of joined, and ends after that call.
#ifndef OFFLOADD_ENGINE_REQUEST_RING_SERVER_H_
#define OFFLOADD_ENGINE_REQUEST_RING_SERVER_H_

#include <atomic>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "base/host_memory.h"
#include "ipc/request_ring.h"

namespace offload {

struct RingRequest {
  ring::Op op;
  uint32_t flags;
  std::vector<ring::Item> items;
};

struct RingAnswer {
  absl::Status status;
  std::vector<ring::Location> locations;
};

class RingServer : public std::enable_shared_from_this<RingServer> {
 public:
  using Handler = std::function<RingAnswer(const RingRequest&)>;

  // Initialises the mailbox in `mapping` (ring::RingBytes() bytes) and
  // starts serving it.
  static std::shared_ptr<RingServer> Start(HostMemory mapping, Handler handler);
  ~RingServer();

  // Closes the mailbox (clients see kClosed) and ends the thread.
  void Stop();
  // Frees the mailbox of a call its client died in: the serving thread,
  // once the call it may be running ends (unanswered), sets the mailbox
  // back to idle (unless closed) and runs `then` (what that call held
  // goes). Returns at once.
  void Reset(std::function<void()> then = nullptr);
  // Waits until every Reset asked for so far is done (the call it waited
  // for ended); false after `timeout`.
  bool WaitForReset(absl::Duration timeout);

 private:
  RingServer(HostMemory mapping, Handler handler)
      : mapping_(std::move(mapping)), handler_(std::move(handler)) {}
  ring::Layout* layout() const { return reinterpret_cast<ring::Layout*>(mapping_.data()); }
  void Serve();
  void Answer(const RingAnswer& answer);
  void DoReset();

  const HostMemory mapping_;
  const Handler handler_;
  std::atomic<bool> stopping_{false};
  absl::Mutex reset_mu_;
  std::function<void()> reset_then_ ABSL_GUARDED_BY(reset_mu_);
  std::atomic<bool> reset_pending_{false};
  uint64_t resets_asked_ ABSL_GUARDED_BY(reset_mu_) = 0;
  uint64_t resets_done_ ABSL_GUARDED_BY(reset_mu_) = 0;
  std::thread thread_;
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_REQUEST_RING_SERVER_H_
