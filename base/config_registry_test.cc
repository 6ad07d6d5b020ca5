#include "base/config_registry.h"

#include <string>

#include "gtest/gtest.h"

namespace offload {
namespace {

TEST(IntRange, ChecksInclusiveBoundsAndNamesTheSetting) {
  constexpr IntRange r{1, 256};
  EXPECT_TRUE(r.Check("depth", 1).ok());
  EXPECT_TRUE(r.Check("depth", 256).ok());
  absl::Status s = r.Check("depth", 257);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(s.message(), "depth must be in [1, 256], got 257");
  EXPECT_FALSE(r.Contains(0));
}

TEST(ConfigRegistry, DynamicNeedsAHookAndHooksRunOnlyOnceFrozen) {
  int64_t depth = 8;
  bool flag = false;
  std::string name = "x";
  ConfigRegistry r;
  r.Bind("a.depth", &depth, {"requests", "depth", true, IntRange{1, 64}});
  r.Bind("a.flag", &flag, {"bool", "flag", false});
  r.Bind("a.name", &name, {"name", "name", true});
  EXPECT_EQ(r.Set("a.depth", "65").status().code(), absl::StatusCode::kInvalidArgument);
  absl::Status frozen = r.Freeze();
  EXPECT_EQ(frozen.code(), absl::StatusCode::kInternal);
  EXPECT_NE(frozen.message().find("a.depth, a.name"), std::string::npos) << frozen;
  int64_t applied = 0;
  r.SetHook<int64_t>("a.depth", [&](const int64_t& v) {
    applied = v;
    return absl::OkStatus();
  });
  r.SetHook<std::string>("a.name", [](const std::string& v) {
    return v.empty() ? absl::InvalidArgumentError("empty") : absl::OkStatus();
  });
  ASSERT_TRUE(r.Set("a.depth", "4").ok());
  EXPECT_EQ(applied, 0);  // not frozen yet: the component reads its options
  ASSERT_TRUE(r.Freeze().ok());
  ASSERT_TRUE(r.Set("a.depth", "5").ok());
  EXPECT_EQ(applied, 5);
  EXPECT_EQ(depth, 5);
  EXPECT_EQ(r.Set("a.name", "").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(name, "x");
  EXPECT_EQ(r.Set("a.flag", "true").status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(ConfigRegistry, AStringOfChoicesTakesOnlyThem) {
  std::string kernel = "auto";
  ConfigRegistry r;
  r.Bind("a.kernel", &kernel, {"isa", "kernel", false, {}, {"auto", "avx2"}});
  ASSERT_TRUE(r.Set("a.kernel", "avx2").ok());
  absl::StatusOr<TunableInfo> bad = r.Set("a.kernel", "avx9");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "tunable a.kernel is one of auto, avx2; got 'avx9'");
  EXPECT_EQ(kernel, "avx2");
  EXPECT_EQ(r.Normalize("a.kernel", "avx9").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ByteSize, ParsesAndFormats) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_EQ(*ParseByteSize("64K"), 65536);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize(" 2 mib "), int64_t{2} << 20);
  EXPECT_FALSE(ParseByteSize("").ok());
  EXPECT_FALSE(ParseByteSize("1.3B").ok());
  EXPECT_FALSE(ParseByteSize("-5").ok());
  // Whole numbers exactly, past a double's 2^53; overflow refused.
  EXPECT_EQ(*ParseByteSize("9007199254740993"), int64_t{9007199254740993});
  EXPECT_EQ(*ParseByteSize("8388607TiB"), int64_t{8388607} << 40);
  EXPECT_FALSE(ParseByteSize("8388608TiB").ok());
  EXPECT_FALSE(ParseByteSize("99999999999999999999").ok());
  EXPECT_EQ(FormatByteSize(int64_t{8} << 30), "8GiB");
  EXPECT_EQ(FormatByteSize(4097), "4097");
  EXPECT_EQ(FormatByteSize(0), "0");
}

// A byte-size setting whose range holds -1 (its "none set", the default
// gpu.prefetch_bytes has) takes it back; the others refuse a sign.
TEST(ByteSize, ASettingWhoseRangeIsNegativeTakesItsNegativeValues) {
  int64_t ahead = -1, pool = 4096;
  ConfigRegistry r;
  r.Bind("gpu.ahead", &ahead, {"bytes", "ahead", false, IntRange{-1, int64_t{1} << 44}});
  r.Bind("pool", &pool, {"bytes", "pool", false, IntRange{0, int64_t{1} << 44}});
  ASSERT_TRUE(r.Set("gpu.ahead", "64MiB").ok());
  EXPECT_EQ(ahead, int64_t{64} << 20);
  ASSERT_TRUE(r.Set("gpu.ahead", " -1 ").ok());
  EXPECT_EQ(ahead, -1);
  EXPECT_EQ(r.Set("gpu.ahead", "-2").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Set("gpu.ahead", "-1MiB").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(r.Set("pool", "-1").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(pool, 4096);
}

}  // namespace
}  // namespace offload
