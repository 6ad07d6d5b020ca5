// HostMemory: the one owner of host memory in offloadd. A page-aligned
// mapping, anonymous (private, zeroed) or of a file such as a session's memfd
// (shared), optionally on transparent huge pages; unmapped once, by its
// destructor. Move-only. Every buffer the daemon and the client hold (arenas,
// their client-side mappings, master weights and moments, I/O staging) is one
// of these, so there is one munmap in the code base.
//
// Huge pages: devices cap scatter-gather segments per request (254 on this
// project's VMs), so a direct read or write from 4 KiB pages carries at most
// about 1 MiB per request; 2 MiB pages lift that (benches/RESULTS.md). A
// mapping asks for them or declines them with Pages; best effort, THP may
// be off. Shared mappings of a memfd (shmem) get them only where
// /sys/kernel/mm/transparent_hugepage/shmem_enabled allows (advise,
// within_size, always; SharedHugePageBytes says). On this project's VMs direct reads into fresh
// 4 KiB shmem pages made a ZeRO-3 pass over parameters on NVMe 1.4-6.3x
// slower than into 2 MiB ones (benches/RESULTS.md, trace_replay).
//
// Thread-safety: a HostMemory is a value; the bytes are the caller's to
// synchronise.
#ifndef OFFLOADD_BASE_HOST_MEMORY_H_
#define OFFLOADD_BASE_HOST_MEMORY_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace offload {

// What a mapping asks of the kernel for the pages it faults in: whatever the
// system's default is, huge pages (MADV_HUGEPAGE), or small pages only
// (MADV_NOHUGEPAGE: where the caller accounts for shared memory in 4 KiB
// pages, a huge page would hold more than it counted; where the node's
// memory monitoring makes huge pages costly, see DamonMonitors). Best
// effort: a kernel without transparent huge pages ignores it.
enum class Pages { kSystemDefault, kHuge, kSmall };

class HostMemory {
 public:
  // `bytes` of zeroed private memory, rounded up to whole pages.
  static absl::StatusOr<HostMemory> Allocate(uint64_t bytes, Pages pages = Pages::kHuge);

  // Maps `bytes` of `fd` (borrowed) from `offset` (a multiple of the page
  // size) shared, read-write. MAP_NORESERVE: pages exist as the file holds
  // them and they are touched, so a mapping may reach past the file's end.
  // With Pages::kHuge the mapping's address is congruent to `offset`
  // modulo HugePageAlignment().
  static absl::StatusOr<HostMemory> MapShared(int fd, uint64_t offset, uint64_t bytes,
                                              Pages pages = Pages::kSystemDefault);

  HostMemory() = default;
  HostMemory(HostMemory&& other) noexcept;
  HostMemory& operator=(HostMemory&& other) noexcept;
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;
  ~HostMemory();

  std::byte* data() const { return data_; }
  // The size asked for (the mapping itself covers whole pages).
  uint64_t size() const { return size_; }
  bool empty() const { return data_ == nullptr; }
  template <typename T>
  T* as() const {
    return reinterpret_cast<T*>(data_);
  }

  // Mappings this process holds through HostMemory now (each its own
  // mmap; the kernel counts them against vm.max_map_count, possibly merged
  // or split). Lock-free.
  static int64_t LiveMappings();

 private:
  HostMemory(std::byte* data, uint64_t size, uint64_t mapped);
  void Reset();

  std::byte* data_ = nullptr;
  uint64_t size_ = 0;
  uint64_t mapped_ = 0;
};

// Gives the C heap's free memory back to the kernel (glibc's malloc_trim:
// every arena's free pages, not only the top of the main one); false where
// the C library has no such call. What a large session's teardown frees
// (names, maps, protobufs) stays in the process's resident memory
// otherwise, in the arenas of the threads that allocated it. It locks each
// arena in turn: callers that free much ask for it (RequestHeapTrim), and
// one thread that may wait runs it (TrimHeapIfRequested, the arena
// channel's sweep, once a second).
bool TrimHeap();
void RequestHeapTrim();
// TrimHeap if one was requested since the last; true if it ran.
bool TrimHeapIfRequested();
// TrimHeap if the C heap holds at least `free_bytes` free (glibc's
// mallinfo2: free chunks, those already given back included, so a heap
// that stays fragmented is trimmed at every look); true if it ran. For what
// calls nobody asks a trim for leave behind (a burst of gRPC streams: their
// buffers, freed, kept by the arenas of the threads that served them).
// Looking walks every arena's free lists and a trim madvises each free run
// of pages, every arena locked in turn: callers look every several seconds.
// Measured in offloadd after 10,000 reset streams (benches/stream_burst):
// 15-24 ms for a trim giving back about 140 MB, 0.35-0.65 ms for a look and
// trim of the same heap once given back.
bool TrimHeapIfHoarding(uint64_t free_bytes);

// Page size of this machine (sysconf), and `bytes` rounded up to it.
uint64_t PageSize();
uint64_t RoundUpToPage(uint64_t bytes);

// `x` rounded up to a multiple of `align` (> 0).
inline uint64_t RoundUp(uint64_t x, uint64_t align) { return (x + align - 1) / align * align; }

