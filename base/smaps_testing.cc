#include "base/smaps_testing.h"

#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"

namespace offload {

std::string SmapsAt(const void* p) {
  const auto at = reinterpret_cast<uintptr_t>(p);
  std::ifstream smaps("/proc/self/smaps");
  std::string out;
  bool in = false;
  for (std::string line; std::getline(smaps, line);) {
    uintptr_t begin = 0, end = 0;
    char dash = 0;
    std::istringstream header(line);
    // A header line starts "begin-end perms ..."; field lines "Name: value".
    if (line.find(':') > line.find(' ') && header >> std::hex >> begin >> dash >> end &&
        dash == '-') {
      if (in) break;  // the next mapping
      in = begin <= at && at < end;
    }
    if (in) out += line + "\n";
  }
  return out;
}

std::string VmFlagsAt(const void* p) {
  for (absl::string_view line : absl::StrSplit(SmapsAt(p), '\n')) {
    if (absl::ConsumePrefix(&line, "VmFlags:")) return std::string(line) + " ";
  }
  return "";
}

bool TransparentHugePagesAt(const void* p) {
  return SmapsAt(p).find("THPeligible") != std::string::npos;
}

int64_t SmapsKb(const std::string& smaps, const std::string& field) {
  for (absl::string_view line : absl::StrSplit(smaps, '\n')) {
    if (!absl::ConsumePrefix(&line, field + ":")) continue;
    line = absl::StripAsciiWhitespace(line);
    absl::ConsumeSuffix(&line, " kB");
    int64_t kb = -1;
    if (absl::SimpleAtoi(line, &kb)) return kb;
  }
  return -1;
}

}  // namespace offload
