#include "swapper/victim_index.h"

#include "absl/strings/str_cat.h"

namespace offload {

uint64_t VictimIndex::At(const Trace& t, BlockId id, const AccessTrace& order) {
  const uint64_t next = order.NextUse(id);
  return next == kNever ? kNever : t.origin + order.position() + next;
}

uint64_t VictimIndex::Sync(Trace* t, const AccessTrace& order) {
  if (!t->synced || order.orders() != t->order) {
    // Positions of another order, or unknown: every one looked up.
    t->synced = true;
    t->order = order.orders();
    t->iteration = order.iterations();
    t->length = order.trace_length();
    t->by_next.clear();
    for (const auto& [not_last_use, id] : t->by_lru) Relook(t, id, not_last_use, order);
  } else if (order.iterations() != t->iteration) {
    // The same order, iterations later: a position p of then is p + length
    // in the next iteration. (Those of an iteration cut short, or of the
    // ones between, now lie behind the trace: looked up below.)
    t->origin += (order.iterations() - t->iteration) * t->length;
    t->iteration = order.iterations();
  }
  const uint64_t pos = t->origin + order.position();
  // Positions the trace passed without their blocks' use (it skipped ahead,
  // or an iteration ended early): looked up again, each at or after pos.
  while (!t->by_next.empty()) {
    auto first = t->by_next.begin();
    const auto [at, not_last_use, id] = *first;
    if (at >= pos) break;  // (kNever too)
    t->by_next.erase(first);
    Relook(t, id, not_last_use, order);
  }
  return pos;
}

void VictimIndex::Set(BlockId id, uint64_t trace, const Standing& now, const AccessTrace* order) {
  if (now == Standing{} && !entries_.contains(id)) return;  // (nothing to know)
  auto [it, added] = entries_.try_emplace(id);
  Entry& e = it->second;
  if (!added && e.trace == trace && e.standing == now) return;  // (most pins change nothing here)
  if (!added && e.trace != trace) {
    Leave(id, e);  // (its trace's sums without it; then as a new block)
    e.standing = Standing{};
  }
  e.trace = trace;
  auto at_trace = traces_.try_emplace(trace).first;
  Trace& t = at_trace->second;
  Subtract(&t, id, e);  // what it stood for (nothing, where new or moved)
  e.standing = now;
  if (now.held) ++t.held;
  t.room += now.room;
  all_room_ += now.room;
  if (now.candidate) {
    if (order != nullptr && order->on_trace()) {
      Sync(&t, *order);
      e.at = At(t, id, *order);
    } else {
      e.at = kNever;     // unknown now:
      t.synced = false;  // looked up once the trace is on its order
    }
    t.by_next.insert({e.at, ~now.last_use, id});
    t.by_lru.insert({~now.last_use, id});
  }
  if (t.forgotten && t.empty()) traces_.erase(at_trace);
  // Known only while it stands for something: the table follows the blocks
  // held and in the pool, not every block a session registered.
  if (now == Standing{}) entries_.erase(it);
}

void VictimIndex::Subtract(Trace* t, BlockId id, const Entry& e) {
  const Standing& s = e.standing;
  t->held -= s.held ? 1 : 0;
  t->room -= s.room;
  all_room_ -= s.room;
  if (s.candidate) {
    t->by_next.erase({e.at, ~s.last_use, id});
    t->by_lru.erase({~s.last_use, id});
  }
}

void VictimIndex::Leave(BlockId id, const Entry& e) {
  auto it = traces_.find(e.trace);
  if (it == traces_.end()) return;  // (only where it stood for nothing)
  Subtract(&it->second, id, e);
  if (it->second.forgotten && it->second.empty()) traces_.erase(it);
}

void VictimIndex::Relook(Trace* t, BlockId id, uint64_t not_last_use, const AccessTrace& order) {
  Entry& e = entries_.at(id);
  e.at = At(*t, id, order);
  t->by_next.insert({e.at, not_last_use, id});
}

void VictimIndex::Erase(BlockId id) {
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  Leave(id, it->second);
  entries_.erase(it);
}

void VictimIndex::Forget(uint64_t trace) {
  auto it = traces_.find(trace);
  if (it == traces_.end()) return;
  if (it->second.empty()) {
    traces_.erase(it);
    return;
  }
  it->second.synced = false;
  it->second.forgotten = true;  // erased once its blocks stand for nothing
}

bool VictimIndex::Held(uint64_t trace) const {
  auto it = traces_.find(trace);
  return it != traces_.end() && it->second.held > 0;
}

uint64_t VictimIndex::Room(uint64_t trace) const {
  auto it = traces_.find(trace);
  return it == traces_.end() ? 0 : it->second.room;
}

void VictimIndex::TracesWithCandidates(std::vector<uint64_t>* out) const {
  out->clear();
  for (const auto& [trace, t] : traces_) {
    if (!t.by_lru.empty()) out->push_back(trace);
  }
}

VictimIndex::Standing VictimIndex::Of(BlockId id) const {
  auto it = entries_.find(id);
  return it == entries_.end() ? Standing{} : it->second.standing;
}

std::vector<std::string> VictimIndex::CheckForTesting(
    const std::function<const AccessTrace*(uint64_t)>& order_of) const {
  std::vector<std::string> errors;
  absl::flat_hash_map<uint64_t, Trace> expected;
  uint64_t all_room = 0;
  for (const auto& [id, e] : entries_) {
    if (e.standing.candidate && (e.standing.held || e.standing.room == 0)) {
      errors.push_back(absl::StrCat("block ", id, ": a candidate held or holding no room"));
    }
    Trace& t = expected[e.trace];
    if (e.standing.held) ++t.held;
    t.room += e.standing.room;
    all_room += e.standing.room;
    if (e.standing.candidate) {
      t.by_next.insert({e.at, ~e.standing.last_use, id});
      t.by_lru.insert({~e.standing.last_use, id});
    }
  }
  if (all_room != all_room_) {
    errors.push_back(absl::StrCat("room ", all_room_, ", its blocks' ", all_room));
  }
  for (const auto& [trace, t] : traces_) {
    if (t.forgotten && t.empty()) {
      errors.push_back(absl::StrCat("trace ", trace, ": forgotten, kept"));
    }
    auto it = expected.find(trace);
    const Trace no_blocks;
    const Trace& want = it == expected.end() ? no_blocks : it->second;
    if (t.held != want.held || t.room != want.room || t.by_next != want.by_next ||
        t.by_lru != want.by_lru) {
      errors.push_back(absl::StrCat("trace ", trace, ": held ", t.held, " room ", t.room, " ",
                                    t.by_lru.size(), " candidates; its blocks: held ", want.held,
                                    " room ", want.room, " ", want.by_lru.size(), " candidates"));
    }
    // Positions in step with the order (where nothing is left to Sync):
    // those at or after the trace's are its blocks' next uses.
    const AccessTrace* order = order_of(trace);
    if (order == nullptr || !order->on_trace() || !t.synced || t.order != order->orders() ||
        t.iteration != order->iterations()) {
      continue;
    }
    const uint64_t pos = t.origin + order->position();
    for (const auto& [at, not_last_use, id] : t.by_next) {
      if (at < pos) continue;  // (passed: looked up at the next visit)
      const uint64_t want_at = At(t, id, *order);
      if (at != want_at) {
        errors.push_back(absl::StrCat("block ", id, " of trace ", trace, ": next use at ", at,
                                      ", its order's ", want_at));
      }
    }
  }
  for (const auto& [trace, t] : expected) {
    if (!traces_.contains(trace) && !t.empty()) {
      errors.push_back(absl::StrCat("trace ", trace, ": missing"));
    }
  }
  return errors;
}

}  // namespace offload
