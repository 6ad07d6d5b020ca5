#include "gpu/param_cache.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"

namespace offload::gpu {
namespace {

constexpr uint64_t kAlignment = 256;

uint64_t Rounded(uint64_t bytes) { return (bytes + kAlignment - 1) / kAlignment * kAlignment; }

}  // namespace

absl::StatusOr<std::unique_ptr<ParamCache>> ParamCache::Create(Device* device, HostSource* source,
                                                               ParamCacheOptions options,
                                                               DeviceMemory slab) {
  if (device == nullptr || source == nullptr) {
    return absl::InvalidArgumentError("ParamCache needs a device and a host source");
  }
  if (!slab) {
    if (options.budget_bytes == 0) {
      return absl::InvalidArgumentError("ParamCache: budget_bytes must be > 0");
    }
    absl::StatusOr<DeviceMemory> m = device->Allocate(options.budget_bytes);
    if (!m.ok()) {
      return absl::Status(
          m.status().code(),
          absl::StrFormat("the GPU tier's parameter budget (%d bytes) on %s: %s",
                          options.budget_bytes, device->name(), m.status().message()));
    }
    slab = *std::move(m);
  }
  ASSIGN_OR_RETURN(Stream copy_stream, device->CreateStream());
  ASSIGN_OR_RETURN(Event fence, device->CreateEvent());
  ASSIGN_OR_RETURN(PinnedMemory staging,
                   device->AllocatePinned(std::max<uint64_t>(options.staging_bytes, 1 << 20)));
  return std::unique_ptr<ParamCache>(new ParamCache(device, source, options, std::move(slab),
                                                    std::move(copy_stream), std::move(fence),
                                                    std::move(staging)));
}

ParamCache::ParamCache(Device* device, HostSource* source, ParamCacheOptions options,
                       DeviceMemory slab, Stream copy_stream, Event fence, PinnedMemory staging)
    : device_(device),
      source_(source),
      budget_(slab.bytes() / kAlignment * kAlignment),
      slab_(std::move(slab)),
      copy_stream_(std::move(copy_stream)),
      fence_(std::move(fence)),
      staging_(std::move(staging)),
      options_(options) {
  if (options_.max_live_bytes == 0 || options_.max_live_bytes > budget_) {
    options_.max_live_bytes = budget_;
  }
  if (budget_ > 0) free_[0] = budget_;
  stats_.budget_bytes = budget_;
}

ParamCache::~ParamCache() {
  absl::MutexLock lock(&mu_);
  Reap(/*wait=*/true);
}

absl::StatusOr<int> ParamCache::AddUnit(absl::Span<const std::pair<uint64_t, uint64_t>> tensors,
                                        bool holder) {
  absl::MutexLock lock(&mu_);
  if (tensors.empty()) return absl::InvalidArgumentError("a unit needs at least one tensor");
  Unit unit;
  unit.holder = holder;
  const int index = static_cast<int>(units_.size());
  // A unit refused declares nothing: the tensors it added go again (a
  // later unit may declare them otherwise, and Keys() names none of them).
  const size_t entries_before = entries_.size();
  const uint64_t persistent_before = persistent_bytes_;
  const uint64_t declared_before = declared_bytes_;
  auto refuse = [&](absl::Status why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    for (size_t i = entries_before; i < entries_.size(); ++i) by_key_.erase(entries_[i].key);
    entries_.resize(entries_before);
    persistent_bytes_ = persistent_before;
    declared_bytes_ = declared_before;
    return why;
  };
  for (const auto& [key, bytes] : tensors) {
    if (bytes == 0 || bytes > (uint64_t{1} << 48)) {  // (Rounded must not wrap)
      return refuse(absl::InvalidArgumentError(
          absl::StrFormat("tensor %d declared with %d bytes", key, bytes)));
    }
    auto it = by_key_.find(key);
    if (it != by_key_.end()) {
      const Entry& e = entries_[it->second];
      if (e.bytes != bytes) {
        return refuse(absl::InvalidArgumentError(
            absl::StrFormat("tensor %d declared with %d bytes and now %d", key, e.bytes, bytes)));
      }
      if (std::find(unit.entries.begin(), unit.entries.end(), it->second) != unit.entries.end()) {
        return refuse(
            absl::InvalidArgumentError(absl::StrFormat("tensor %d named twice in a unit", key)));
      }
      unit.entries.push_back(it->second);
    } else {
      unit.entries.push_back(static_cast<int>(entries_.size()));
      Entry e;
      e.key = key;
      e.bytes = bytes;
      e.persistent = options_.persistence_threshold_bytes != 0 &&
                     bytes <= options_.persistence_threshold_bytes &&
                     persistent_bytes_ + Rounded(bytes) <= budget_ / 2;
      if (e.persistent) persistent_bytes_ += Rounded(bytes);
      declared_bytes_ += Rounded(bytes);
      by_key_[key] = unit.entries.back();
      entries_.push_back(std::move(e));
    }
    unit.bytes += Rounded(bytes);
  }
  if (unit.bytes > budget_) {
    return refuse(absl::ResourceExhaustedError(absl::StrFormat(
        "a unit of %d tensors needs %d bytes on the device; the GPU tier's budget is %d bytes",
        tensors.size(), unit.bytes, budget_)));
  }
  for (int e : unit.entries) entries_[e].units.push_back(index);
  max_unit_bytes_ = std::max(max_unit_bytes_, unit.bytes);
  units_.push_back(std::move(unit));
  positions_.resize(units_.size());
  return index;
}

void ParamCache::BeginIteration() {
  absl::MutexLock lock(&mu_);
  if (!recording_.empty()) {
    trace_ = std::move(recording_);
    recording_.clear();
    positions_.assign(units_.size(), {});
    trace_bytes_.assign(trace_.size() + 1, 0);
    for (size_t i = 0; i < trace_.size(); ++i) {
      positions_[trace_[i]].push_back(i);
      trace_bytes_[i + 1] = trace_bytes_[i] + units_[trace_[i]].bytes;
    }
  }
  cursor_ = -1;
  on_trace_ = !trace_.empty();
  Prefetch();
}

void ParamCache::AdvanceCursor(int unit) {
  recording_.push_back(unit);
  if (trace_.empty()) return;
  const uint64_t next = static_cast<uint64_t>(cursor_ + 1);
  if (next < trace_.size() && trace_[next] == unit) {
    cursor_ = static_cast<int64_t>(next);
    on_trace_ = true;
    return;
  }
  ++stats_.off_trace_uses;
  const std::vector<uint64_t>& p = positions_[unit];
  if (p.empty()) {
    on_trace_ = false;
    return;
  }
  auto it = std::lower_bound(p.begin(), p.end(), next);
  cursor_ = static_cast<int64_t>(it != p.end() ? *it : p.front());
  on_trace_ = true;
}

uint64_t ParamCache::NextUseOfUnit(int unit) const {
  const std::vector<uint64_t>& p = positions_[unit];
  auto it = std::lower_bound(p.begin(), p.end(), static_cast<uint64_t>(cursor_ + 1));
  return it == p.end() ? kNever : *it;
}

uint64_t ParamCache::NextUse(const Entry& e) const {
  uint64_t next = kNever;
  for (int u : e.units) next = std::min(next, NextUseOfUnit(u));
  return next;
}

std::optional<uint64_t> ParamCache::TakeRange(uint64_t bytes, bool top) {
  auto fits = free_.end();
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < bytes) continue;
    fits = it;
    if (!top) break;
  }
  if (fits != free_.end()) {
    auto it = fits;
    const uint64_t rest = it->second - bytes;
    uint64_t offset = it->first;
    if (top) {
      offset += rest;
      if (rest)
        it->second = rest;
      else
        free_.erase(it);
    } else {
      free_.erase(it);
      if (rest) free_[offset + bytes] = rest;
    }
    stats_.resident_bytes += bytes;
    stats_.peak_resident_bytes = std::max(stats_.peak_resident_bytes, stats_.resident_bytes);
    return offset;
  }
  return std::nullopt;
}

