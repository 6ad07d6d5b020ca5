#include "engine/request_ring_server.h"

#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace offload {
namespace {

int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

int PollBudget::DefaultMax() {
  cpu_set_t set;
  int cpus = 0;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
  if (cpus <= 0) cpus = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, cpus / 2);
}

std::shared_ptr<RingServer> RingServer::Start(HostMemory mapping, Handler handler,
                                              absl::Duration spin,
                                              std::shared_ptr<PollBudget> budget) {
  std::shared_ptr<RingServer> server(
      new RingServer(std::move(mapping), std::move(handler), spin, std::move(budget)));
  ring::Layout* l = server->layout();
  l->magic = ring::kMagic;
  l->version = ring::kVersion;
  l->features = ring::kStepCalls | ring::kFetchIfReady;
  l->closed_reason = ring::kSessionClosed;
  l->client_sleeping.store(0);
  l->state.store(ring::kIdle, std::memory_order_release);
  // The thread keeps the server (its mapping, its handler) alive until it ends.
  server->thread_ = std::thread([self = server->shared_from_this()] { self->Serve(); });
  server->serving_id_.store(server->thread_.get_id());
  return server;
}

RingServer::~RingServer() {
  if (thread_.joinable()) thread_.detach();  // only when the thread itself drops the last reference
}

void RingServer::Stop(ring::ClosedReason why) {
  if (stopping_.exchange(true)) return;
  // A WaitForReset waits on reset_mu_'s condition: taken, it looks again
  // (stopping_ changed outside it: it slept its whole timeout).
  { absl::MutexLock wake(&reset_mu_); }
  layout()->closed_reason = why;
  layout()->state.store(ring::kClosed, std::memory_order_seq_cst);
  ring::FutexWake(&layout()->state);
  JoinOrDetach();
}

void RingServer::JoinOrDetach() {
  if (std::this_thread::get_id() == serving_id_.load()) {
    // Inside a call this thread runs: it ends after it. (One joining it
    // meanwhile holds join_mu_, and sees it end.)
    if (join_mu_.TryLock()) {
      if (thread_.joinable()) thread_.detach();
      join_mu_.Unlock();
    }
    return;
  }
  // Stop and EndDrain may both get here (a session closed during a
  // keeping stop's drain): one joins.
  absl::MutexLock lock(&join_mu_);
  if (thread_.joinable()) thread_.join();
}

void RingServer::Drain(absl::Duration patience) {
  BeginDrain(absl::Now() + patience);
  EndDrain();
}

void RingServer::BeginDrain(absl::Time deadline) {
  if (stopping_.load() || serving_id_.load() == std::this_thread::get_id()) return;
  drain_deadline_ns_.store(SteadyNowNs() +
                           std::max<int64_t>(0, absl::ToInt64Nanoseconds(deadline - absl::Now())));
  layout()->closed_reason = ring::kDaemonStopping;
  draining_.store(true, std::memory_order_seq_cst);
  ring::FutexWake(&layout()->state);
}

void RingServer::EndDrain() {
  if (draining_.load() && serving_id_.load() != std::this_thread::get_id()) JoinOrDetach();
  Stop(ring::kDaemonStopping);
}

void RingServer::Reset(std::function<void()> then) {
  {
    absl::MutexLock lock(&reset_mu_);
    reset_then_ = std::move(then);
    ++resets_asked_;
  }
  reset_pending_.store(true);
  ring::FutexWake(&layout()->state);  // the serving thread, if asleep
}

void RingServer::ExpectCall() {
  const int64_t spin = spin_ns_.load(std::memory_order_relaxed);
  if (spin <= 0) return;
  poll_until_ns_.store(SteadyNowNs() + spin, std::memory_order_seq_cst);
  if (asleep_.load(std::memory_order_seq_cst)) ring::FutexWake(&layout()->state);
}

bool RingServer::WaitForReset(absl::Duration timeout) {
  absl::MutexLock lock(&reset_mu_);
  auto done = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(reset_mu_) {
    return resets_done_ >= resets_asked_ || stopping_.load();
  };
  return reset_mu_.AwaitWithTimeout(absl::Condition(&done), timeout);
}

void RingServer::DoReset() {
  std::function<void()> then;
  uint64_t asked;
  {
    absl::MutexLock lock(&reset_mu_);
    then = std::move(reset_then_);
    reset_then_ = nullptr;
    asked = resets_asked_;
  }
  ring::Layout* l = layout();
  uint32_t s = l->state.load();
  while (s != ring::kClosed && s != ring::kIdle &&
         !l->state.compare_exchange_weak(s, ring::kIdle)) {
  }
  l->abandoned.store(0);
  l->client_sleeping.store(0);
  ring::FutexWake(&l->state);
  if (then) then();
  absl::MutexLock lock(&reset_mu_);
  resets_done_ = std::max(resets_done_, asked);
}

