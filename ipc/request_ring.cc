#include "ipc/request_ring.h"

#include <linux/futex.h>
#include <poll.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace offload::ring {
namespace {

// The connection to the daemon is gone (it died: its end closed).
bool Hungup(int connection) {
  pollfd p{connection, POLLRDHUP, 0};
  return poll(&p, 1, 0) == 1 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0;
}

}  // namespace

size_t RingBytes() {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return (sizeof(Layout) + page - 1) / page * page;
}

void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout) {
  const timespec ts = absl::ToTimespec(timeout);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

void FutexWake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

Client::Answer Client::Call(Op op, uint32_t flags, absl::Span<const Item> items,
                            absl::Duration timeout) {
  return Post(op, flags, static_cast<uint32_t>(items.size()), items.data(),
              items.size() * sizeof(Item), timeout);
}

Client::Answer Client::Call(Op op, absl::string_view request, absl::Duration timeout) {
  if (request.size() > kMaxRequestBytes) {
    return {absl::InvalidArgumentError(absl::StrCat("a request of ", request.size(),
                                                    " bytes does not fit the request ring (",
                                                    kMaxRequestBytes, ")")),
            {},
            {}};
  }
  return Post(op, 0, static_cast<uint32_t>(request.size()), request.data(), request.size(),
              timeout);
}

Client::Answer Client::Post(Op op, uint32_t flags, uint32_t count, const void* data, size_t bytes,
                            absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  auto gone = [&](uint32_t state) -> absl::Status {
    if (state == kClosed) {
      if (ring_->closed_reason == kDaemonStopping) {
        return absl::UnavailableError(
            "offloadd is stopping (it closed this session's request ring); retry against its "
            "successor");
      }
      return absl::FailedPreconditionError("the daemon closed this session's request ring");
    }
    if (Hungup(connection_)) {
      return absl::UnavailableError("offloadd went away (its arena channel connection closed)");
    }
    if (absl::Now() > deadline) {
      return absl::DeadlineExceededError(absl::StrCat("no answer through the request ring within ",
                                                      absl::FormatDuration(timeout)));
    }
    return absl::OkStatus();
  };
  // 1. Claim the mailbox.
  for (;;) {
    uint32_t expected = kIdle;
    if (ring_->state.compare_exchange_strong(expected, kClaimed, std::memory_order_acquire)) break;
    if (absl::Status s = gone(expected); !s.ok()) return {s, {}, {}};
    FutexWait(&ring_->state, expected, absl::Milliseconds(50));
  }
  ring_->abandoned.store(0, std::memory_order_relaxed);
  ring_->op = op;
  ring_->flags = flags;
  ring_->count = count;
  std::memcpy(ring_->items, data, bytes);
  // 2. Post: from the claim only. The daemon may have closed the mailbox
  // since (the session closed: it writes kClosed over any state), and a
  // post over that would wait out the whole deadline, then leave the
  // mailbox posted for every later call.
  uint32_t claimed = kClaimed;
  if (!ring_->state.compare_exchange_strong(claimed, kPosted, std::memory_order_seq_cst)) {
    absl::Status s = gone(claimed);
    return {s.ok() ? absl::AbortedError(
                         absl::StrCat("the request ring's mailbox changed under its claim (state ",
                                      claimed, "); the call did not happen"))
                   : s,
            {},
            {}};
  }
  FutexWake(&ring_->state);
  // 4. Wait: spin first (the daemon usually answers within microseconds),
  // then sleep.
  uint32_t state = kPosted;
  const absl::Time spin_until = absl::Now() + spin_;
  for (int i = 0;; ++i) {
    state = ring_->state.load(std::memory_order_acquire);
    if (state != kPosted) break;
    CpuRelax();
    if (i % 32 == 31 && absl::Now() > spin_until) break;
  }
  while (state == kPosted) {
    ring_->client_sleeping.store(1, std::memory_order_seq_cst);
    state = ring_->state.load(std::memory_order_seq_cst);
    if (state == kPosted) FutexWait(&ring_->state, kPosted, absl::Milliseconds(50));
    ring_->client_sleeping.store(0, std::memory_order_relaxed);
    state = ring_->state.load(std::memory_order_acquire);
    if (state == kPosted) {
      if (absl::Status s = gone(state); !s.ok()) {
        // Give the call up; whoever comes second frees the mailbox.
        ring_->abandoned.store(1, std::memory_order_seq_cst);
        uint32_t answered = kAnswered;
        if (ring_->state.compare_exchange_strong(answered, kIdle, std::memory_order_seq_cst)) {
          FutexWake(&ring_->state);
        }
        return {s, {}, {}};
      }
    }
  }
  if (state != kAnswered) {
    if (state == kClosed) return {gone(state), {}, {}};
    return {absl::AbortedError(
                "the daemon reset this session's request ring (its trainer was taken for gone); "
                "the call may or may not have happened"),
            {},
            {}};
  }
  Answer answer;
  const auto code = static_cast<absl::StatusCode>(ring_->code);
  if (code != absl::StatusCode::kOk) {
    const size_t n = std::min<size_t>(ring_->message_bytes, kMessageBytes);
    answer.status = absl::Status(code, std::string(ring_->message, n));
  } else {
    const uint32_t n = std::min(ring_->out_count, kMaxItems);
    answer.locations.assign(ring_->locations, ring_->locations + n);
    answer.payload.assign(ring_->message, std::min<size_t>(ring_->message_bytes, kMessageBytes));
  }
  // Back to idle, unless the daemon closed the mailbox meanwhile.
  uint32_t answered = kAnswered;
  ring_->state.compare_exchange_strong(answered, kIdle, std::memory_order_release);
  FutexWake(&ring_->state);  // a claimant waiting
  return answer;
}

}  // namespace offload::ring