void ParamCache::FreeRange(uint64_t offset, uint64_t bytes) {
  stats_.resident_bytes -= bytes;
  auto next = free_.lower_bound(offset);
  if (next != free_.end() && offset + bytes == next->first) {
    bytes += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == offset) {
      prev->second += bytes;
      return;
    }
  }
  free_[offset] = bytes;
}

absl::StatusOr<Event> ParamCache::TakeEvent() {
  if (spare_events_.empty()) return device_->CreateEvent();
  Event e = std::move(spare_events_.back());
  spare_events_.pop_back();
  return e;
}

void ParamCache::Forget(Entry& e) {
  FreeRange(e.offset, Rounded(e.bytes));
  if (!e.persistent) live_bytes_ -= Rounded(e.bytes);
  e.state = State::kAbsent;
  e.prefetched = false;
}

bool ParamCache::GiveUpCopy(Entry& e) {
  e.batch.reset();
  if (std::exchange(e.in_place, false)) {
    e.state = State::kStale;
    return true;
  }
  Forget(e);
  return false;
}

absl::Status ParamCache::Evict(int index) {
  Entry& e = entries_[index];
  if (e.released_recorded) {
    for (int u : e.units) {
      if (!units_[u].released_recorded) continue;
      if (device_->WaitOn(copy_stream_, units_[u].released).ok()) continue;
      if (absl::Status s = WaitOnHost(units_[u].released); !s.ok()) {
        return absl::Status(
            s.code(), absl::StrCat("the GPU tier cannot reuse the memory of a tensor its compute "
                                   "read: the wait for that compute failed: ",
                                   s.message()));
      }
    }
  }
  Forget(e);
  ++stats_.evictions;
  return absl::OkStatus();
}

bool ParamCache::Holds(int entry) const {
  for (int u : entries_[entry].units) {
    if (units_[u].holder) return true;
  }
  return false;
}

uint64_t ParamCache::RoomBelow(int entry) const {
  uint64_t room = 0;
  for (int u : entries_[entry].units) {
    if (units_[u].holder)
      room = std::max(room, units_[u].below ? units_[u].below : max_unit_bytes_);
  }
  return room;
}

bool ParamCache::TakeAt(uint64_t offset, uint64_t bytes) {
  auto it = free_.upper_bound(offset);
  if (it == free_.begin()) return false;
  --it;
  const uint64_t start = it->first, length = it->second;
  if (start + length < offset + bytes) return false;
  free_.erase(it);
  if (offset > start) free_[start] = offset - start;
  if (start + length > offset + bytes) free_[offset + bytes] = start + length - offset - bytes;
  stats_.resident_bytes += bytes;
  stats_.peak_resident_bytes = std::max(stats_.peak_resident_bytes, stats_.resident_bytes);
  return true;
}

