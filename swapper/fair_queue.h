// A queue that serves flows by weight, for work that runs several items at
// once: the swapper's I/O threads, which divide the disk between sessions
// this way (each session's blocks one flow, its share weight the flow's).
//
// Tags: start-time fair queueing (Goyal, Vin and Cheng, SIGCOMM 1996). Each
// item has a cost (bytes). Pushed, it gets a start tag: the later of the
// queue's virtual time and its flow's previous item's finish tag; its finish
// tag is its start plus cost / weight. Items go least start tag first (ties:
// the lower flow id), and the virtual time becomes that tag; within a flow,
// items go in the order they came. A flow that comes back after being idle
// starts at the current virtual time: idleness earns no credit.
//
// Anticipation: a flow that keeps one item at a time in flight (a trainer
// waiting for each swap-in before it asks for the next) never has one
// queued when the others' are chosen, so tags alone would give every flow
// one item in flight each, whatever the weights. So an item also waits
// while a flow of a greater weight that is present (an item of it running,
// or its last one done less than kAnticipation ago) and has none queued is
// behind it: that flow's last finish tag below the item's finish tag. It
// goes when that flow catches up, or at the latest kAnticipation after that
// flow's last item is done (it was not coming back: its share goes to the
// others). Flows of one weight (the default) never wait for each other, an
// item no heavier flow is behind goes at once, and an item pushed with
// `may_wait` false never waits (the swapper's write-outs: a heavier flow may
// be waiting for the room they make): the queue idles a thread only for a
// heavier flow that is using the disk.
//
// Flows are named by id; one never seen (or forgotten) has weight 1.
// Not thread-safe: the owner locks.
#ifndef OFFLOADD_SWAPPER_FAIR_QUEUE_H_
#define OFFLOADD_SWAPPER_FAIR_QUEUE_H_

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <optional>
#include <utility>
#include <vector>

namespace offload {

template <typename T>
class FairQueue {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr std::chrono::milliseconds kAnticipation{5};

  // `anticipate`: whether items wait for heavier flows behind them (see the
  // top); without, the order is the tags' alone (one server needs no more).
  explicit FairQueue(bool anticipate = true) : anticipate_(anticipate) {}

  // `weight` >= 1 (lower values count as 1). Applies to items pushed from
  // now on.
  void SetWeight(uint64_t flow, int64_t weight) {
    Flow& f = flows_[flow];
    f.weight = std::max<int64_t>(1, weight);
    f.forgotten = false;
  }
  int64_t weight(uint64_t flow) const {
    auto it = flows_.find(flow);
    return it == flows_.end() ? 1 : it->second.weight;  // (Forget sets 1)
  }
  // The flow's weight and history go (once its items have left and ended).
  void Forget(uint64_t flow) {
    auto it = flows_.find(flow);
    if (it == flows_.end()) return;
    it->second.forgotten = true;
    it->second.weight = 1;
    EraseIfDone(it);
  }

  // `may_wait`: whether the item may wait for a heavier flow behind it
  // (anticipation, above).
  void Push(uint64_t flow, uint64_t cost, T item, Clock::time_point now = Clock::now(),
            bool may_wait = true) {
    Flow& f = flows_[flow];
    f.forgotten = false;
    const double start = std::max(virtual_time_, f.finish);
    f.finish = start + static_cast<double>(cost) / static_cast<double>(f.weight);
    f.queue.push_back(Entry{start, f.finish, now, may_wait, std::move(item)});
    ++size_;
  }

  bool empty() const { return size_ == 0; }
  size_t size() const { return size_; }

  // The next item that may go at `now`, its flow in *flow; it counts as
  // running until Done(flow). Nothing (std::nullopt) when nothing is queued,
  // or when every queued item waits for a flow behind it: then *recheck is
  // lowered to when the first of those waits ends at the latest (a Done or
  // a Push may end it sooner). `waited`, if not null, is set to how long the
  // item was queued (from its Push's `now`).
  std::optional<T> Pop(Clock::time_point now, uint64_t* flow, Clock::time_point* recheck,
                       Clock::duration* waited = nullptr) {
    std::vector<typename std::map<uint64_t, Flow>::iterator> candidates;
    for (auto it = flows_.begin(); it != flows_.end(); ++it) {
      if (!it->second.queue.empty()) candidates.push_back(it);
    }
    std::stable_sort(candidates.begin(), candidates.end(), [](auto a, auto b) {
      return a->second.queue.front().start < b->second.queue.front().start;
    });
    for (auto c : candidates) {
      const Entry& head = c->second.queue.front();
      if (const std::optional<Clock::time_point> until =
              head.may_wait ? WaitsFor(c->first, head.finish, now) : std::nullopt) {
        *recheck = std::min(*recheck, *until);
        continue;
      }
      Flow& f = c->second;
      virtual_time_ = std::max(virtual_time_, head.start);
      if (waited != nullptr) *waited = now - head.queued;
      T item = std::move(f.queue.front().item);
      f.queue.pop_front();
      --size_;
      ++f.running;
      *flow = c->first;
      return item;
    }
    return std::nullopt;
  }

  // An item of `flow` that Pop gave ended at `now`.
  void Done(uint64_t flow, Clock::time_point now) {
    auto it = flows_.find(flow);
    if (it == flows_.end()) return;
    --it->second.running;
    it->second.done = now;
    EraseIfDone(it);
  }

 private:
  struct Entry {
    double start;
    double finish;
    Clock::time_point queued;
    bool may_wait;
    T item;
  };
  struct Flow {
    int64_t weight = 1;
    double finish = 0;  // of its last item pushed
    bool forgotten = false;
    int running = 0;
    Clock::time_point done = Clock::time_point::min();  // its last item's end
    std::deque<Entry> queue;
  };

  // Until when an item of `flow` finishing at `finish` waits for a present
  // heavier flow behind it (none: it goes).
  std::optional<Clock::time_point> WaitsFor(uint64_t flow, double finish,
                                            Clock::time_point now) const {
    if (!anticipate_) return std::nullopt;
    const int64_t weight = flows_.at(flow).weight;
    std::optional<Clock::time_point> until;
    for (const auto& [id, f] : flows_) {
      if (id == flow || f.weight <= weight || !f.queue.empty() || f.finish >= finish) continue;
      if (f.running > 0) return now + kAnticipation;  // rechecked at its Done
      if (f.done != Clock::time_point::min() && now < f.done + kAnticipation) {
        until = std::min(until.value_or(Clock::time_point::max()), f.done + kAnticipation);
      }
    }
    return until;
  }

  void EraseIfDone(typename std::map<uint64_t, Flow>::iterator it) {
    if (it->second.forgotten && it->second.queue.empty() && it->second.running == 0) {
      flows_.erase(it);
    }
  }

  const bool anticipate_;
  std::map<uint64_t, Flow> flows_;
  double virtual_time_ = 0;
  size_t size_ = 0;
};

}  // namespace offload

#endif  // OFFLOADD_SWAPPER_FAIR_QUEUE_H_
