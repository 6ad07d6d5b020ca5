// Small things done to directories and whole files, shared by the
// checkpoint format, the sessions offloadd keeps across a restart, and the
// benchmarks.
//
// Thread-safety: plain functions; the file system serialises what it must.
#ifndef OFFLOADD_BASE_DIRECTORY_H_
#define OFFLOADD_BASE_DIRECTORY_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace offload {

// The names in `dir`, sorted, without "." and ".."; none if it cannot be
// read.
std::vector<std::string> ListDirectory(const std::string& dir);

// True if `path` is a directory itself (not a link to one).
bool IsDirectory(const std::string& path);

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
