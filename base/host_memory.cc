#include "base/host_memory.h"

#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/numeric/bits.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/posix_error.h"

namespace offload {
namespace {
std::atomic<bool> g_trim_requested{false};
}  // namespace

bool TrimHeap() {
#ifdef __GLIBC__
  malloc_trim(0);
  return true;
#else
  return false;
#endif
}

void RequestHeapTrim() { g_trim_requested.store(true, std::memory_order_relaxed); }

bool TrimHeapIfRequested() {
  return g_trim_requested.exchange(false, std::memory_order_relaxed) && TrimHeap();
}

bool TrimHeapIfHoarding(uint64_t free_bytes) {
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 33))
  return mallinfo2().fordblks >= free_bytes && TrimHeap();
#else
  (void)free_bytes;
  return false;
#endif
}

uint64_t PageSize() {
  static const uint64_t page = static_cast<uint64_t>(sysconf(_SC_PAGESIZE));
  return page;
}

uint64_t RoundUpToPage(uint64_t bytes) {
  const uint64_t page = PageSize();
  return RoundUp(bytes, page);
}

bool PopulateForWrite(std::byte* data, uint64_t bytes) {
  constexpr int kMadvPopulateWrite = 23;  // <linux/mman.h>, 5.14
  const uint64_t page = PageSize();
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data) / page * page;
  const uintptr_t end = reinterpret_cast<uintptr_t>(data) + bytes;
  return madvise(reinterpret_cast<void*>(begin), end - begin, kMadvPopulateWrite) == 0;
}

