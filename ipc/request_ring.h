// The shared-memory fast path for a session's most frequent calls (fetch,
// release, return gradients, and the step protocol's pending gradients and
// wait for an overlapped step): a one-request mailbox in the session's arena
// with futex wake-ups, so that these calls cost two context switches
// instead of a gRPC round trip. gRPC stays for everything else (and for
// calls too large for the mailbox).
//
// Protocol (state is the futex word; one request at a time):
//   1. client: CAS state kIdle -> kClaimed (another thread or process of the
//      session waits for kIdle), writes op, flags, count and items;
//   2. client: state = kPosted, FUTEX_WAKE;
//   3. daemon (one thread per session, asleep in FUTEX_WAIT while the state
//      is not kPosted): copies the request out of shared memory, checks it
//      (nothing in the mailbox is trusted: the trainer can write it at any
//      time), performs the calls, writes code, message and locations,
//      state = kAnswered, FUTEX_WAKE if the client sleeps;
//   4. client: spins briefly, then sleeps, until kAnswered; copies the
//      answer out; state = kIdle, FUTEX_WAKE (a waiting claimant). A client
//      that gives up (its deadline) sets `abandoned`; the daemon's answer
//      then frees the mailbox instead.
// kPendingGradients, kWaitStep and kStep (where `features` has kStepCalls)
// name no item; kStep's request is the gRPC StepRequest serialized into the
// items' memory (`count` bytes, at most kMaxRequestBytes; its session field
// is ignored: the mailbox is the session's). Their answer, on success, is
// the gRPC call's response message (GetPendingGradientsResponse,
// StepResponse) serialized into `message` (message_bytes long). A
// kWaitStep holds the mailbox until the step ends; a kStep until it is
// decided (or done, unless it overlaps).
// The daemon resets the mailbox to kIdle when the session's trainer went
// away (a restarted one may resume it); a call caught by that is ABORTED.
// The daemon stops serving with state kClosed (and `closed_reason` says
// why: the session closed, or offloadd is stopping). A client whose daemon dies
// sees the arena channel's connection close while it waits: UNAVAILABLE.
#ifndef OFFLOADD_IPC_REQUEST_RING_H_
#define OFFLOADD_IPC_REQUEST_RING_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace offload::ring {

inline constexpr uint32_t kMagic = 0x524c464f;  // "OFLR"
inline constexpr uint32_t kVersion = 4;
// What a daemon's mailbox serves beyond fetch, release and return (its
// `features`; zero from daemons before them, whose clients use gRPC).
inline constexpr uint32_t kStepCalls = 1;     // kPendingGradients, kWaitStep and kStep
inline constexpr uint32_t kFetchIfReady = 2;  // kFetch takes kIfReady
// How long a caller spins for the answer by default before it sleeps on
// the futex: longer than the daemon takes to answer a resident fetch even
// when woken from sleep (p99 15-22 us measured), so an idle node answers
// without a second sleep; an oversubscribed one (more trainers than cores)
// loses at most this much CPU per call to spinning.
inline constexpr absl::Duration kDefaultSpin = absl::Microseconds(100);
// Most partitions one call through the mailbox may name; larger calls go
// through gRPC.
inline constexpr uint32_t kMaxItems = 512;
inline constexpr size_t kMessageBytes = 1024;

enum Op : uint32_t {
  kFetch = 1,
  kRelease = 2,
  kReturnGradients = 3,
  kPendingGradients = 4,
  kWaitStep = 5,
  kStep = 6,
};
enum State : uint32_t { kIdle = 0, kClaimed = 1, kPosted = 2, kAnswered = 3, kClosed = 4 };
// Why a mailbox closed: its session closed (a call then is
// FAILED_PRECONDITION), or offloadd is stopping (UNAVAILABLE, as its gRPC
// calls are then).
enum ClosedReason : uint32_t { kSessionClosed = 0, kDaemonStopping = 1 };
// Request flags.
inline constexpr uint32_t kGrads = 1;        // fetch: hold the gradient buffers too
inline constexpr uint32_t kWritable = 2;     // fetch: the trainer changes the parameters
inline constexpr uint32_t kThenRelease = 4;  // return: then release the partitions
inline constexpr uint32_t kHandOver = 8;  // return: the step reads the buffers (proto's hand_over)
inline constexpr uint32_t kIfReady = 16;  // fetch with kGrads: proto's if_ready (ABORTED, no wait)
// The words of that refusal (ABORTED, also through gRPC), which tell it from
// the mailbox's own ABORTED (a reset: the call may or may not have happened).
inline constexpr char kNotReadyWords[] = "is still being read by the step (asked if ready";
inline bool IsNotReady(const absl::Status& s) {
  return absl::IsAborted(s) && absl::StrContains(s.message(), kNotReadyWords);
}

