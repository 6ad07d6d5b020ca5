#include "benches/bench_util.h"

#include <sys/statvfs.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/config_registry.h"

namespace offload::bench {

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::map<std::string, uint64_t> ProcStatus() {
  std::map<std::string, uint64_t> out;
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    const size_t colon = line.find(':');
    if (colon == std::string::npos || line.find(" kB") == std::string::npos) continue;
    uint64_t kb;
    std::string value(absl::StripAsciiWhitespace(line.substr(colon + 1)));
    value = value.substr(0, value.find(' '));
    if (absl::SimpleAtoi(value, &kb)) out[line.substr(0, colon)] = kb * 1024;
  }
  return out;
}
std::string FirstLineWith(const char* path, const char* key) {
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return line;
  }
  return "?";
}
void PrintMachine(const std::string& dir) {
  std::string cpu = FirstLineWith("/proc/cpuinfo", "model name");
  if (cpu.find(':') != std::string::npos) cpu = cpu.substr(cpu.find(':') + 2);
  std::ifstream load("/proc/loadavg");
  std::string l1, l5, l15;
  load >> l1 >> l5 >> l15;
  std::string avail = FirstLineWith("/proc/meminfo", "MemAvailable");
  struct statvfs vfs {};
  statvfs(dir.c_str(), &vfs);
  std::printf("machine: %s, %ld CPUs online, load average %s %s %s, %s, %.1f GB free in %s\n",
              cpu.c_str(), sysconf(_SC_NPROCESSORS_ONLN), l1.c_str(), l5.c_str(), l15.c_str(),
              avail.c_str(), static_cast<double>(vfs.f_bavail) * vfs.f_frsize / 1e9, dir.c_str());
}
// fio's bandwidth (bytes/s) for one sequential run in one direction, or -1.
double FioBandwidth(const std::string& file, bool write, uint64_t bs, int64_t depth,
                    uint64_t size) {
  const std::string cmd = absl::StrCat(
      "fio --name=bench --filename=", file,
      " --ioengine=io_uring --direct=1 --rw=", write ? "write" : "read", " --bs=", bs,
      " --iodepth=", depth, " --size=", size,
      " --fixedbufs --registerfiles --thread --numjobs=1 --output-format=json 2>/dev/null");
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return -1;
  std::string out;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) out.append(buf, n);
  if (pclose(pipe) != 0) return -1;
  const size_t section = out.find(write ? "\"write\" : {" : "\"read\" : {");
  if (section == std::string::npos) return -1;
  size_t key = out.find("\"bw_bytes\" : ", section);
  if (key == std::string::npos) return -1;
  key += 13;
  double bw;
  if (!absl::SimpleAtod(out.substr(key, out.find_first_of(",\n", key) - key), &bw)) return -1;
  return bw;
}
bool ResetPeakRss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  out.flush();
  return static_cast<bool>(out);
}
const char* FlagValue(const char* arg, const char* name) {
  const std::string prefix = absl::StrCat("--", name, "=");
  return std::string_view(arg).rfind(prefix, 0) == 0 ? arg + prefix.size() : nullptr;
}

int64_t ByteSizeOrExit(const char* text) {
  absl::StatusOr<int64_t> b = ParseByteSize(text);
  if (!b.ok() || *b <= 0) {
    std::fprintf(stderr, "bad byte size '%s'\n", text);
    std::exit(2);
  }
  return *b;
}

bool TunableFlag(ConfigRegistry& registry, const char* arg) {
  absl::string_view a = arg;
  if (!absl::ConsumePrefix(&a, "--")) return false;
  const size_t eq = a.find('=');
  if (eq == absl::string_view::npos) return false;
  const absl::string_view name = a.substr(0, eq);
  if (!registry.Get(name).ok()) return false;
  if (absl::StatusOr<TunableInfo> set = registry.Set(name, a.substr(eq + 1)); !set.ok()) {
    std::fprintf(stderr, "--%s: %s\n", std::string(name).c_str(), set.status().ToString().c_str());
    std::exit(2);
  }
  return true;
}

uint64_t CountOrExit(const char* text) {
  double mult = 1;
  std::string t(text);
  if (!t.empty()) {
    switch (t.back()) {
      case 'K':
      case 'k':
        mult = 1e3;
        t.pop_back();
        break;
      case 'M':
      case 'm':
        mult = 1e6;
        t.pop_back();
        break;
      case 'G':
      case 'g':
        mult = 1e9;
        t.pop_back();
        break;
      default:
        break;
    }
  }
  double v;
  if (!absl::SimpleAtod(t, &v) || v <= 0) {
    std::fprintf(stderr, "not a count: '%s'\n", text);
    std::exit(2);
  }
  return static_cast<uint64_t>(std::llround(v * mult));
}

}  // namespace offload::bench
