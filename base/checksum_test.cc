#include "base/checksum.h"

#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(ChecksumTest, EmptyInputIsXxh3sSeedZeroValue) {
  // XXH3_64bits("") from the XXH3 specification's test vectors.
  EXPECT_EQ(Checksum64(nullptr, 0), 0x2D06800538D394C2ull);
  EXPECT_EQ(Checksum64Baseline(nullptr, 0), 0x2D06800538D394C2ull);
}

// Every length up to 4 KiB (XXH3 has separate paths for 0-3, 4-8, 9-16,
// 17-128, 129-240 bytes and for longer inputs, whose stripes and blocks the
// vector units take differently) at offsets cycling through a 64-byte line,
// then long inputs and their tails at every offset in the line: the
// dispatched hash equals the baseline build's. (On a CPU without AVX2 both
// are SSE2 and this compares a build with itself.)
TEST(ChecksumTest, DispatchedEqualsBaselineAtEveryLengthAndAlignment) {
  std::mt19937_64 rng(20261127);
  std::vector<unsigned char> buf((1 << 20) + 4096 + 64);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  for (size_t len = 0; len <= 4096; ++len) {
    const unsigned char* p = buf.data() + (len % 64);
    ASSERT_EQ(Checksum64(p, len), Checksum64Baseline(p, len)) << "length " << len;
  }
  for (size_t len :
       {size_t{1} << 16, (size_t{1} << 20) - 1, size_t{1} << 20, (size_t{1} << 20) + 4095}) {
    for (size_t align = 0; align < 64; ++align) {
      const unsigned char* p = buf.data() + align;
      ASSERT_EQ(Checksum64(p, len), Checksum64Baseline(p, len))
          << "length " << len << " at offset " << align;
    }
  }
}

// What the NVMe tier and every checkpoint on disk have stored for these
// bytes (computed once with libxxhash 0.8.1): a libxxhash whose XXH3 gave
// another value would leave existing checkpoints unreadable.
TEST(ChecksumTest, LongInputKeepsTheValueOnDisk) {
  std::vector<unsigned char> buf(4096 + 7);
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 131 + 17);
  EXPECT_EQ(Checksum64(buf.data(), buf.size()), 0x6CB4D33A8E0D69B3ull);
  EXPECT_EQ(Checksum64Baseline(buf.data(), buf.size()), 0x6CB4D33A8E0D69B3ull);
}

TEST(ChecksumTest, OneFlippedBitChangesTheChecksum) {
  std::vector<unsigned char> buf(1 << 20, 0x5a);
  const uint64_t before = Checksum64(buf.data(), buf.size());
  for (size_t at : {size_t{0}, size_t{4097}, buf.size() - 1}) {
    buf[at] ^= 1;
    EXPECT_NE(Checksum64(buf.data(), buf.size()), before) << "bit flipped at " << at;
    buf[at] ^= 1;
  }
  EXPECT_EQ(Checksum64(buf.data(), buf.size()), before);
}

}  // namespace
}  // namespace offload
