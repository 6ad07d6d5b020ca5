#include "checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/directory.h"
#include "base/posix_error.h"
#include "base/status_macros.h"
#include "base/unique_fd.h"

namespace offload::checkpoint {
namespace {

uint64_t Numel(const std::vector<uint64_t>& shape) {
  uint64_t n = 1;
  for (uint64_t d : shape) n *= d;
  return n;
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
    const uint64_t bytes = Numel(t.shape) * sizeof(float);
    fields.push_back(absl::StrCat(JsonString(t.name), ":{\"dtype\":\"F32\",\"shape\":[",
                                  absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", offset, ",",
                                  offset + bytes, "]}"));
    offset += bytes;
  }
  std::string header = absl::StrCat("{", absl::StrJoin(fields, ","), "}");
  header.append((8 - header.size() % 8) % 8, ' ');
  const uint64_t header_len = header.size();  // little-endian on every target we build

  const std::string tmp = path + ".tmp";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) return PosixError(absl::StrCat("creating ", tmp), errno);
  absl::Status status = [&]() -> absl::Status {
    RETURN_IF_ERROR(WriteAll(fd.get(), &header_len, 8, tmp));
    RETURN_IF_ERROR(WriteAll(fd.get(), header.data(), header.size(), tmp));
    std::vector<float> values;
    for (const SafetensorsEntry& t : tensors) {
      values.assign(Numel(t.shape), 0.0f);
      RETURN_IF_ERROR(t.fill(values.data()));
      RETURN_IF_ERROR(WriteAll(fd.get(), values.data(), values.size() * sizeof(float), tmp));
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
