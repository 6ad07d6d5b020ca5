#include "swapper/access_trace.h"

#include <algorithm>

namespace offload {

void AccessTrace::RecordUse(uint64_t id) {
  recording_.push_back(id);
  if (!matched_ || trace_.empty()) return;
  if (pos_ < trace_.size() && trace_[pos_] == id) {
    ++pos_;
    return;
  }
  // Uses the trace expects may not happen (the first iteration also held
  // partitions for their registration): skip ahead to this use's next
  // position in this iteration.
  auto it = positions_.find(id);
  if (it != positions_.end()) {
    auto next = std::lower_bound(it->second.begin(), it->second.end(), pos_);
    if (next != it->second.end()) {
      pos_ = *next + 1;
      return;
    }
  }
  matched_ = false;  // the order changed (or the iteration is longer)
}

void AccessTrace::EndIteration() {
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
  const std::vector<uint64_t>& next = alternating ? before_last_ : last_;
  ++iterations_;
  if (next != trace_) {
    ++orders_;
    trace_ = next;
    positions_.clear();
    for (size_t i = 0; i < trace_.size(); ++i) positions_[trace_[i]].push_back(i);
  }
  recording_.clear();
  pos_ = 0;
  matched_ = true;
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