// The huge page size a shared mapping of a memfd gets when it asks for
// huge pages (Pages::kHuge): the PMD size where
// /sys/kernel/mm/transparent_hugepage/shmem_enabled is advise, within_size,
// always or force; 0 where it is never or deny, or the files are missing.
// Read once: the setting is the node administrator's, and a change takes
// effect for offloadd at its next start.
uint64_t SharedHugePageBytes();

// The huge page size (/sys/kernel/mm/transparent_hugepage/hpage_pmd_size;
// 2 MiB where it cannot be read): a mapping asking for huge pages starts at
// an address congruent to its file offset modulo this, whether or not the
// kernel then gives it huge pages.
uint64_t HugePageAlignment();

// Parses shmem_enabled's text (the selected value in brackets) and the PMD
// size for SharedHugePageBytes; exposed for tests.
uint64_t SharedHugePageBytesFrom(const std::string& shmem_enabled, uint64_t pmd_bytes);

// SharedHugePageBytes on the node whose /sys is at `sys_dir` (a made-up
// tree in tests), read at each call.
uint64_t SharedHugePageBytesIn(const std::string& sys_dir);

// The huge page size private memory asking for huge pages gets (the host
// pool's and the I/O staging's HostMemory::Allocate with Pages::kHuge): the
// PMD size where /sys/kernel/mm/transparent_hugepage/enabled is always or
// madvise; 0 where it is never, or the files are missing. `enabled` is that
// file's text. Read at each call, by `offloadctl doctor`.
uint64_t PrivateHugePageBytesFrom(const std::string& enabled, uint64_t pmd_bytes);
uint64_t PrivateHugePageBytesIn(const std::string& sys_dir);

// The selected value of the transparent huge page control `control`
// (enabled, shmem_enabled, defrag) under `sys_dir` (/sys): "madvise" for
// "always [madvise] never"; empty where the kernel has no such file.
std::string TransparentHugePageMode(const std::string& sys_dir, const std::string& control);

// Whether pages a shared file (a memfd) gets when written through the file
// (pwrite, no mapping to ask or decline) may be larger than the system's:
// where shmem_enabled, or a per-size control under
// /sys/kernel/mm/transparent_hugepage/hugepages-*, is always, within_size or
// force (per size: `inherit` takes the global value). advise, never and
// deny give such writes small pages. Read once, as SharedHugePageBytes.
bool SharedFileWritesMayGetLargePages();

// The rule of SharedFileWritesMayGetLargePages over the controls' texts:
// the global one, and each size's (none on kernels without them, where the
// global one is the huge page size's); exposed for tests.
bool SharedFileWritesMayGetLargePagesFrom(const std::string& global,
                                          const std::vector<std::string>& per_size);

// The DAMON monitors running on this node, one "kdamond.<n> (pid <pid>[,
// <operations>])" for each kernel thread named kdamond.* in /proc (whoever
// started it: the sysfs admin interface, DAMON_RECLAIM, DAMON_LRU_SORT),
// sorted. <operations> (paddr, vaddr, ...) where the sysfs admin interface
// lists that thread and lets this process read it (root only on most
// kernels; the thread names are readable by all). Empty where none runs.
// Read at each call; offloadd asks once, at start.
//
// Why offloadd asks: every sampling interval a monitor clears the accessed
// bit of a page in each of its regions and later looks whether it was set
// again. On this project's VMs (a paravirtualised guest, kdamond sampling
// physical memory every 500 ms) the optimizer's passes over state on 2 MiB
// pages stalled 2-7x around each round once the monitor had split its
// regions; on 4 KiB pages far less (benches/RESULTS.md, step_overlap). The
// likely cause, not verified from inside the guest: where the hypervisor
// shadows the guest's page tables, the bit cleared on a 2 MiB page costs
// the next pass a hypervisor fault per 4 KiB of it.
std::vector<std::string> DamonMonitors();

// DamonMonitors over `proc_dir` (/proc) and `kdamonds_dir`
// (/sys/kernel/mm/damon/admin/kdamonds); exposed for tests.
std::vector<std::string> DamonMonitorsIn(const std::string& proc_dir,
                                         const std::string& kdamonds_dir);

// Frees the pages behind `bytes` (rounded up to pages) of a shared mapping
// from `data` (page-aligned): the file's pages themselves go (MADV_REMOVE,
// a hole punched in the memfd), in every process that maps them; the range
// then reads as zeros, and touching it allocates fresh pages. The errno's
// code if the kernel refuses (INVALID_ARGUMENT for a private mapping).
absl::Status DiscardSharedPages(std::byte* data, uint64_t bytes);

// Makes the pages of [data, data + bytes) resident and writable now
// (MADV_POPULATE_WRITE, Linux 5.14), their contents unchanged: the faults a
// first write would take, in one call. False where the kernel cannot (an
// older one): the pages then come at first touch, as before.
bool PopulateForWrite(std::byte* data, uint64_t bytes);

}  // namespace offload

#endif  // OFFLOADD_BASE_HOST_MEMORY_H_
