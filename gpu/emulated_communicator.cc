#include "gpu/emulated_communicator.h"

#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"

namespace offload::gpu {

// One rank's collective, as issued.
struct EmulatedCommunicator::Call {
  bool gather = true;
  ReduceOp op = ReduceOp::kSum;
  std::vector<GatherItem> gathers;
  std::vector<ScatterItem> scatters;

  std::string Describe() const {
    std::vector<uint64_t> sizes;
    if (gather) {
      for (const GatherItem& g : gathers) sizes.push_back(g.bytes);
    } else {
      for (const ScatterItem& s : scatters) sizes.push_back(s.count);
    }
    return absl::StrCat(
        gather ? "all-gather"
               : (op == ReduceOp::kAvg ? "reduce-scatter (avg)" : "reduce-scatter (sum)"),
        " of ", sizes.size(), " items (", absl::StrJoin(sizes, ", "),
        gather ? " bytes)" : " floats)");
  }
  bool Matches(const Call& o) const {
    if (gather != o.gather || op != o.op || gathers.size() != o.gathers.size() ||
        scatters.size() != o.scatters.size()) {
      return false;
    }
    for (size_t i = 0; i < gathers.size(); ++i) {
      if (gathers[i].bytes != o.gathers[i].bytes) return false;
    }
    for (size_t i = 0; i < scatters.size(); ++i) {
      if (scatters[i].count != o.scatters[i].count) return false;
    }
    return true;
  }
};

struct EmulatedCommunicator::Group {
  struct Round {
    std::vector<std::unique_ptr<Call>> calls;
    int arrived = 0;
    int left = 0;
    bool done = false;
  };
  Group(int size, absl::Duration timeout) : size(size), timeout(timeout) {}

  // Rank `rank`'s collective number `seq` is due on its stream: waits for
  // the others', and the last to arrive runs it for all.
  void Arrive(uint64_t seq, int rank, std::unique_ptr<Call> call) ABSL_LOCKS_EXCLUDED(mu) {
    absl::MutexLock lock(&mu);
    if (!broken.ok()) return;
    Round& round = rounds[seq];
    if (round.calls.empty()) round.calls.resize(size);
    round.calls[rank] = std::move(call);
    if (++round.arrived == size) {
      Run(seq, round);
      round.done = true;
    } else {
      auto done = [&round, this]()
                      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return round.done || !broken.ok(); };
      if (!mu.AwaitWithTimeout(absl::Condition(&done), timeout) && broken.ok()) {
        std::vector<int> missing;
        for (int r = 0; r < size; ++r) {
          if (round.calls[r] == nullptr) missing.push_back(r);
        }
        broken = absl::DeadlineExceededError(
            absl::StrCat("collective #", seq, " (", round.calls[rank]->Describe(), "): rank(s) ",
                         absl::StrJoin(missing, ", "), " did not issue it within ",
                         absl::FormatDuration(timeout)));
      }
    }
    if (++round.left == round.arrived && (round.done || !broken.ok())) rounds.erase(seq);
  }

  void Run(uint64_t seq, const Round& round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const Call& first = *round.calls[0];
    for (int r = 1; r < size; ++r) {
      if (!round.calls[r]->Matches(first)) {
        broken = absl::FailedPreconditionError(absl::StrCat("collective #", seq, ": rank 0 issued ",
                                                            first.Describe(), ", rank ", r, " ",
                                                            round.calls[r]->Describe()));
        return;
      }
    }
    if (first.gather) {
      for (size_t i = 0; i < first.gathers.size(); ++i) {
        const uint64_t bytes = first.gathers[i].bytes;
        for (int to = 0; to < size; ++to) {
          char* recv = static_cast<char*>(round.calls[to]->gathers[i].recv);
          for (int from = 0; from < size; ++from) {
            // memmove: in place, a rank's own part is its send.
            std::memmove(recv + from * bytes, round.calls[from]->gathers[i].send, bytes);
          }
        }
      }
      return;
    }
    // Every result first, then the writes: a recv may alias a send.
    for (size_t i = 0; i < first.scatters.size(); ++i) {
      const uint64_t count = first.scatters[i].count;
      std::vector<std::vector<float>> results(size, std::vector<float>(count, 0.0f));
      for (int to = 0; to < size; ++to) {
        for (int from = 0; from < size; ++from) {
          const float* send = round.calls[from]->scatters[i].send + to * count;
          for (uint64_t j = 0; j < count; ++j) results[to][j] += send[j];
        }
        if (first.op == ReduceOp::kAvg) {
          for (float& v : results[to]) v /= static_cast<float>(size);
        }
      }
      for (int to = 0; to < size; ++to) {
        std::memcpy(round.calls[to]->scatters[i].recv, results[to].data(), count * sizeof(float));
      }
    }
  }

