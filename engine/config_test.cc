#include "engine/config.h"

#include <cstdio>
#include <fstream>

#include "engine/options.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

class ConfigTest : public ::testing::Test {
 protected:
  ConfigTest() { BindTunables(&options_, &registry_); }
  DaemonOptions options_;
  ConfigRegistry registry_;
};

TEST_F(ConfigTest, EveryTunableHasADefaultAndDescription) {
  std::vector<TunableInfo> all = registry_.List();
  ASSERT_GE(all.size(), 7u);
  for (const TunableInfo& t : all) {
    EXPECT_FALSE(t.description.empty()) << t.name;
    EXPECT_FALSE(t.unit.empty()) << t.name;
    EXPECT_EQ(t.value, t.default_value) << t.name;
  }
  EXPECT_GT(options_.memory.host_budget_bytes, 0);
  EXPECT_FALSE(options_.server.data_dir.empty());
}

TEST_F(ConfigTest, SetWritesTheBoundField) {
  ASSERT_TRUE(registry_.Set("optimizer.threads", "3").ok());
  EXPECT_EQ(options_.optimizer.threads, 3);
  auto t = registry_.Set("memory.host_budget_bytes", "2GiB");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(options_.memory.host_budget_bytes, int64_t{2} << 30);
  EXPECT_EQ(t->value, "2GiB");
  EXPECT_EQ(t->default_value, registry_.Get("memory.host_budget_bytes")->default_value);
}

TEST_F(ConfigTest, RejectsBadValuesWithoutChangingAnything) {
  EXPECT_EQ(registry_.Set("optimizer.threads", "many").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Set("optimizer.threads", "5000").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Set("memory.host_budget_bytes", "12 parsecs").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.Set("no.such", "1").status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(options_.optimizer.threads, 0);
}

TEST_F(ConfigTest, StaticTunablesFreezeAndHooksCanRefuse) {
  int64_t seen = -1;
  registry_.SetHook<int64_t>("optimizer.threads", [&](const int64_t& v) -> absl::Status {
    if (v == 7) return absl::InvalidArgumentError("seven is unlucky");
    seen = v;
    return absl::OkStatus();
  });
  // Before Freeze (start-up), hooks do not run: the component reads the
  // options when it is built.
  ASSERT_TRUE(registry_.Set("optimizer.threads", "2").ok());
  EXPECT_EQ(seen, -1);
  registry_.Freeze();
  auto frozen = registry_.Set("server.socket", "/tmp/x.sock");
  EXPECT_EQ(frozen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(frozen.status().message().find("restart"), std::string::npos);
  ASSERT_TRUE(registry_.Set("optimizer.threads", "4").ok());
  EXPECT_EQ(seen, 4);
  EXPECT_EQ(registry_.Set("optimizer.threads", "7").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(options_.optimizer.threads, 4);
}

TEST_F(ConfigTest, YamlNestsByDottedName) {
  ASSERT_TRUE(registry_
                  .ApplyYaml("server:\n  tcp_port: 0\noptimizer:\n  threads: 2\n"
                             "memory: {host_budget_bytes: 512MiB}\n",
                             "test.yaml")
                  .ok());
  EXPECT_EQ(options_.server.tcp_port, 0);
  EXPECT_EQ(options_.optimizer.threads, 2);
  EXPECT_EQ(options_.memory.host_budget_bytes, int64_t{512} << 20);
}

TEST_F(ConfigTest, YamlErrorsNameTheFileAndKey) {
  absl::Status unknown = registry_.ApplyYaml("optimizer:\n  threadz: 2\n", "a.yaml");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.message().find("a.yaml"), std::string::npos);
  EXPECT_NE(unknown.message().find("optimizer.threadz"), std::string::npos);
  EXPECT_EQ(registry_.ApplyYaml("optimizer: [1, 2\n", "b.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.ApplyYaml("- 1\n- 2\n", "c.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.ApplyYaml("optimizer:\n  threads: [1]\n", "d.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(registry_.ApplyYamlFile("/nonexistent/offloadd.yaml").code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ConfigTest, YamlFileRoundTrip) {
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/offloadd.yaml";
  std::ofstream(path) << "# comment\noptimizer:\n  tile_elems: 4096\n";
  ASSERT_TRUE(registry_.ApplyYamlFile(path).ok());
  EXPECT_EQ(options_.optimizer.tile_elems, 4096);
}

TEST(ByteSize, ParsesAndFormats) {
  EXPECT_EQ(*ParseByteSize("4096"), 4096);
  EXPECT_EQ(*ParseByteSize("64K"), 65536);
  EXPECT_EQ(*ParseByteSize("1.5GiB"), int64_t{3} << 29);
  EXPECT_EQ(*ParseByteSize(" 2 mib "), int64_t{2} << 20);
  EXPECT_FALSE(ParseByteSize("").ok());
  EXPECT_FALSE(ParseByteSize("1.3B").ok());
  EXPECT_FALSE(ParseByteSize("-5").ok());
  EXPECT_EQ(FormatByteSize(int64_t{8} << 30), "8GiB");
  EXPECT_EQ(FormatByteSize(4097), "4097");
  EXPECT_EQ(FormatByteSize(0), "0");
}

}  // namespace
}  // namespace offload