std::vector<std::pair<uint64_t, uint64_t>> ParamCache::Stays(
    uint64_t limit, const std::vector<bool>& wanted) const {
  std::vector<std::pair<uint64_t, uint64_t>> stays;  // [start, end)
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.state == State::kAbsent || e.state == State::kFailed) continue;
    // (A use may give back persistent tensors too: they are copied again.)
    const bool movable = (e.state == State::kReady || e.state == State::kStale) && e.pins == 0 &&
                         !wanted[i] && (limit == kNever || (!e.persistent && NextUse(e) > limit));
    if (!movable) stays.emplace_back(e.offset, e.offset + Rounded(e.bytes));
  }
  std::sort(stays.begin(), stays.end());
  return stays;
}

uint64_t ParamCache::LargestRoom(uint64_t limit, const std::vector<bool>& wanted,
                                 std::pair<uint64_t, uint64_t> also) const {
  std::vector<std::pair<uint64_t, uint64_t>> stays = Stays(limit, wanted);
  if (also.second > also.first) {
    stays.insert(std::upper_bound(stays.begin(), stays.end(), also), also);
  }
  uint64_t largest = 0, start = 0;
  for (const auto& [from, to] : stays) {
    if (from > start) largest = std::max(largest, from - start);
    start = std::max(start, to);
  }
  return std::max(largest, budget_ > start ? budget_ - start : 0);
}

absl::StatusOr<std::optional<uint64_t>> ParamCache::PlaceOnTop(uint64_t rounded, uint64_t limit,
                                                               const std::vector<int>& keep) {
  std::vector<bool> wanted(entries_.size());
  for (int i : keep) wanted[i] = true;
  const std::vector<std::pair<uint64_t, uint64_t>> stays = Stays(limit, wanted);
  // The highest stretch between them that fits.
  std::optional<uint64_t> at;
  uint64_t end = budget_;
  for (auto it = stays.rbegin(); it != stays.rend() && !at; ++it) {
    if (end >= it->second && end - it->second >= rounded) at = end - rounded;
    end = std::min(end, it->first);
  }
  if (!at && end >= rounded) at = end - rounded;
  if (!at) return std::nullopt;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.state != State::kReady && e.state != State::kStale) continue;
    if (e.offset < *at + rounded && *at < e.offset + Rounded(e.bytes)) {
      RETURN_IF_ERROR(Evict(static_cast<int>(i)));
    }
  }
  // (Free now, in one piece: what was there has been given back.)
  if (!TakeAt(*at, rounded)) return std::nullopt;
  return at;
}

