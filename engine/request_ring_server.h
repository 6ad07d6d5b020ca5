// The daemon's half of a session's request ring (ipc/request_ring.h): one
// thread, asleep on the mailbox's futex until the trainer posts, that
// copies the request out of shared memory, has `handler` perform it (the
// session manager's Fetch, Release, ReturnGradients, Pending, Step and WaitStep:
// the same calls and checks as over gRPC), and writes the answer back.
//
// Waking a sleeping thread costs about 100 us on a virtual machine whose
// idle CPU has halted (3-4 us while it still polls), five times the budget
// of a resident fetch. So after each call of the session ends (through the
// ring or gRPC: ExpectCall), the thread polls the mailbox for a short
// window (`spin`, server.ring_spin_us) before it sleeps: the first fetch
// after a step, or the next of a burst, finds it awake. While polling it
// yields the CPU to any other runnable thread, so an oversubscribed node
// loses little to it; an idle one burns at most `spin` of a core per call.
// Polling pays only where cores are idle: rings poll only while the rings
// expecting a call (in their window) are at most half the node's cores
// (PollBudget); beyond that every ring sleeps, as without polling. (Eight
// trainers on two cores, with even one ring polling, made calls 15x slower
// at the median: yielding does not stop a polling thread from taking its
// CFS share.)
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
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "base/host_memory.h"
#include "ipc/request_ring.h"

namespace offload {

// Whether request-ring threads may poll: shared by all sessions' rings,
// it counts the rings expecting a call (within their window) and lets them
// poll while they are at most `max_expecting`.
class PollBudget {
 public:
  explicit PollBudget(int max_expecting) : max_(max_expecting) {}
  // Half the cores this process may run on, at least one.
  static int DefaultMax();
  void Enter() { expecting_.fetch_add(1, std::memory_order_relaxed); }
  void Leave() { expecting_.fetch_sub(1, std::memory_order_relaxed); }
  bool MayPoll() const { return expecting_.load(std::memory_order_relaxed) <= max_; }
  int expecting() const { return expecting_.load(std::memory_order_relaxed); }

 private:
  const int max_;
  std::atomic<int> expecting_{0};
};

struct RingRequest {
  ring::Op op;
  uint32_t flags;
  std::vector<ring::Item> items;
  std::string payload;  // ring::kStep's request message, as the mailbox held it
};

struct RingAnswer {
  absl::Status status;
  std::vector<ring::Location> locations;
  // On success, what `message` carries (ring::kPendingGradients' and
  // ring::kWaitStep's response); past ring::kMessageBytes, INTERNAL.
  std::string payload;
};

class RingServer : public std::enable_shared_from_this<RingServer> {
 public:
  using Handler = std::function<RingAnswer(const RingRequest&)>;

  // Initialises the mailbox in `mapping` (ring::RingBytes() bytes) and
  // starts serving it.
  // `budget`: shared with the other sessions' rings; none: this ring never
  // polls.
  static std::shared_ptr<RingServer> Start(HostMemory mapping, Handler handler,
                                           absl::Duration spin = absl::ZeroDuration(),
                                           std::shared_ptr<PollBudget> budget = nullptr);
  ~RingServer();

  // Closes the mailbox (clients see kClosed, and `why`) and ends the
  // thread.
  void Stop(ring::ClosedReason why = ring::kSessionClosed);
  // Closes the mailbox between calls and ends the thread: a call posted (or
  // being written) is served and answered first, and the mailbox closes
  // once its client has read the answer (or after `patience`, for a client
  // that never does), so that every call either happened and was answered
  // or was refused. Then as Stop.
  // Closes with kDaemonStopping: what drains a ring is offloadd stopping.
  void Drain(absl::Duration patience);
  // Drain in two halves, for many rings to one deadline at once: BeginDrain
  // asks the serving thread to close (patient until `deadline`), EndDrain
  // waits for it, then stops.
  void BeginDrain(absl::Time deadline);
  void EndDrain();
  // Frees the mailbox of a call its client died in: the serving thread,
  // once the call it may be running ends (unanswered), sets the mailbox
  // back to idle (unless closed) and runs `then` (what that call held
  // goes). Returns at once.
  void Reset(std::function<void()> then = nullptr);
  // Waits until every Reset asked for so far is done (the call it waited
  // for ended); false after `timeout`.
  bool WaitForReset(absl::Duration timeout);

  // A call of the session just ended; the next is likely soon: poll the
  // mailbox for `spin` from now instead of sleeping. Cheap (an atomic
  // store; a futex wake only when the thread sleeps). A kick racing the
  // thread's falling asleep may be lost: that costs one slow wake-up, never
  // a call.
  void ExpectCall();
  void SetSpin(absl::Duration spin) { spin_ns_.store(absl::ToInt64Nanoseconds(spin)); }
  // How often the thread went to sleep on the futex (for tests).
  uint64_t sleeps() const { return sleeps_.load(std::memory_order_relaxed); }

 private:
  RingServer(HostMemory mapping, Handler handler, absl::Duration spin,
             std::shared_ptr<PollBudget> budget)
      : mapping_(std::move(mapping)),
        handler_(std::move(handler)),
        budget_(std::move(budget)),
        spin_ns_(absl::ToInt64Nanoseconds(spin)) {}
  // Polls the mailbox for a few microseconds, then yields the CPU.
  void PollBriefly();
  // Counts this ring in budget_'s rings expecting a call, or not. Serving
  // thread only.
  void SetExpecting(bool expecting);
  ring::Layout* layout() const { return reinterpret_cast<ring::Layout*>(mapping_.data()); }
  void Serve();
  void Answer(const RingAnswer& answer);
  void DoReset();

  const HostMemory mapping_;
  const Handler handler_;
  const std::shared_ptr<PollBudget> budget_;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> draining_{false};  // Drain: close between calls
  std::atomic<int64_t> drain_deadline_ns_{0};
  std::atomic<int64_t> spin_ns_;
  // Steady-clock nanoseconds until which the thread polls; whether it
  // sleeps on the futex (then ExpectCall wakes it).
  std::atomic<int64_t> poll_until_ns_{0};
  std::atomic<bool> asleep_{false};
  std::atomic<uint64_t> sleeps_{0};
  bool expecting_ = false;  // serving thread only
  uint64_t polls_ = 0;      // serving thread only
  absl::Mutex reset_mu_;
  std::function<void()> reset_then_ ABSL_GUARDED_BY(reset_mu_);
  std::atomic<bool> reset_pending_{false};
  uint64_t resets_asked_ ABSL_GUARDED_BY(reset_mu_) = 0;
  uint64_t resets_done_ ABSL_GUARDED_BY(reset_mu_) = 0;
  // Joins the serving thread, or (called on it) detaches it; once, whoever
  // asks first.
  void JoinOrDetach();
  absl::Mutex join_mu_;
  std::thread thread_;  // joined or detached under join_mu_ (Start sets it)
  std::atomic<std::thread::id> serving_id_{};
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_REQUEST_RING_SERVER_H_