void RingServer::Serve() {
  ring::Layout* l = layout();
  while (!stopping_.load()) {
    if (reset_pending_.exchange(false)) DoReset();
    const uint32_t state = l->state.load(std::memory_order_acquire);
    if (draining_.load(std::memory_order_seq_cst) && state != ring::kPosted) {
      // Closed only between calls: from idle, or, past the patience, from
      // a call whose client never finished writing or reading it.
      uint32_t idle = ring::kIdle;
      if (l->state.compare_exchange_strong(idle, ring::kClosed, std::memory_order_seq_cst) ||
          SteadyNowNs() >= drain_deadline_ns_.load()) {
        l->state.store(ring::kClosed, std::memory_order_seq_cst);
        ring::FutexWake(&l->state);
        break;
      }
      ring::FutexWait(&l->state, idle, absl::Milliseconds(1));
      continue;
    }
    if (state != ring::kPosted) {
      const int64_t until = poll_until_ns_.load(std::memory_order_seq_cst);
      const int64_t now = SteadyNowNs();
      SetExpecting(now < until);
      if (expecting_ && budget_->MayPoll()) {
        PollBriefly();
        continue;
      }
      asleep_.store(true, std::memory_order_seq_cst);
      // A kick between the load above and the store is seen here.
      if (poll_until_ns_.load(std::memory_order_seq_cst) == until) {
        // Also woken by every change of the word (a client can only make
        // this thread look again) and by a kick; while expecting a call,
        // only until the window ends (then it stops counting as expecting).
        sleeps_.fetch_add(1, std::memory_order_relaxed);
        ring::FutexWait(&l->state, state,
                        expecting_ ? std::min(absl::Nanoseconds(until - now), absl::Seconds(1))
                                   : absl::Seconds(1));
      }
      asleep_.store(false, std::memory_order_relaxed);
      continue;
    }
    // Copied out before any check: the trainer may rewrite the mailbox.
    RingRequest request;
    const uint32_t op = ring::ReadOnce(l->op);
    request.flags = ring::ReadOnce(l->flags);
    const uint32_t count = ring::ReadOnce(l->count);
    std::atomic_thread_fence(std::memory_order_acquire);
    const bool bytes = op == ring::kStep;  // (its count is of bytes)
    if (count > (bytes ? ring::kMaxRequestBytes : ring::kMaxItems) || op < ring::kFetch ||
        op > ring::kStep) {
      Answer({absl::InvalidArgumentError(
                  absl::StrCat("request ring: op ", op, " with ", count,
                               bytes ? " bytes (at most " : " items (at most ",
                               bytes ? ring::kMaxRequestBytes : ring::kMaxItems, ")")),
              {},
              {}});
      continue;
    }
    request.op = static_cast<ring::Op>(op);
    if (bytes) {
      request.payload.assign(reinterpret_cast<const char*>(l->items), count);
    } else {
      request.items.assign(l->items, l->items + count);
    }
    // A step, or a wait for one, may take its time: not counted as polling
    // meanwhile.
    if (request.op == ring::kWaitStep || request.op == ring::kStep) SetExpecting(false);
    const RingAnswer answer = handler_(request);
    if (stopping_.load()) break;          // the session went during the call
    if (reset_pending_.load()) continue;  // its client died: no answer, reset
    Answer(answer);
  }
  SetExpecting(false);
}

void RingServer::SetExpecting(bool expecting) {
  if (budget_ == nullptr || expecting == expecting_) return;
  expecting ? budget_->Enter() : budget_->Leave();
  expecting_ = expecting;
}

void RingServer::PollBriefly() {
  // About a microsecond of PAUSEs per burst; a yield to anything else
  // runnable here every 32 bursts (a yield per burst cost 3 us at the
  // median: a request posted during the system call waits for it).
  const ring::Layout* l = layout();
  for (int i = 0; i < 16 && l->state.load(std::memory_order_acquire) != ring::kPosted; ++i) {
    ring::CpuRelax();
  }
  if (++polls_ % 32 == 0) sched_yield();
}

void RingServer::Answer(const RingAnswer& answer) {
  ring::Layout* l = layout();
  absl::Status status = answer.status;
  if (status.ok() && answer.payload.size() > ring::kMessageBytes) {
    status = absl::InternalError(absl::StrCat("request ring: an answer of ", answer.payload.size(),
                                              " bytes does not fit its ", ring::kMessageBytes));
  }
  l->code = static_cast<int32_t>(status.code());
  const absl::string_view message =
      status.ok() ? absl::string_view(answer.payload) : status.message();
  // Copied by the lengths computed here, then those written: the trainer
  // may rewrite the mailbox's fields meanwhile (never read back).
  const uint32_t message_bytes =
      static_cast<uint32_t>(std::min(message.size(), ring::kMessageBytes));
  std::memcpy(l->message, message.data(), message_bytes);
  ring::WriteOnce(l->message_bytes, message_bytes);
  const uint32_t out_count =
      static_cast<uint32_t>(std::min<size_t>(answer.locations.size(), ring::kMaxItems));
  std::memcpy(l->locations, answer.locations.data(), out_count * sizeof(ring::Location));
  ring::WriteOnce(l->out_count, out_count);
  uint32_t posted = ring::kPosted;
  if (!l->state.compare_exchange_strong(posted, ring::kAnswered, std::memory_order_seq_cst)) {
    return;
  }
  // A client that gave up (its deadline) reads no answer: free the mailbox
  // for the next call (or the client frees it, if it gave up after this).
  if (l->abandoned.load(std::memory_order_seq_cst) != 0) {
    uint32_t answered = ring::kAnswered;
    l->state.compare_exchange_strong(answered, ring::kIdle, std::memory_order_seq_cst);
    ring::FutexWake(&l->state);
    return;
  }
  if (l->client_sleeping.load(std::memory_order_seq_cst) != 0) ring::FutexWake(&l->state);
}

}  // namespace offload