absl::StatusOr<uint64_t> ParamCache::Place(uint64_t bytes, bool persistent, uint64_t limit,
                                           const std::vector<int>& keep, uint64_t room_below) {
  const bool top = room_below > 0;
  const uint64_t rounded = Rounded(bytes);
  // A holder's tensor where the budget does not hold every tensor: the
  // highest free range that fits, if the largest room left besides what
  // stays (Stays) still holds `room_below` (RoomBelow); else on top of what
  // stays, what is there given back (PlaceOnTop; for a use, after the
  // copies in flight are waited for, and past max_live_bytes if it must).
  // (For a prefetch where max_live_bytes is below the budget and reached,
  // the tensors beyond it are given back first, as below.)
  if (top && budget_ < declared_bytes_ &&
      (persistent || options_.max_live_bytes >= budget_ || limit == kNever ||
       live_bytes_ + rounded <= options_.max_live_bytes)) {
    if (std::optional<uint64_t> at = TakeRange(rounded, /*top=*/true)) {
      std::vector<bool> wanted(entries_.size());
      for (int i : keep) wanted[i] = true;
      if (LargestRoom(limit, wanted, {*at, *at + rounded}) >= room_below) {
        if (!persistent) {
          if (live_bytes_ + rounded > options_.max_live_bytes) ++stats_.over_live_cap;
          live_bytes_ += rounded;
        }
        return *at;
      }
      FreeRange(*at, rounded);
    }
    // (For a use, copies in flight do not stay: waited for, they may be
    // given back too.)
    if (limit == kNever) Reap(/*wait=*/true);
    ASSIGN_OR_RETURN(std::optional<uint64_t> at, PlaceOnTop(rounded, limit, keep));
    if (at) {
      if (!persistent) {
        // (A use's holder on top past max_live_bytes: the cap gives way, as
        // below for what is in use; later placements give back first.)
        if (live_bytes_ + rounded > options_.max_live_bytes) ++stats_.over_live_cap;
        live_bytes_ += rounded;
      }
      return *at;
    }
  }
  bool capped = true;  // max_live_bytes holds (until nothing else can give way)
  for (;;) {
    const bool over_live = capped && !persistent && live_bytes_ + rounded > options_.max_live_bytes;
    if (!over_live) {
      if (std::optional<uint64_t> offset = TakeRange(rounded, top)) {
        if (!persistent) live_bytes_ += rounded;
        return *offset;
      }
    }
    // The victim: not in use nor in flight nor wanted now; non-persistent
    // before persistent, free ones (stale, or not used again) before the
    // rest, beyond the reuse distance before within it, then the farthest
    // next use.
    int victim = -1;
    std::tuple<bool, bool, bool, uint64_t> best{};
    for (size_t i = 0; i < entries_.size(); ++i) {
      const Entry& e = entries_[i];
      if ((e.state != State::kReady && e.state != State::kStale) || e.pins > 0) continue;
      if (over_live && e.persistent) continue;
      if (std::find(keep.begin(), keep.end(), static_cast<int>(i)) != keep.end()) continue;
      const uint64_t next = NextUse(e);
      if (limit != kNever && next <= limit) continue;
      bool far = true;
      if (options_.max_reuse_distance_bytes != 0 && next != kNever && cursor_ >= 0) {
        far = trace_bytes_[next] - trace_bytes_[cursor_ + 1] > options_.max_reuse_distance_bytes;
      }
      // Free to evict first: a stale tensor (its copy is due either way) or
      // one not used again; then by how far ahead its next use is.
      const bool free = e.state == State::kStale || next == kNever;
      std::tuple<bool, bool, bool, uint64_t> rank{!e.persistent, free, far, next};
      if (victim < 0 || rank > best) {
        victim = static_cast<int>(i);
        best = rank;
      }
    }
    if (victim < 0 && limit == kNever && !in_flight_.empty()) {
      // A use waits for copies in flight (prefetches) to free their room.
      std::shared_ptr<Batch> b = in_flight_.front();
      in_flight_.pop_front();
      FinishBatch(*b, WaitOnHost(b->done));
      continue;
    }
    if (victim < 0 && over_live && limit == kNever) {
      // Every non-persistent tensor resident is in use or in flight: the
      // cap gives way for a use (the one in use must be there), never for a
      // prefetch (which stops there).
      capped = false;
      ++stats_.over_live_cap;
      continue;
    }
    if (victim < 0) {
      uint64_t pinned = 0, largest_free = 0, free_bytes = 0;
      for (size_t i = 0; i < entries_.size(); ++i) {
        const Entry& e = entries_[i];
        const bool wanted = std::find(keep.begin(), keep.end(), static_cast<int>(i)) != keep.end();
        if (e.state != State::kAbsent && e.state != State::kFailed &&
            (e.pins > 0 || e.batch || wanted)) {
          pinned += Rounded(e.bytes);
        }
      }
      for (const auto& [offset, length] : free_) {
        largest_free = std::max(largest_free, length);
        free_bytes += length;
      }
      return absl::ResourceExhaustedError(absl::StrFormat(
          "the GPU tier has no room for %d bytes: budget %d bytes (%d non-persistent at most), "
          "%d resident, %d of them in use, being copied or wanted by this use; %d free, %d of "
          "them in one piece (the budget holds too few modules at once: raise gpu.budget_bytes)",
          bytes, budget_, options_.max_live_bytes, stats_.resident_bytes, pinned, free_bytes,
          largest_free));
    }
    RETURN_IF_ERROR(Evict(victim));
  }
}

absl::Status ParamCache::CopyIn(Entry& e, const HostSource::Span& span) {
  char* dst = static_cast<char*>(slab_.get()) + e.offset;
  if (span.dma) {
    RETURN_IF_ERROR(
        device_->CopyAsync(dst, span.data, e.bytes, Direction::kHostToDevice, copy_stream_));
  } else {
    // Through the staging buffer: each chunk is copied there by this
    // thread, then to the device on the copy stream. A chunk that would
    // wrap waits for every copy out of the buffer first.
    const uint64_t capacity = staging_.bytes();
    for (uint64_t done = 0; done < e.bytes;) {
      const uint64_t chunk = std::min(capacity, e.bytes - done);
      if (staging_head_ + chunk > capacity) {
        RETURN_IF_ERROR(device_->Record(fence_, copy_stream_));
        absl::Status s = WaitOnHost(fence_);
        staging_head_ = 0;
        if (!s.ok()) {
          // A copy before the fence failed: which one is not known, so
          // every batch in flight counts as failed, and so does this one
          // (the failed copy may be one of its own tensors': Bring undoes
          // it, and the next use copies again).
          for (auto& b : in_flight_) FinishBatch(*b, s);
          in_flight_.clear();
          return s;
        }
      }
      char* stage = static_cast<char*>(staging_.get()) + staging_head_;
      std::memcpy(stage, static_cast<const char*>(span.data) + done, chunk);
      RETURN_IF_ERROR(
          device_->CopyAsync(dst + done, stage, chunk, Direction::kHostToDevice, copy_stream_));
      staging_head_ += (chunk + kAlignment - 1) / kAlignment * kAlignment;
      done += chunk;
    }
    stats_.staged_bytes += e.bytes;
  }
  stats_.h2d_bytes += e.bytes;
  ++stats_.copies;
  return absl::OkStatus();
}

bool ParamCache::OnTop(int entry, const std::vector<bool>& wanted) const {
  // What stays (Stays, for a use) covers the slab from the entry's end up.
  uint64_t covered = entries_[entry].offset + Rounded(entries_[entry].bytes);
  for (const auto& [from, to] : Stays(kNever, wanted)) {
    if (to <= covered) continue;
    if (from > covered) return false;
    covered = to;
  }
  return covered >= budget_;
}

