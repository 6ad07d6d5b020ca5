#ifndef OFFLOADD_ENGINE_VERSION_H_
#define OFFLOADD_ENGINE_VERSION_H_

namespace offload {
inline constexpr char kOffloaddVersion[] = "0.1.0";
}  // namespace offload

#endif  // OFFLOADD_ENGINE_VERSION_H_
