#include "base/descriptors.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>

namespace offload {

DescriptorUse CountDescriptors(const std::string& fd_dir) {
  DescriptorUse use;
  rlimit lim{};
  if (getrlimit(RLIMIT_NOFILE, &lim) == 0) {
    use.limit = lim.rlim_cur == RLIM_INFINITY ? INT64_MAX : static_cast<int64_t>(lim.rlim_cur);
  }
  DIR* dir = opendir(fd_dir.c_str());
  if (dir == nullptr) {
    use.open = use.limit;  // EMFILE (or no /proc): nothing to spare
    return use;
  }
  int64_t n = 0;
  while (const dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(dir);
  // The directory's own descriptor is among the entries when it is ours.
  use.open = fd_dir == "/proc/self/fd" && n > 0 ? n - 1 : n;
  return use;
}

SpareDescriptor::SpareDescriptor() {
  absl::MutexLock lock(&mu_);
  Open();
}

void SpareDescriptor::Open() { spare_.reset(open("/dev/null", O_RDONLY | O_CLOEXEC)); }

bool SpareDescriptor::held() const {
  absl::MutexLock lock(&mu_);
  return spare_.valid();
}

}  // namespace offload