absl::Status ParamCache::Bring(absl::Span<const int> units, uint64_t limit) {
  std::vector<int> missing, keep;
  std::vector<bool> kept(entries_.size());
  for (int unit : units) {
    for (int i : units_[unit].entries) kept[i] = true;
  }
  uint64_t room_below = 0;
  for (int unit : units) {
    for (int i : units_[unit].entries) room_below = std::max(room_below, RoomBelow(i));
  }
  if (room_below > 0 && limit == kNever && budget_ < declared_bytes_ &&
      LargestRoom(limit, kept) < room_below) {
    // A use of a holder (a module whose children run while it is in use)
    // where what stays, the holder with it, leaves no room in one piece
    // for the most its children held (or asked for) at once in its earlier
    // uses (the largest unit before any is known): its tensors found below
    // memory that is free or may be given back are placed again, on top. The units in use then
    // stack from the slab's top down, the room below them in one piece,
    // and a child's tensors, which need room in one piece each, find it
    // (a parent's tensors left where an earlier use put them split it: a
    // budget of what nesting holds at once failed mid-training). Where
    // there is room, and where the budget holds every tensor, each keeps
    // its place. (One prefetched below where it belongs, its copy in
    // flight: the use waits for the copies, then places it again.)
    for (int i = 0; i < static_cast<int>(entries_.size()); ++i) {
      const Entry& e = entries_[i];
      if (!kept[i] || e.pins > 0 || e.state != State::kCopying) continue;
      if (Holds(i) && !OnTop(i, kept)) {
        Reap(/*wait=*/true);
        break;
      }
    }
    for (int i = 0; i < static_cast<int>(entries_.size()); ++i) {
      Entry& e = entries_[i];
      if (!kept[i] || e.pins > 0 || !Holds(i)) continue;
      if (e.state != State::kReady && e.state != State::kStale) continue;
      if (OnTop(i, kept)) continue;
      RETURN_IF_ERROR(Evict(i));
    }
  }
  std::fill(kept.begin(), kept.end(), false);
  for (int unit : units) {
    for (int i : units_[unit].entries) {
      if (kept[i]) continue;  // (a tensor in two of the units, a tied weight: once)
      kept[i] = true;
      keep.push_back(i);
      if (entries_[i].state == State::kAbsent || entries_[i].state == State::kStale) {
        missing.push_back(i);
      }
    }
  }
  if (missing.empty()) return absl::OkStatus();
  std::vector<int> placed;
  auto undo = [&] {
    for (int i : placed) GiveUpCopy(entries_[i]);
  };
  for (bool moved = false;;) {
    // The largest first: the units' small tensors placed first would split
    // the room a large one needs.
    std::stable_sort(missing.begin(), missing.end(),
                     [this](int a, int b) { return entries_[a].bytes > entries_[b].bytes; });
    absl::Status status;
    for (int i : missing) {
      if (entries_[i].state == State::kStale) {
        // Copied into its place, so that views of it stay valid. The copy
        // comes after the compute issued before Invalidate (its fence), and
        // nothing reads a stale place without a Use, which waits for it.
        entries_[i].state = State::kCopying;
        entries_[i].in_place = true;
        placed.push_back(i);
        continue;
      }
      absl::StatusOr<uint64_t> offset =
          Place(entries_[i].bytes, entries_[i].persistent, limit, keep, RoomBelow(i));
      if (!offset.ok()) {
        status = offset.status();
        break;
      }
      entries_[i].offset = *offset;
      entries_[i].state = State::kCopying;
      placed.push_back(i);
    }
    if (status.ok()) break;
    undo();
    placed.clear();
    // No room in one piece for a use (what the policy gave way): what
    // splits it may be the units' own tensors resident and not in use,
    // where the tensors placed before the failure went (the room they took
    // free before what was given back for the next one), persistent ones,
    // or copies that were in flight. Everything that is not in use goes
    // (the copies waited for first), and the units' tensors are placed
    // again, the largest first, into what is then free around what is in
    // use. (Once; a prefetch waits for room instead.)
    if (moved || limit != kNever || !absl::IsResourceExhausted(status)) return status;
    moved = true;
    Reap(/*wait=*/true);
    for (int i = 0; i < static_cast<int>(entries_.size()); ++i) {
      const Entry& e = entries_[i];
      if (kept[i] || e.pins > 0) continue;
      if (e.state == State::kReady || e.state == State::kStale) {
        RETURN_IF_ERROR(Evict(i));
      }
    }
    for (int i : keep) {
      Entry& e = entries_[i];
      if (e.pins > 0) continue;
      // (A prefetch of it, waited for, failed: the use reports that,
      // TakeFailure, not a want of room.)
      if (e.state == State::kFailed) return absl::OkStatus();
      if (e.state == State::kReady) {
        RETURN_IF_ERROR(Evict(i));
        missing.push_back(i);
      } else if (e.state == State::kStale) {
        // (A step's new values, to be copied into its place: placed afresh
        // instead. Only resident units keep views of their places, and
        // they never run out of room.)
        RETURN_IF_ERROR(Evict(i));
      }
    }
  }
  auto batch = std::make_shared<Batch>();
  for (int i : missing) batch->keys.push_back(entries_[i].key);
  absl::StatusOr<std::vector<HostSource::Span>> spans = source_->Hold(batch->keys);
  if (!spans.ok() || spans->size() != missing.size()) {
    undo();
    return spans.ok() ? absl::InternalError("host source answered the wrong number of tensors")
                      : spans.status();
  }
  for (size_t k = 0; k < missing.size(); ++k) {
    const Entry& e = entries_[missing[k]];
    if ((*spans)[k].bytes < e.bytes) {
      undo();
      (void)source_->Release(batch->keys);
      return absl::InvalidArgumentError(
          absl::StrFormat("tensor %d was declared with %d bytes; its host memory holds %d", e.key,
                          e.bytes, (*spans)[k].bytes));
    }
  }
  absl::StatusOr<Event> done = TakeEvent();
  if (!done.ok()) {
    undo();
    (void)source_->Release(batch->keys);
    return done.status();
  }
  batch->done = *std::move(done);
  for (size_t k = 0; k < missing.size(); ++k) {
    Entry& e = entries_[missing[k]];
    absl::Status s = CopyIn(e, (*spans)[k]);
    if (!s.ok()) {
      // Copies already issued may still read: wait for them, then undo.
      (void)device_->Record(fence_, copy_stream_);
      (void)WaitOnHost(fence_);
      undo();
      (void)source_->Release(batch->keys);
      return s;
    }
    e.batch = batch;
    e.used_in_flight = false;
    batch->entries.push_back(missing[k]);
  }
  if (absl::Status recorded = device_->Record(batch->done, copy_stream_); !recorded.ok()) {
    // Its copies are issued but nothing would say when they end: waited
    // for as far as the device lets us, then given up (their holds let go,
    // the next use copies again) rather than left in flight for good.
    (void)device_->Record(fence_, copy_stream_);
    (void)WaitOnHost(fence_);
    FinishBatch(*batch, recorded);
    return recorded;
  }
  in_flight_.push_back(std::move(batch));
  return absl::OkStatus();
}

