#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "base/directory.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"

namespace offload::checkpoint {
namespace {

// The product of `shape`, or nullopt past 2^61 (bytes past 2^63).
std::optional<uint64_t> Numel(const std::vector<uint64_t>& shape) {
  constexpr uint64_t kMax = uint64_t{1} << 61;
  uint64_t n = 1;
  for (uint64_t d : shape) {
    if (d != 0 && n > kMax / d) return std::nullopt;
    n *= d;
  }
  return n;
}

// Creates a file of its own beside `path` (O_EXCL: never one that was there,
// nor where a link points), with the mode a plain create would give.
absl::StatusOr<std::pair<UniqueFd, std::string>> CreateTemporary(const std::string& path) {
  for (int attempt = 0;; ++attempt) {
    std::string tmp = absl::StrCat(path, ".tmp.", getpid(), ".", absl::ToUnixNanos(absl::Now()));
    UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (fd.get() >= 0) return std::make_pair(std::move(fd), std::move(tmp));
    if (errno != EEXIST || attempt == 100) {
      return PosixError(absl::StrCat("creating a temporary file beside ", path), errno);
    }
  }
}

absl::Status WriteAll(int fd, const void* data, size_t bytes, const std::string& path) {
  const auto* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      return PosixError(absl::StrCat("writing ", bytes, " bytes to ", path), errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

}  // namespace

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    const auto u = static_cast<unsigned char>(c);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (u < 0x20) {
      out += absl::StrFormat("\\u%04x", u);
    } else {
      out.push_back(c);  // UTF-8 passes through
    }
  }
  out.push_back('"');
  return out;
}

absl::Status WriteSafetensors(const std::string& path, const std::vector<SafetensorsEntry>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  std::vector<std::string> fields;
  if (!metadata.empty()) {
    std::vector<std::string> kv;
    for (const auto& [k, v] : metadata) kv.push_back(JsonString(k) + ":" + JsonString(v));
    fields.push_back(absl::StrCat("\"__metadata__\":{", absl::StrJoin(kv, ","), "}"));
  }
  uint64_t offset = 0;
  for (const SafetensorsEntry& t : tensors) {
    if (t.name.empty() || t.name == "__metadata__" || !names.insert(t.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor name '", t.name, "' is empty, reserved or repeated"));
    }
    const std::optional<uint64_t> numel = Numel(t.shape);
    constexpr uint64_t kMaxBytes = uint64_t{1} << 63;
    if (!numel.has_value() || *numel * sizeof(float) > kMaxBytes - offset) {
      return absl::InvalidArgumentError(
          absl::StrCat("safetensors: tensor '", t.name, "' ends past 2^63 bytes (shape [",
                       absl::StrJoin(t.shape, ","), "] after ", offset, " bytes)"));
    }
    const uint64_t bytes = *numel * sizeof(float);
    fields.push_back(absl::StrCat(JsonString(t.name), ":{\"dtype\":\"F32\",\"shape\":[",
                                  absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",",
                                  offset + bytes, "]}"));
    offset += bytes;
  }
  std::string header = absl::StrCat("{", absl::StrJoin(fields, ","), "}");
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_len = header.size();  // little-endian on every target we build

  ASSIGN_OR_RETURN(auto created, CreateTemporary(path));
  const UniqueFd fd = std::move(created.first);
  const std::string tmp = std::move(created.second);
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(WriteAll(fd.get(), &header_len, 8, tmp));
    RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), tmp));
    std::vector<float> values;
    for (const SafetensorsEntry& t : tensors) {
      const uint64_t numel = *Numel(t.shape);
      for (uint64_t begin = 0; begin < numel; begin += kSafetensorsChunk) {
        const uint64_t n = std::min(kSafetensorsChunk, numel - begin);
        values.assign(n, 0.0f);
        RETURN_IF_ERROR(t.fill(begin, n, values.data()));
        RETURN_IF_ERROR(WriteAll(fd.get(), values.data(), n * sizeof(float), tmp));
      }
    }
    if (fsync(fd.get()) != 0) return PosixError(absl::StrCat("fsync of ", tmp), errno);
    if (rename(tmp.c_str(), path.c_str()) != 0) {
      return PosixError(absl::StrCat("renaming ", tmp, " to ", path), errno);
    }
    // The name durable too (a crash could otherwise lose the file).
    const size_t slash = path.rfind('/');
    return SyncDirectory(slash == std::string::npos ? "."
                         : slash == 0               ? "/"
                                                    : path.substr(0, slash));
  }();
  if (!status.ok()) unlink(tmp.c_str());
  return status;
}

}  // namespace offload::checkpoint
