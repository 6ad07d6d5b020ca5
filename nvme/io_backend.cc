#include "nvme/io_backend.h"

#include "absl/strings/str_cat.h"

namespace offload {

std::string DescribeIo(const IoRequest& r, const std::string& path) {
  return absl::StrCat(r.op == IoOp::kRead ? "read of " : "write of ", r.length, " bytes at offset ",
                      r.offset, r.op == IoOp::kRead ? " from " : " to ", path);
}

}  // namespace offload
