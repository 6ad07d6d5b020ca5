// Test helpers over /proc/self/smaps: what the kernel says about the mapping
// that holds an address (its pages, and the madvise flags it was given).
#ifndef OFFLOADD_BASE_SMAPS_TESTING_H_
#define OFFLOADD_BASE_SMAPS_TESTING_H_

#include <cstdint>
#include <string>

namespace offload {

// The lines /proc/self/smaps gives for the mapping holding `p`, from its
// header line on; "" where none holds it (or smaps is unreadable).
std::string SmapsAt(const void* p);

// That mapping's madvise flags, space-separated with a space on each side
// (" rd wr mr mw me ac hg "), so that a flag is found as " hg "; "" where
// none holds `p`.
std::string VmFlagsAt(const void* p);

// Whether the kernel has transparent huge pages, as smaps says for the
// mapping holding `p` (a THPeligible line; absent without them, where
// madvise's huge-page requests are refused and leave no flag).
bool TransparentHugePagesAt(const void* p);

// A field of smaps text (SmapsAt's, or a /proc/<pid>/smaps_rollup), in kB
// (-1 if absent).
int64_t SmapsKb(const std::string& smaps, const std::string& field);

}  // namespace offload

#endif  // OFFLOADD_BASE_SMAPS_TESTING_H_
