// A main for fuzz targets built without libFuzzer (the default gcc build):
// runs every file named on the command line (or in a directory named
// there) through LLVMFuzzerTestOneInput once. Tests use it to run the seed
// corpus, so a target always builds and its seeds always pass.
#include <dirent.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv);
extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

int RunFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot read %s\n", path.c_str());
    return 1;
  }
  const std::vector<char> bytes((std::istreambuf_iterator<char>(f)),
                                std::istreambuf_iterator<char>());
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  LLVMFuzzerInitialize(&argc, &argv);
  int failed = 0, ran = 0;
  for (int i = 1; i < argc; ++i) {
    struct stat st;
    if (stat(argv[i], &st) == 0 && S_ISDIR(st.st_mode)) {
      DIR* dir = opendir(argv[i]);
      while (dirent* e = dir != nullptr ? readdir(dir) : nullptr) {
        if (e->d_name[0] == '.') continue;
        failed += RunFile(std::string(argv[i]) + "/" + e->d_name);
        ++ran;
      }
      if (dir != nullptr) closedir(dir);
    } else {
      failed += RunFile(argv[i]);
      ++ran;
    }
  }
  std::printf("ran %d inputs, %d unreadable\n", ran, failed);
  return failed == 0 && ran > 0 ? 0 : 1;
}