void ParamCache::FinishBatch(Batch& b, const absl::Status& status) {
  for (int i : b.entries) {
    Entry& e = entries_[i];
    if (e.state != State::kCopying || e.batch.get() != &b) continue;
    if (status.ok()) {
      e.batch.reset();
      e.in_place = false;
      e.state = State::kReady;
      e.used_in_flight = false;
      continue;
    }
    ++stats_.copy_failures;
    const std::string what =
        absl::StrFormat("copy of tensor %d (%d bytes) to %s failed: %s; the host copy is intact",
                        e.key, e.bytes, device_->name(), status.message());
    const bool in_place = GiveUpCopy(e);  // (the next use copies again)
    if (e.used_in_flight || e.pins > 0) {
      // Reported by Synchronize, once; the next use copies again.
      if (failed_after_use_.ok()) {
        failed_after_use_ = absl::AbortedError(absl::StrCat(
            what,
            "; a use of it was already issued, so this iteration's results are not valid: "
            "run it again"));
      }
    } else {
      if (!in_place) e.state = State::kFailed;
      e.error = absl::Status(status.code(), what);
    }
    e.used_in_flight = false;
  }
  b.entries.clear();
  spare_events_.push_back(std::move(b.done));  // complete: reused by a later batch
  absl::Status released = source_->Release(b.keys);
  if (!released.ok() && failed_after_use_.ok()) failed_after_use_ = released;
  b.keys.clear();
}

void ParamCache::Reap(bool wait) {
  while (!in_flight_.empty()) {
    std::shared_ptr<Batch> b = in_flight_.front();
    absl::Status status;
    if (wait) {
      status = WaitOnHost(b->done);
    } else {
      absl::StatusOr<bool> done = device_->Query(b->done);
      if (done.ok() && !*done) break;
      status = done.status();
    }
    in_flight_.pop_front();
    FinishBatch(*b, status);
  }
}

void ParamCache::Prefetch() {
  if (options_.prefetch_depth <= 0 || !on_trace_) return;
  uint64_t ahead = 0;
  int looked = 0;
  for (uint64_t pos = static_cast<uint64_t>(cursor_ + 1);
       pos < trace_.size() && looked < options_.prefetch_depth; ++pos, ++looked) {
    const int u = trace_[pos];
    if (HasFailureToReport(u)) break;  // its Use reports the failure
    uint64_t missing = 0;
    for (int i : units_[u].entries) {
      const State st = entries_[i].state;
      missing += st == State::kAbsent || st == State::kStale ? Rounded(entries_[i].bytes) : 0;
    }
    if (missing == 0) continue;
    if (ahead + missing > options_.prefetch_bytes) break;
    if (!BringAhead({u}, pos).ok()) break;  // no room ahead of later uses; Use will bring it
    ahead += missing;
  }
}

bool ParamCache::HasFailureToReport(int unit) const {
  for (int i : units_[unit].entries) {
    if (entries_[i].state == State::kFailed || !entries_[i].error.ok()) return true;
  }
  return false;
}

