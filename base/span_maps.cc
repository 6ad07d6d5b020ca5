#include "base/span_maps.h"

#include <utility>

namespace offload {

absl::StatusOr<std::shared_ptr<const HostMemory>> SpanMaps::MapCounted(uint64_t offset,
                                                                       uint64_t bytes,
                                                                       Pages pages) {
  absl::StatusOr<HostMemory> mapped = map_(offset, bytes, pages);
  if (!mapped.ok()) return mapped.status();
  if (mapped_ == nullptr) return std::make_shared<const HostMemory>(*std::move(mapped));
  mapped_->fetch_add(1);
  // Uncounted as it is unmapped (the counter outlives this object).
  return std::shared_ptr<const HostMemory>(new HostMemory(*std::move(mapped)),
                                           [counter = mapped_](const HostMemory* m) {
                                             delete m;
                                             counter->fetch_sub(1);
                                           });
}

absl::StatusOr<MappedSpan> SpanMaps::Map(uint64_t offset, uint64_t bytes, Pages pages) {
  if (!SharesWindow(offset, bytes, pages)) {
    absl::StatusOr<std::shared_ptr<const HostMemory>> own = MapCounted(offset, bytes, pages);
    if (!own.ok()) return own.status();
    std::byte* data = (*own)->data();
    return MappedSpan(*std::move(own), data, bytes, /*shared=*/false);
  }
  const uint64_t index = offset / kWindowBytes;
  const uint64_t begin = index * kWindowBytes;
  absl::MutexLock lock(&mu_);
  std::shared_ptr<const HostMemory> window;
  if (auto it = windows_.find(index); it != windows_.end()) window = it->second.lock();
  if (window == nullptr) {
    // Under the lock: two spans of one window never map it twice. Expired
    // entries go as windows are mapped, so the table holds at most the
    // windows mapped now and one being replaced.
    absl::erase_if(windows_, [](const auto& e) { return e.second.expired(); });
    absl::StatusOr<std::shared_ptr<const HostMemory>> mapped =
        MapCounted(begin, kWindowBytes, Pages::kSmall);
    if (!mapped.ok()) return mapped.status();
    window = *std::move(mapped);
    windows_[index] = window;
  }
  std::byte* data = window->data() + (offset - begin);
  return MappedSpan(std::move(window), data, bytes, /*shared=*/true);
}

int SpanMaps::windows() const {
  absl::MutexLock lock(&mu_);
  int live = 0;
  for (const auto& [index, window] : windows_) live += window.expired() ? 0 : 1;
  return live;
}

}  // namespace offload
