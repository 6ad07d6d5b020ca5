#include "base/span_maps.h"

#include <utility>

namespace offload {

absl::StatusOr<MappedSpan> SpanMaps::Map(uint64_t offset, uint64_t bytes, Pages pages) {
  if (!SharesWindow(offset, bytes, pages)) {
    absl::StatusOr<HostMemory> own = map_(offset, bytes, pages);
    if (!own.ok()) return own.status();
    auto mapping = std::make_shared<const HostMemory>(*std::move(own));
    std::byte* data = mapping->data();
    return MappedSpan(std::move(mapping), data, bytes, /*shared=*/false);
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
    absl::StatusOr<HostMemory> mapped = map_(begin, kWindowBytes, Pages::kSmall);
    if (!mapped.ok()) return mapped.status();
    window = std::make_shared<const HostMemory>(*std::move(mapped));
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
