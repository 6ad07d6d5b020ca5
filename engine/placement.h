// Where a session's partitions rest: per kind of data, the share of its
// bytes homed on the host (the rest on NVMe). See partition_store.h.
#ifndef OFFLOADD_ENGINE_PLACEMENT_H_
#define OFFLOADD_ENGINE_PLACEMENT_H_

#include <optional>

namespace offload {

// The kinds of a partition's data that are placed independently.
enum class DataKind { kParams = 0, kGrads = 1, kOptimizerState = 2 };
inline constexpr int kDataKinds = 3;
const char* DataKindName(DataKind kind);

// Percentages of a session's bytes of each kind homed on the host.
struct Placement {
  int host_percent[kDataKinds] = {100, 100, 100};
  int& operator[](DataKind k) { return host_percent[static_cast<int>(k)]; }
  int operator[](DataKind k) const { return host_percent[static_cast<int>(k)]; }
};

// A change of some kinds' placement; unset kinds keep theirs.
struct PlacementChange {
  std::optional<int> host_percent[kDataKinds];
  std::optional<int>& operator[](DataKind k) { return host_percent[static_cast<int>(k)]; }
  const std::optional<int>& operator[](DataKind k) const {
    return host_percent[static_cast<int>(k)];
  }
};

}  // namespace offload

#endif  // OFFLOADD_ENGINE_PLACEMENT_H_
