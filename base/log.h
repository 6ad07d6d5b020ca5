// Minimal leveled logging to stderr for the daemon: one line per call,
// prefixed with a UTC timestamp and the level; where stderr is the systemd
// journal (JOURNAL_STREAM), with the journal's priority prefix instead and
// no timestamp (the journal adds its own). Thread-safe (one write(2) per
// line). absl's 2022 LTS has no logging library.
#ifndef OFFLOADD_BASE_LOG_H_
#define OFFLOADD_BASE_LOG_H_

#include <string>

#include "absl/strings/str_format.h"
#include "absl/time/time.h"

namespace offload {

enum class LogLevel { kInfo, kWarning, kError };

void LogLine(LogLevel level, const std::string& message);

// The line LogLine writes (for the journal, or with the time `now`).
std::string FormatLogLine(LogLevel level, const std::string& message, bool journal, absl::Time now);

template <typename... Args>
void LogInfo(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kInfo, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogWarning(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kWarning, absl::StrFormat(format, args...));
}
template <typename... Args>
void LogError(const absl::FormatSpec<Args...>& format, const Args&... args) {
  LogLine(LogLevel::kError, absl::StrFormat(format, args...));
}

}  // namespace offload

#endif  // OFFLOADD_BASE_LOG_H_