absl::Status ParamCache::BringAhead(absl::Span<const int> units, uint64_t limit) {
  std::vector<int> copied;
  std::vector<int> counted;
  for (int u : units) {
    bool any = false;
    for (int i : units_[u].entries) {
      if (entries_[i].state == State::kAbsent || entries_[i].state == State::kStale) {
        copied.push_back(i);
        any = true;
      }
    }
    if (any) counted.push_back(u);
  }
  if (copied.empty()) return absl::OkStatus();
  RETURN_IF_ERROR(Bring(units, limit));
  for (int i : copied) entries_[i].prefetched = true;
  stats_.prefetched_units += counted.size();
  return absl::OkStatus();
}

absl::Status ParamCache::PrefetchUnits(absl::Span<const int> units) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUnits(units));
  Reap(/*wait=*/false);
  std::vector<int> bring;
  for (int u : units) {
    if (!HasFailureToReport(u)) bring.push_back(u);  // (its Use reports the failure)
  }
  if (bring.empty()) return absl::OkStatus();
  // Evicting only what this iteration does not use again, waiting for no
  // copy in flight (a limit past every position but kNever's).
  return BringAhead(bring, kNever - 1);
}

absl::Status ParamCache::CheckUnits(absl::Span<const int> units) const {
  std::vector<bool> named(units_.size());
  for (int unit : units) {
    if (unit < 0 || static_cast<size_t>(unit) >= units_.size()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("no unit %d (%d declared)", unit, units_.size()));
    }
    if (named[unit])
      return absl::InvalidArgumentError(absl::StrFormat("unit %d named twice", unit));
    named[unit] = true;
  }
  return absl::OkStatus();
}

