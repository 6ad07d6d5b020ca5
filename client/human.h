// How offloadctl, its doctor and its top write sizes for a person: binary
// units with one decimal ("1.5 GiB", "512 B").
#ifndef OFFLOADD_CLIENT_HUMAN_H_
#define OFFLOADD_CLIENT_HUMAN_H_

#include <string>

#include "absl/strings/str_format.h"

namespace offload {

inline std::string HumanBytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) {
    bytes /= 1024;
    ++u;
  }
  return u == 0 ? absl::StrFormat("%.0f B", bytes) : absl::StrFormat("%.1f %s", bytes, units[u]);
}

}  // namespace offload

#endif  // OFFLOADD_CLIENT_HUMAN_H_
