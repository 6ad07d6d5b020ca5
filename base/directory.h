// Small things done to directories and whole files, shared by the
// checkpoint format, the sessions offloadd keeps across a restart, and the
// benchmarks.
//
// Thread-safety: plain functions; the file system serialises what it must.
#ifndef OFFLOADD_BASE_DIRECTORY_H_
#define OFFLOADD_BASE_DIRECTORY_H_

#include <sys/stat.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace offload {

// The names in `dir`, sorted, without "." and ".."; none if it cannot be
// read.
std::vector<std::string> ListDirectory(const std::string& dir);
// The same of the directory open as `dir_fd` (which stays open and is not
// moved).
std::vector<std::string> ListDirectory(int dir_fd);

// True if `path` is a directory itself (not a link to one).
bool IsDirectory(const std::string& path);

// Whether what `st` describes belongs to this process's user (or root) and
// no one else may write it: what offloadd's own state may live in or be
// read from (another user could plant or replace it otherwise).
bool PrivateToThisUser(const struct stat& st);

// True if `a` and `b` name the same file (device and inode, links
// followed); false if either cannot be looked up.
bool SameFile(const std::string& a, const std::string& b);

// Removes `dir` if it is a real directory holding only plain files: those
// files and then the directory. Nothing a link points to is touched; a
// directory with anything else in it stays (its plain files gone).
void RemoveDirectoryOfFiles(const std::string& dir);

// fsync of the directory itself: its entries (a file created, renamed or
// removed in it) are durable once this returns.
absl::Status SyncDirectory(const std::string& dir);

// `bytes` as the whole of `dir`/`name`, atomically: a temporary file
// (owner-only), fsync, rename over the name, fsync of the directory. A
// crash leaves the old file or the new one, never a part.
absl::Status WriteFileAtomically(const std::string& dir, const std::string& name,
                                 absl::string_view bytes);

}  // namespace offload

#endif  // OFFLOADD_BASE_DIRECTORY_H_
