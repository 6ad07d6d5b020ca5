#include "ipc/paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/posix_error.h"

namespace offload {

std::string DefaultDataDir() {
  if (const char* state = std::getenv("XDG_STATE_HOME"); state != nullptr && *state == '/') {
    return absl::StrCat(state, "/offloadd");
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home == '/') {
    return absl::StrCat(home, "/.local/state/offloadd");
  }
  return absl::StrCat("/tmp/offloadd-", getuid());
}

std::string SocketPathIn(const std::string& data_dir) {
  return absl::StrCat(data_dir, "/offloadd.sock");
}

std::string DefaultClientAddress() {
  if (const char* address = std::getenv("OFFLOADD_ADDRESS"); address != nullptr && *address) {
    return address;
  }
  const std::string own = SocketPathIn(DefaultDataDir());
  struct stat st;
  if (lstat(own.c_str(), &st) != 0 && lstat(kSystemSocketPath, &st) == 0 && S_ISSOCK(st.st_mode)) {
    return absl::StrCat("unix:", kSystemSocketPath);  // the node's system service
  }
  return absl::StrCat("unix:", own);
}

std::string TcpTokenPathIn(const std::string& data_dir) { return data_dir + "/tcp_token"; }

absl::Status MakeDirs(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("empty directory path");
  for (size_t pos = 1; pos <= dir.size(); ++pos) {
    if (pos != dir.size() && dir[pos] != '/') continue;
    std::string prefix = dir.substr(0, pos);
    const bool last = pos == dir.size();
    if (mkdir(prefix.c_str(), last ? 0700 : 0755) != 0 && errno != EEXIST) {
      return PosixError(absl::StrCat("creating directory ", prefix), errno);
    }
  }
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("stat ", dir), errno);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not a directory"));
  }
  return absl::OkStatus();
}

absl::Status CheckPrivateDir(const std::string& dir) {
  struct stat st;
  // A link another user made (in a sticky /tmp, say) could be pointed
  // elsewhere later: every path below goes through it.
  if (lstat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("lstat ", dir), errno);
  if (S_ISLNK(st.st_mode) && st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(dir, " is a symbolic link uid ", st.st_uid, " made, not this user (uid ",
                     geteuid(), "): it could point elsewhere later; use a directory of your own"));
  }
  if (stat(dir.c_str(), &st) != 0) return PosixError(absl::StrCat("stat ", dir), errno);
  if (st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " belongs to uid ", st.st_uid,
                                                      ", not to this user (uid ", geteuid(),
                                                      "); use a directory of your own"));
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "%s is writable by other users (mode %04o): they could replace what offloadd keeps "
        "there (its sockets, its files); "
        "chmod go-w it or choose another directory",
        dir, st.st_mode & 07777));
  }
  return absl::OkStatus();
}

}  // namespace offload