absl::Status ParamCache::TakeFailure(int unit) {
  for (int i : units_[unit].entries) {
    Entry& e = entries_[i];
    // (As HasFailureToReport asks: an entry whose failed in-place copy was
    // evicted since keeps its error, to be reported here once.)
    if (e.state == State::kFailed || !e.error.ok()) {
      absl::Status error = std::exchange(e.error, absl::OkStatus());
      for (int j : units_[unit].entries) {
        if (entries_[j].state == State::kFailed) entries_[j].state = State::kAbsent;
        entries_[j].error = absl::OkStatus();
      }
      return error;
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<uint64_t>> ParamCache::Use(int unit, const Stream& compute) {
  ASSIGN_OR_RETURN(std::vector<std::vector<uint64_t>> offsets,
                   Use(absl::MakeConstSpan(&unit, 1), compute));
  return std::move(offsets[0]);
}

absl::StatusOr<std::vector<std::vector<uint64_t>>> ParamCache::Use(absl::Span<const int> units,
                                                                   const Stream& compute) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUnits(units));
  Reap(/*wait=*/false);
  // A failed copy is reported once, at the unit's next use; the one after
  // copies again.
  for (int unit : units) RETURN_IF_ERROR(TakeFailure(unit));
  std::vector<std::vector<State>> before;
  // The order's place and the counts as they were: a use that fails (no
  // room, say, asked again) leaves them so.
  const int64_t cursor = cursor_;
  const bool on_trace = on_trace_;
  const size_t recorded = recording_.size();
  const uint64_t uses = stats_.uses, off_trace = stats_.off_trace_uses;
  auto failed = [&](absl::Status status) {
    cursor_ = cursor;
    on_trace_ = on_trace;
    recording_.resize(recorded);
    stats_.uses = uses;
    stats_.off_trace_uses = off_trace;
    return status;
  };
  for (int unit : units) {
    AdvanceCursor(unit);
    ++stats_.uses;
    before.emplace_back();
    for (int i : units_[unit].entries) before.back().push_back(entries_[i].state);
  }
  // What is in use now stays in use while these are: a holder (whether
  // this use finds room or not).
  for (Unit& u : units_) {
    if (u.in_use > 0) u.holder = true;
  }
  if (absl::Status brought = Bring(units, kNever); !brought.ok()) {
    if (absl::IsResourceExhausted(brought)) {
      // Refused for room: the holders in use learn what their children
      // wanted at once, so that their next use leaves room for it.
      uint64_t wanted = 0;
      for (int unit : units) wanted += units_[unit].bytes;
      for (Unit& u : units_) {
        if (u.in_use > 0 && pinned_bytes_ + wanted > u.pinned_at_use) {
          u.below = std::max(u.below, pinned_bytes_ + wanted - u.pinned_at_use);
        }
      }
    }
    return failed(brought);
  }
  // Making room may have finished earlier batches, a prefetch of these
  // units' tensors among them, and found it failed: reported now, not used.
  for (int unit : units) {
    if (absl::Status s = TakeFailure(unit); !s.ok()) return failed(s);
  }
  // `compute` waits for every batch a tensor is still copied in, once each,
  // before any pin is taken (a failed wait leaves nothing in use; the
  // copies complete or fail on their own).
  std::vector<const Batch*> waited;
  for (int unit : units) {
    for (int i : units_[unit].entries) {
      const Entry& e = entries_[i];
      if (e.state != State::kCopying) continue;
      if (std::find(waited.begin(), waited.end(), e.batch.get()) != waited.end()) continue;
      if (absl::Status s = device_->WaitOn(compute, e.batch->done); !s.ok()) return failed(s);
      waited.push_back(e.batch.get());
    }
  }
  std::vector<std::vector<uint64_t>> offsets(units.size());
  for (size_t n = 0; n < units.size(); ++n) {
    const std::vector<int>& list = units_[units[n]].entries;
    for (size_t k = 0; k < list.size(); ++k) {
      Entry& e = entries_[list[k]];
      const State was = before[n][k];
      ++stats_.tensor_uses;
      // Disjoint, as the daemon's stats count them: a prefetched copy is a
      // prefetch hit whether it is done or still in flight.
      if (was != State::kAbsent && e.prefetched) {
        ++stats_.prefetch_hits;
      } else if (was == State::kReady) {
        ++stats_.resident_hits;
      }
      e.prefetched = false;
      if (e.state == State::kCopying) {
        if (was == State::kCopying) ++stats_.in_flight_at_use;
        e.used_in_flight = true;
      }
      if (e.pins++ == 0) pinned_bytes_ += Rounded(e.bytes);
      offsets[n].push_back(e.offset);
    }
  }
  // What the units in use held besides themselves at once, learnt: the room
  // a holder needs below it (RoomBelow).
  for (Unit& u : units_) {
    if (u.in_use > 0 && pinned_bytes_ > u.pinned_at_use) {
      u.below = std::max(u.below, pinned_bytes_ - u.pinned_at_use);
    }
  }
  for (int unit : units) {
    ++units_[unit].in_use;
    units_[unit].pinned_at_use = pinned_bytes_;
  }
  Prefetch();
  return offsets;
}

absl::Status ParamCache::Done(int unit, const Stream& compute) {
  return Done(absl::MakeConstSpan(&unit, 1), compute);
}

absl::Status ParamCache::Done(absl::Span<const int> units, const Stream& compute) {
  absl::MutexLock lock(&mu_);
  RETURN_IF_ERROR(CheckUnits(units));
  for (int unit : units) {
    // (By the unit's count: a tensor it shares with a unit in use, a tied
    // weight, is pinned without it.)
    if (units_[unit].in_use == 0) {
      return absl::FailedPreconditionError(absl::StrFormat("Done(%d) without a Use of it", unit));
    }
  }
  // Every event recorded before any pin goes: a device error leaves all of
  // them in use.
  for (int unit : units) {
    Unit& u = units_[unit];
    if (!u.released) {
      ASSIGN_OR_RETURN(u.released, device_->CreateEvent());
    }
    RETURN_IF_ERROR(device_->Record(u.released, compute));
  }
  for (int unit : units) {
    Unit& u = units_[unit];
    u.released_recorded = true;
    --u.in_use;
    for (int i : u.entries) {
      if (--entries_[i].pins == 0) pinned_bytes_ -= Rounded(entries_[i].bytes);
      entries_[i].released_recorded = true;
    }
  }
  // (A unit let go before one used after it: what the others hold counts
  // from here.)
  for (Unit& u : units_) u.pinned_at_use = std::min(u.pinned_at_use, pinned_bytes_);
  return absl::OkStatus();
}

absl::Status ParamCache::Invalidate(const Stream& compute) {
  absl::MutexLock lock(&mu_);
  Reap(/*wait=*/true);
  for (const Entry& e : entries_) {
    if (e.pins > 0) {
      return absl::FailedPreconditionError(
          absl::StrFormat("the parameters changed while tensor %d is in use on the device", e.key));
    }
  }
  RETURN_IF_ERROR(device_->Record(fence_, compute));
  RETURN_IF_ERROR(device_->WaitOn(copy_stream_, fence_));
  // Each tensor keeps its place (stale): its next use copies the new values
  // there, so that views of it (autograd's saved tensors) stay where they
  // were; of tensors used equally far ahead, a stale one gives its room
  // first. (A copy whose batch never got its event is given up here.)
  for (Entry& e : entries_) {
    if (e.state == State::kCopying) GiveUpCopy(e);
    if (e.state == State::kReady || e.state == State::kStale) {
      e.state = State::kStale;
    } else {
      e.state = State::kAbsent;
    }
    e.error = absl::OkStatus();
    e.prefetched = false;
    e.released_recorded = false;
  }
  for (Unit& u : units_) u.released_recorded = false;
  ++stats_.invalidations;
  return absl::OkStatus();
}

absl::Status ParamCache::WaitOnHost(const Event& event) {
  return host_wait_ ? host_wait_(event) : device_->Synchronize(event);
}

void ParamCache::SetHostWait(HostWait wait) {
  absl::MutexLock lock(&mu_);
  host_wait_ = std::move(wait);
}

absl::Status ParamCache::Synchronize() {
  absl::MutexLock lock(&mu_);
  Reap(/*wait=*/true);
  return std::exchange(failed_after_use_, absl::OkStatus());
}

void ParamCache::AwaitCopies() {
  absl::MutexLock lock(&mu_);
  Reap(/*wait=*/true);
}

void ParamCache::SetPrefetch(int depth, uint64_t bytes) {
  absl::MutexLock lock(&mu_);
  options_.prefetch_depth = depth;
  options_.prefetch_bytes = bytes;
}

std::vector<uint64_t> ParamCache::Keys() const {
  absl::MutexLock lock(&mu_);
  std::vector<uint64_t> keys;
  keys.reserve(entries_.size());
  for (const Entry& e : entries_) keys.push_back(e.key);
  return keys;
}

ParamCacheStats ParamCache::stats() const {
  absl::MutexLock lock(&mu_);
  return stats_;
}

}  // namespace offload::gpu