absl::Status DiscardSharedPages(std::byte* data, uint64_t bytes) {
  if (madvise(data, RoundUpToPage(bytes), MADV_REMOVE) != 0) {
    return PosixError(absl::StrCat("freeing ", bytes, " bytes of shared memory"), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<HostMemory> HostMemory::Allocate(uint64_t bytes, Pages pages) {
  if (bytes == 0) return HostMemory();
  const uint64_t mapped = RoundUpToPage(bytes);
  void* p = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return PosixError(absl::StrCat("mmap ", bytes, " bytes"), errno);
  // Best effort (THP may be off); see the header.
  if (pages == Pages::kHuge) madvise(p, mapped, MADV_HUGEPAGE);
  if (pages == Pages::kSmall) madvise(p, mapped, MADV_NOHUGEPAGE);
  return HostMemory(static_cast<std::byte*>(p), bytes, mapped);
}

absl::StatusOr<HostMemory> HostMemory::MapShared(int fd, uint64_t offset, uint64_t bytes,
                                                 Pages pages) {
  if (bytes == 0) return HostMemory();
  const uint64_t mapped = RoundUpToPage(bytes);
  auto failed = [&](int err) {
    return PosixError(
        absl::StrCat("mmap ", bytes, " bytes at offset ", offset, " of descriptor ", fd, " shared"),
        err);
  };
  void* at = nullptr;
  int flags = MAP_SHARED | MAP_NORESERVE;
  if (pages == Pages::kHuge) {
    // At an address congruent to `offset` modulo the huge page size, so that
    // the file's huge pages map whole (and the caller can rely on that
    // alignment whatever the kernel would have chosen): reserve a huge
    // page more than needed, map the file over the right part of it, give
    // the rest back.
    const uint64_t huge = HugePageAlignment();
    void* reserved =
        mmap(nullptr, mapped + huge, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (reserved == MAP_FAILED) return failed(errno);
    const auto base = reinterpret_cast<uintptr_t>(reserved);
    const uintptr_t addr = base + ((offset % huge) + huge - base % huge) % huge;
    if (addr > base) munmap(reserved, addr - base);
    munmap(reinterpret_cast<void*>(addr + mapped), base + huge - addr);  // addr < base + huge
    at = reinterpret_cast<void*>(addr);
    flags |= MAP_FIXED;
  }
  void* p = mmap(at, mapped, PROT_READ | PROT_WRITE, flags, fd, static_cast<off_t>(offset));
  if (p == MAP_FAILED) {
    const int err = errno;
    if (at != nullptr) munmap(at, mapped);  // what is left of the reservation
    return failed(err);
  }
  // Best effort, as for private memory: EINVAL without THP in the kernel.
  if (pages == Pages::kHuge) madvise(p, mapped, MADV_HUGEPAGE);
  if (pages == Pages::kSmall) madvise(p, mapped, MADV_NOHUGEPAGE);
  return HostMemory(static_cast<std::byte*>(p), bytes, mapped);
}

namespace {

// The selected value of a transparent_hugepage control ("a [b] c" -> "b").
std::string SelectedMode(const std::string& text) {
  const size_t open = text.find('[');
  const size_t close = text.find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "";
  return text.substr(open + 1, close - open - 1);
}

constexpr char kThpDir[] = "/kernel/mm/transparent_hugepage";

// The first line of `path`; empty where it cannot be read.
std::string FirstLine(const std::string& path) {
  std::string line;
  std::getline(std::ifstream(path), line);
  return line;
}

// hpage_pmd_size under `sys_dir`; 0 where it cannot be read or is no
// power of two above the page size.
uint64_t PmdBytesIn(const std::string& sys_dir) {
  uint64_t pmd_bytes = 0;
  const bool known =
      absl::SimpleAtoi(FirstLine(absl::StrCat(sys_dir, kThpDir, "/hpage_pmd_size")), &pmd_bytes) &&
      pmd_bytes > PageSize() && absl::has_single_bit(pmd_bytes);
  return known ? pmd_bytes : 0;
}

// The PMD size, 2 MiB where it cannot be read.
uint64_t PmdBytesOrDefaultIn(const std::string& sys_dir) {
  const uint64_t pmd_bytes = PmdBytesIn(sys_dir);
  return pmd_bytes != 0 ? pmd_bytes : uint64_t{2} << 20;
}

}  // namespace

uint64_t SharedHugePageBytesFrom(const std::string& shmem_enabled, uint64_t pmd_bytes) {
  const std::string mode = SelectedMode(shmem_enabled);
  const bool huge =
      mode == "advise" || mode == "within_size" || mode == "always" || mode == "force";
  if (!huge || pmd_bytes <= PageSize() || !absl::has_single_bit(pmd_bytes)) return 0;
  return pmd_bytes;
}

bool SharedFileWritesMayGetLargePagesFrom(const std::string& global,
                                          const std::vector<std::string>& per_size) {
  auto unasked = [](const std::string& mode) {
    return mode == "always" || mode == "within_size" || mode == "force";
  };
  const std::string global_mode = SelectedMode(global);
  if (per_size.empty()) return unasked(global_mode);
  for (const std::string& text : per_size) {
    const std::string mode = SelectedMode(text);
    if (unasked(mode == "inherit" ? global_mode : mode)) return true;
  }
  return false;
}

bool SharedFileWritesMayGetLargePages() {
  static const bool may = [] {
    const std::string root = "/sys/kernel/mm/transparent_hugepage";
    std::string global;
    std::getline(std::ifstream(root + "/shmem_enabled"), global);
    std::vector<std::string> per_size;
    std::error_code error;
    for (const auto& entry : std::filesystem::directory_iterator(root, error)) {
      if (entry.path().filename().string().rfind("hugepages-", 0) != 0) continue;
      std::string text;
      if (std::getline(std::ifstream(entry.path() / "shmem_enabled"), text)) {
        per_size.push_back(text);
      }
    }
    return SharedFileWritesMayGetLargePagesFrom(global, per_size);
  }();
  return may;
}

uint64_t HugePageAlignment() {
  static const uint64_t bytes = PmdBytesOrDefaultIn("/sys");
  return bytes;
}

std::string TransparentHugePageMode(const std::string& sys_dir, const std::string& control) {
  return SelectedMode(FirstLine(absl::StrCat(sys_dir, kThpDir, "/", control)));
}

uint64_t SharedHugePageBytesIn(const std::string& sys_dir) {
  // Empty where the kernel has no transparent huge pages.
  return SharedHugePageBytesFrom(FirstLine(absl::StrCat(sys_dir, kThpDir, "/shmem_enabled")),
                                 PmdBytesOrDefaultIn(sys_dir));
}

uint64_t SharedHugePageBytes() {
  static const uint64_t bytes = SharedHugePageBytesIn("/sys");
  return bytes;
}

uint64_t PrivateHugePageBytesFrom(const std::string& enabled, uint64_t pmd_bytes) {
  const std::string mode = SelectedMode(enabled);
  const bool huge = mode == "always" || mode == "madvise";
  if (!huge || pmd_bytes <= PageSize() || !absl::has_single_bit(pmd_bytes)) return 0;
  return pmd_bytes;
}

uint64_t PrivateHugePageBytesIn(const std::string& sys_dir) {
  return PrivateHugePageBytesFrom(FirstLine(absl::StrCat(sys_dir, kThpDir, "/enabled")),
                                  PmdBytesOrDefaultIn(sys_dir));
}

std::vector<std::string> DamonMonitorsIn(const std::string& proc_dir,
                                         const std::string& kdamonds_dir) {
  // The admin interface's operations by thread id, where readable.
  absl::flat_hash_map<std::string, std::string> operations;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(kdamonds_dir, error)) {
    std::string pid, ops;
    if (std::getline(std::ifstream(entry.path() / "pid"), pid) &&
        std::getline(std::ifstream(entry.path() / "contexts" / "0" / "operations"), ops) &&
        !ops.empty()) {
      operations[pid] = ops;
    }
  }
  std::vector<std::string> running;
  for (const auto& entry : std::filesystem::directory_iterator(proc_dir, error)) {
    const std::string pid = entry.path().filename().string();
    uint64_t number;
    if (!absl::SimpleAtoi(pid, &number)) continue;
    std::string comm;
    if (!std::getline(std::ifstream(entry.path() / "comm"), comm)) continue;  // gone meanwhile
    if (comm.rfind("kdamond", 0) != 0) continue;
    // A kernel thread (PF_KTHREAD in /proc/<pid>/stat's flags, its ninth
    // field, the seventh after the name's closing parenthesis): any user
    // can run a process named kdamond, which changed the daemon's choice
    // of pages for every session and doctor's verdict.
    std::string stat;
    if (!std::getline(std::ifstream(entry.path() / "stat"), stat)) continue;
    const size_t name_end = stat.rfind(')');
    if (name_end == std::string::npos) continue;
    const std::vector<std::string> fields =
        absl::StrSplit(stat.substr(name_end + 1), ' ', absl::SkipEmpty());
    constexpr uint64_t kKernelThread = 0x00200000;  // PF_KTHREAD
    uint64_t flags = 0;
    if (fields.size() < 7 || !absl::SimpleAtoi(fields[6], &flags) || !(flags & kKernelThread)) {
      continue;
    }
    const auto ops = operations.find(pid);
    running.push_back(absl::StrCat(
        comm, " (pid ", pid, ops == operations.end() ? "" : absl::StrCat(", ", ops->second), ")"));
  }
  std::sort(running.begin(), running.end());
  return running;
}

std::vector<std::string> DamonMonitors() {
  return DamonMonitorsIn("/proc", "/sys/kernel/mm/damon/admin/kdamonds");
}

namespace {
std::atomic<int64_t> live_mappings{0};
}  // namespace

HostMemory::HostMemory(std::byte* data, uint64_t size, uint64_t mapped)
    : data_(data), size_(size), mapped_(mapped) {
  if (data_ != nullptr) live_mappings.fetch_add(1, std::memory_order_relaxed);
}

int64_t HostMemory::LiveMappings() { return live_mappings.load(std::memory_order_relaxed); }

HostMemory::HostMemory(HostMemory&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      mapped_(std::exchange(other.mapped_, 0)) {}

HostMemory& HostMemory::operator=(HostMemory&& other) noexcept {
  if (this != &other) {
    Reset();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    mapped_ = std::exchange(other.mapped_, 0);
  }
  return *this;
}

HostMemory::~HostMemory() { Reset(); }

void HostMemory::Reset() {
  if (data_ != nullptr) {
    munmap(data_, mapped_);
    live_mappings.fetch_sub(1, std::memory_order_relaxed);
  }
  data_ = nullptr;
  size_ = mapped_ = 0;
}

}  // namespace offload
