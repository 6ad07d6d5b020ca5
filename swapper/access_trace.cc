#include "swapper/access_trace.h"

#include <algorithm>

namespace offload {

bool AccessTrace::RecordUse(uint64_t id) {
  ++uses_;
  if (recording_.size() >= std::max(kMaxRecording, 4 * last_uses_)) {
    recording_.clear();  // (bounded: this iteration's end learns nothing new)
    dropped_ = true;
    uses_off_ = 0;
    next_look_ = kFirstLook;
  }
  recording_.push_back(id);
  if (matched_ && !trace_.empty()) {
    if (pos_ < trace_.size() && trace_[pos_] == id) {
      ++pos_;
      return false;
    }
    if (repeats_ && pos_ == trace_.size() && trace_[0] == id) {
      // Another pass of an order that repeats: its positions go on as an
      // iteration's next ones (VictimIndex). (The recording goes on: the
      // iteration's end learns all of it, within the bound.)
      ++iterations_;
      ++passes_;
      pos_ = 1;
      return true;
    }
    // Uses the trace expects may not happen (the first iteration also held
    // partitions for their registration): skip ahead to this use's next
    // position in this iteration.
    auto it = positions_.find(id);
    if (it != positions_.end()) {
      auto next = std::lower_bound(it->second.begin(), it->second.end(), pos_);
      if (next != it->second.end()) {
        pos_ = *next + 1;
        return false;
      }
    }
    matched_ = false;  // the order changed (or the iteration is longer)
    uses_off_ = 0;
    next_look_ = kFirstLook;
  }
  ++uses_off_;  // (never more than the recording holds: both start again together)
  if (uses_ > 2 * last_uses_ && uses_off_ >= next_look_) LookForRepeats();
  return false;
}

void AccessTrace::LookForRepeats() {
  // The uses since the trace went off its order, latest first: the prefix
  // function of that reversed run says, for each of its prefixes (a run of
  // the latest uses), the longest proper prefix that is also its suffix,
  // so (length - that) is the run's shortest period. The longest run that
  // holds two periods or more gives the order: its last period, from its
  // first use (the next one, if it repeats).
  const size_t n = uses_off_;
  auto latest = [&](size_t k) { return recording_[recording_.size() - 1 - k]; };
  std::vector<size_t> border(n, 0);
  size_t found = 0;  // the period
  for (size_t k = 1; k < n; ++k) {
    size_t b = border[k - 1];
    while (b > 0 && latest(k) != latest(b)) b = border[b - 1];
    if (latest(k) == latest(b)) ++b;
    border[k] = b;
  }
  // (A run shorter than half of them, or than kFirstLook, is not the order
  // they follow; nor is one use again and again: forward's last layer then
  // backward's first is 3 3, and a fetch's hold and the step's of the same
  // block are two uses of it in one pass.)
  for (size_t len = n; len >= std::max(kFirstLook, (n + 1) / 2) && found == 0; --len) {
    const size_t period = len - border[len - 1];
    if (2 * period <= len && period >= 2) found = period;
  }
  next_look_ = 2 * n;
  if (found == 0) return;
  // A new order even where it is the one before: the position starts
  // again within the iteration (VictimIndex looks every next use up again).
  SetOrder(
      std::vector<uint64_t>(recording_.end() - static_cast<ptrdiff_t>(found), recording_.end()));
  repeats_ = true;
  matched_ = true;
  pos_ = 0;
}

void AccessTrace::SetOrder(std::vector<uint64_t> order) {
  ++orders_;
  trace_ = std::move(order);
  positions_.clear();
  for (size_t i = 0; i < trace_.size(); ++i) positions_[trace_[i]].push_back(i);
}

void AccessTrace::EndIteration() {
  if (dropped_) {
    // Over the bound (4. above): what is left of the recording is not the
    // iteration's order. The order stays; its next pass starts here.
    recording_ = trace_;
  }
  if (recording_ != trace_ && !trace_.empty()) ++relearned_;
  fourth_last_ = std::move(third_last_);
  third_last_ = std::move(before_last_);
  before_last_ = std::move(last_);
  last_ = std::move(recording_);
  // Two orders taking turns twice (A B A B: A next), else the newest. Once
  // is not enough: A X A, with X one odd iteration (a skipped step pins no
  // state), would predict X again.
  const bool alternating = !before_last_.empty() && last_ != before_last_ && last_ == third_last_ &&
                           before_last_ == fourth_last_;
  // (Not an empty one, a skipped step with nothing else on NVMe: the gate
  // would open in training. One whose recording was dropped counts: an
  // iteration of training longer than the bound, such as gradient
  // accumulation's, is then recorded whole at the next; after one with an
  // evaluation in it, the next iteration of training sets the gate again.)
  if (uses_ > 0) last_uses_ = uses_;
  ++iterations_;
  const std::vector<uint64_t>& next = alternating ? before_last_ : last_;
  if (next != trace_) SetOrder(next);
  matched_ = true;
  repeats_ = false;
  uses_ = 0;
  uses_off_ = 0;
  next_look_ = kFirstLook;
  dropped_ = false;
  recording_.clear();
  pos_ = 0;
}

uint64_t AccessTrace::NextUse(uint64_t id) const {
  if (!on_trace()) return kNever;
  auto it = positions_.find(id);
  if (it == positions_.end()) return kNever;
  const std::vector<size_t>& at = it->second;
  auto next = std::lower_bound(at.begin(), at.end(), pos_);
  if (next != at.end()) return *next - pos_;
  // Not again in this iteration: its first use in the next one.
  return trace_.size() - pos_ + at.front();
}

std::vector<uint64_t> AccessTrace::Upcoming(size_t max_uses) const {
  std::vector<uint64_t> out;
  if (!on_trace()) return out;
  const size_t n = std::min(max_uses, trace_.size());
  out.reserve(n);
  for (size_t i = 0; i < n; ++i) out.push_back(trace_[(pos_ + i) % trace_.size()]);
  return out;
}

}  // namespace offload