// Item flags.
inline constexpr uint32_t kItemStats = 1;  // return: sq_norm and nonfinite are set (proto's stats)

// A partition named by a request: its id, and for a gradient return what
// the trainer wrote (numel, dtype as cpu_adam's DType) and, with
// kItemStats, its statistics of it (GradientBuffer.stats).
struct Item {
  uint64_t id = 0;
  uint64_t numel = 0;
  uint32_t dtype = 0;
  uint32_t flags = 0;  // kItemStats; other bits are refused
  double sq_norm = 0;
  uint64_t nonfinite = 0;
};
static_assert(sizeof(Item) == 40 && std::is_trivially_copyable_v<Item>,
              "the mailbox's layout is shared with the other side");

// A held partition, as PartitionLocation says it (the name aside).
struct Location {
  uint64_t id, numel, step;
  uint64_t params_offset, params_bytes;
  uint64_t grads_offset, grads_bytes;
  uint64_t span_offset, span_bytes;
  uint64_t master_init_offset, master_init_bytes;
  uint32_t param_dtype, grad_dtype;
  uint32_t restored;
  uint32_t huge_pages;  // PartitionLocation.huge_pages (0 from daemons before it)
};

struct Layout {
  std::atomic<uint32_t> state;
  std::atomic<uint32_t> client_sleeping;
  // The posted call's client gave up waiting (its deadline): whichever of
  // the daemon (answering) and the client (giving up) comes second sets
  // the mailbox back to idle.
  std::atomic<uint32_t> abandoned;
  uint32_t magic;
  uint32_t version;
  // Why the state is kClosed: ClosedReason, written before it.
  uint32_t closed_reason;
  // The request.
  uint32_t op;
  uint32_t flags;
  uint32_t count;
  uint32_t pad0;
  Item items[kMaxItems];
  // The answer.
  int32_t code;  // absl::StatusCode
  uint32_t message_bytes;
  uint32_t out_count;
  uint32_t features;  // kStepCalls; written by the daemon once, at the start
  char message[kMessageBytes];
  Location locations[kMaxItems];
};

// A field of the mailbox the other side may write at any moment, read (or
// written) exactly once, as the kernel's READ_ONCE and WRITE_ONCE: the value
// checked is the value used, never a second load of what a hostile trainer
// rewrote in between (a plain field lets the compiler load it again).
template <typename T>
T ReadOnce(const T& field) {
  return *static_cast<const volatile T*>(&field);
}
template <typename T>
void WriteOnce(T& field, T value) {
  *static_cast<volatile T*>(&field) = value;
}

// The most bytes a kStep request carries (the items' memory).
inline constexpr uint32_t kMaxRequestBytes = kMaxItems * sizeof(Item);

// The mailbox's size in the arena: whole pages.
size_t RingBytes();

// FUTEX_WAIT while *word == expected, at most `timeout` (shared, not
// private: the word is in memory two processes map).
void FutexWait(std::atomic<uint32_t>* word, uint32_t expected, absl::Duration timeout);
// One iteration of a spin-wait loop (the PAUSE instruction on x86).
inline void CpuRelax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}
void FutexWake(std::atomic<uint32_t>* word);

// The client's half. One call at a time per mailbox (Call claims it).
class Client {
 public:
  // `ring` is the mapped mailbox; `connection` the arena channel's
  // connection (watched while waiting: its close means the daemon died).
  Client(Layout* ring, int connection, absl::Duration spin = kDefaultSpin)
      : ring_(ring), connection_(connection), spin_(spin) {}

  struct Answer {
    absl::Status status;
    std::vector<Location> locations;
    std::string payload;  // kPendingGradients' and kWaitStep's response message
  };
  // FAILED_PRECONDITION if the daemon closed the mailbox (the session is
  // gone); UNAVAILABLE if the daemon died; DEADLINE_EXCEEDED after
  // `timeout`.
  Answer Call(Op op, uint32_t flags, absl::Span<const Item> items, absl::Duration timeout);
  // A call whose request is a message's bytes (kStep): INVALID_ARGUMENT
  // past kMaxRequestBytes.
  Answer Call(Op op, absl::string_view request, absl::Duration timeout);

 private:
  // Claims the mailbox, writes op, flags, count and `bytes` of `data` into
  // the items' memory, posts and waits for the answer.
  Answer Post(Op op, uint32_t flags, uint32_t count, const void* data, size_t bytes,
              absl::Duration timeout);

  Layout* const ring_;
  const int connection_;
  const absl::Duration spin_;
};

}  // namespace offload::ring

#endif  // OFFLOADD_IPC_REQUEST_RING_H_