  const int size;
  const absl::Duration timeout;
  absl::Mutex mu;
  std::map<uint64_t, Round> rounds ABSL_GUARDED_BY(mu);
  absl::Status broken ABSL_GUARDED_BY(mu);
};

std::vector<std::unique_ptr<EmulatedCommunicator>> EmulatedCommunicator::CreateGroup(
    absl::Span<EmulatedDevice* const> devices, absl::Duration timeout) {
  auto group = std::make_shared<Group>(static_cast<int>(devices.size()), timeout);
  std::vector<std::unique_ptr<EmulatedCommunicator>> out;
  for (size_t r = 0; r < devices.size(); ++r) {
    out.emplace_back(new EmulatedCommunicator(group, devices[r], static_cast<int>(r)));
  }
  return out;
}

int EmulatedCommunicator::size() const { return group_->size; }

std::string EmulatedCommunicator::name() const {
  return absl::StrCat("emulated rank ", rank_, " of ", group_->size);
}

absl::Status EmulatedCommunicator::AllGather(absl::Span<const GatherItem> items,
                                             const Stream& stream) {
  Call call;
  call.gather = true;
  for (const GatherItem& g : items) {
    if (g.bytes != 0 && (g.send == nullptr || g.recv == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": all-gather of ", g.bytes, " bytes with a null buffer"));
    }
    call.gathers.push_back(g);
  }
  return Issue(std::move(call), stream);
}

absl::Status EmulatedCommunicator::ReduceScatter(absl::Span<const ScatterItem> items, ReduceOp op,
                                                 const Stream& stream) {
  Call call;
  call.gather = false;
  call.op = op;
  for (const ScatterItem& s : items) {
    if (s.count != 0 && (s.send == nullptr || s.recv == nullptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(name(), ": reduce-scatter of ", s.count, " floats with a null buffer"));
    }
    call.scatters.push_back(s);
  }
  return Issue(std::move(call), stream);
}

absl::Status EmulatedCommunicator::Check() const {
  absl::MutexLock lock(&group_->mu);
  if (group_->broken.ok()) return absl::OkStatus();
  return absl::Status(group_->broken.code(),
                      absl::StrCat(name(), ": broken by ", group_->broken.message()));
}

void EmulatedCommunicator::Abort(absl::Status why) {
  absl::MutexLock lock(&group_->mu);
  // (A collective waiting for the others sees it and ends.)
  if (group_->broken.ok()) group_->broken = std::move(why);
}

absl::Status EmulatedCommunicator::Issue(Call call, const Stream& stream) {
  {
    absl::MutexLock lock(&group_->mu);
    if (!group_->broken.ok()) {
      return absl::Status(group_->broken.code(),
                          absl::StrCat(name(), ": broken by ", group_->broken.message()));
    }
  }
  items_ += call.gathers.size() + call.scatters.size();
  ++collectives_;
  const uint64_t seq = next_;
  auto shared = std::make_shared<std::unique_ptr<Call>>(std::make_unique<Call>(std::move(call)));
  std::shared_ptr<Group> group = group_;
  const int rank = rank_;
  absl::Status launched = device_->Launch(
      stream, [group, seq, rank, shared]() { group->Arrive(seq, rank, std::move(*shared)); });
  if (launched.ok()) ++next_;  // (a launch that failed leaves no gap in the ranks' sequence)
  return launched;
}

}  // namespace offload::gpu
