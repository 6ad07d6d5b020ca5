#include "base/directory.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>

#include "absl/strings/str_cat.h"
#include "base/posix_error.h"
#include "base/unique_fd.h"

namespace offload {

namespace {

// The names `d` holds, sorted; closes it.
std::vector<std::string> ReadAndClose(DIR* d) {
  std::vector<std::string> names;
  if (d == nullptr) return names;
  while (const dirent* e = readdir(d)) {
    const absl::string_view name = e->d_name;
    if (name != "." && name != "..") names.emplace_back(name);
  }
  closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

std::vector<std::string> ListDirectory(const std::string& dir) {
  return ReadAndClose(opendir(dir.c_str()));
}

std::vector<std::string> ListDirectory(int dir_fd) {
  // A descriptor of its own (fdopendir takes it over), at the start.
  const int fd = openat(dir_fd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return {};
  DIR* d = fdopendir(fd);
  if (d == nullptr) close(fd);
  return ReadAndClose(d);
}

bool IsDirectory(const std::string& path) {
  struct stat st;
  return lstat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool PrivateToThisUser(const struct stat& st) {
  return (st.st_uid == geteuid() || st.st_uid == 0) && (st.st_mode & (S_IWGRP | S_IWOTH)) == 0;
}

bool SameFile(const std::string& a, const std::string& b) {
  struct stat x, y;
  return stat(a.c_str(), &x) == 0 && stat(b.c_str(), &y) == 0 && x.st_dev == y.st_dev &&
         x.st_ino == y.st_ino;
}

void RemoveDirectoryOfFiles(const std::string& dir) {
  if (!IsDirectory(dir)) return;
  for (const std::string& name : ListDirectory(dir)) {
    const std::string path = absl::StrCat(dir, "/", name);
    struct stat st;
    if (lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) unlink(path.c_str());
  }
  rmdir(dir.c_str());
}

absl::Status SyncDirectory(const std::string& dir) {
  UniqueFd fd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) return PosixError(absl::StrCat("opening directory ", dir), errno);
  if (fsync(fd.get()) != 0) return PosixError(absl::StrCat("fsync of directory ", dir), errno);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& dir, const std::string& name,
                                 absl::string_view bytes) {
  const std::string path = absl::StrCat(dir, "/", name), tmp = path + ".tmp";
  UniqueFd fd(open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600));
  if (fd.get() < 0) return PosixError(absl::StrCat("creating ", tmp), errno);
  for (absl::string_view left = bytes; !left.empty();) {
    const ssize_t n = write(fd.get(), left.data(), left.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return PosixError(absl::StrCat("writing ", tmp), errno);
    left.remove_prefix(static_cast<size_t>(n));
  }
  if (fsync(fd.get()) != 0) return PosixError(absl::StrCat("fsync of ", tmp), errno);
  if (rename(tmp.c_str(), path.c_str()) != 0) {
    return PosixError(absl::StrCat("renaming ", tmp), errno);
  }
  return SyncDirectory(dir);
}

}  // namespace offload
