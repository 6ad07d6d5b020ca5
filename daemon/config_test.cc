#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "base/config_registry.h"
#include "daemon/config_file.h"
#include "daemon/daemon_options.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

class ConfigTest : public ::testing::Test {
 protected:
  ConfigTest() { BindTunables(&options_, &registry_); }
  // Gives every dynamic tunable but `except` a hook that accepts anything, as
  // the daemon gives each a hook into its component.
  void HookTheOtherDynamicTunables(const std::string& except) {
    for (const TunableInfo& t : registry_.List()) {
      if (!t.dynamic || t.name == except) continue;
      if (t.type == "int")
        registry_.SetHook<int64_t>(t.name, [](const int64_t&) { return absl::OkStatus(); });
      if (t.type == "bool")
        registry_.SetHook<bool>(t.name, [](const bool&) { return absl::OkStatus(); });
      if (t.type == "string") {
        registry_.SetHook<std::string>(t.name, [](const std::string&) { return absl::OkStatus(); });
      }
    }
  }

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
  HookTheOtherDynamicTunables("optimizer.threads");
  // Before Freeze (start-up), hooks do not run: the component reads the
  // options when it is built.
  ASSERT_TRUE(registry_.Set("optimizer.threads", "2").ok());
  EXPECT_EQ(seen, -1);
  ASSERT_TRUE(registry_.Freeze().ok());
  auto frozen = registry_.Set("server.socket", "/tmp/x.sock");
  EXPECT_EQ(frozen.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(frozen.status().message().find("restart"), std::string::npos);
  ASSERT_TRUE(registry_.Set("optimizer.threads", "4").ok());
  EXPECT_EQ(seen, 4);
  EXPECT_EQ(registry_.Set("optimizer.threads", "7").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(options_.optimizer.threads, 4);
}

TEST_F(ConfigTest, FreezeRefusesADynamicTunableNothingApplies) {
  HookTheOtherDynamicTunables("nvme.queue_depth");
  absl::Status frozen = registry_.Freeze();
  EXPECT_EQ(frozen.code(), absl::StatusCode::kInternal);
  EXPECT_NE(frozen.message().find("nvme.queue_depth"), std::string::npos) << frozen;
  // Still unfrozen: static tunables can be set.
  EXPECT_TRUE(registry_.Set("server.socket", "/tmp/x.sock").ok());
  registry_.SetHook<int64_t>("nvme.queue_depth", [](const int64_t&) { return absl::OkStatus(); });
  EXPECT_TRUE(registry_.Freeze().ok());
}

TEST_F(ConfigTest, FreezeRefusesAHookOnAStaticTunable) {
  HookTheOtherDynamicTunables("");
  registry_.SetHook<int64_t>("nvme.rings", [](const int64_t&) { return absl::OkStatus(); });
  absl::Status frozen = registry_.Freeze();
  EXPECT_EQ(frozen.code(), absl::StatusCode::kInternal);
  EXPECT_NE(frozen.message().find("nvme.rings"), std::string::npos) << frozen;
}

TEST_F(ConfigTest, RangesAreTheComponentsOwn) {
  // The registry refuses exactly what the component's range refuses.
  const TunableInfo depth = *registry_.Get("nvme.queue_depth");
  EXPECT_TRUE(registry_.Set("nvme.queue_depth", absl::StrCat(kQueueDepthRange.max)).ok());
  EXPECT_FALSE(registry_.Set("nvme.queue_depth", absl::StrCat(kQueueDepthRange.max + 1)).ok());
  EXPECT_FALSE(
      registry_.Set("optimizer.threads", absl::StrCat(kOptimizerThreadsRange.max + 1)).ok());
  EXPECT_TRUE(
      registry_.Set("optimizer.tile_elems", absl::StrCat(kOptimizerTileElemsRange.min)).ok());
  EXPECT_EQ(depth.default_value, "32");
}

// memory.host_home_pages: auto takes small pages exactly where DAMON runs;
// anything but auto, huge and small is refused, naming the setting.
TEST_F(ConfigTest, HostHomePagesResolveByDamonAndRefuseOtherValues) {
  EXPECT_EQ(options_.memory.host_home_pages, "auto");
  const std::vector<std::string> none, damon = {"kdamond 0 (paddr)"};
  auto quiet = ResolveHostHomePages("auto", none);
  auto monitored = ResolveHostHomePages("auto", damon);
  ASSERT_TRUE(quiet.ok() && monitored.ok());
  EXPECT_EQ(quiet->pages, Pages::kHuge) << quiet->why;
  EXPECT_EQ(monitored->pages, Pages::kSmall) << monitored->why;
  EXPECT_NE(monitored->why.find("kdamond 0 (paddr)"), std::string::npos) << monitored->why;
  for (const auto& monitors : {none, damon}) {
    auto huge = ResolveHostHomePages("huge", monitors);
    auto small = ResolveHostHomePages("small", monitors);
    ASSERT_TRUE(huge.ok() && small.ok());
    EXPECT_EQ(huge->pages, Pages::kHuge);
    EXPECT_EQ(small->pages, Pages::kSmall);
    auto bad = ResolveHostHomePages("Huge", monitors);
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(bad.status().message().find("memory.host_home_pages"), std::string::npos)
        << bad.status();
  }
}

TEST_F(ConfigTest, YamlNestsByDottedName) {
  ASSERT_TRUE(ApplyYaml(registry_,
                        "server:\n  tcp_port: 0\noptimizer:\n  threads: 2\n"
                        "memory: {host_budget_bytes: 512MiB}\n",
                        "test.yaml")
                  .ok());
  EXPECT_EQ(options_.server.tcp_port, 0);
  EXPECT_EQ(options_.optimizer.threads, 2);
  EXPECT_EQ(options_.memory.host_budget_bytes, int64_t{512} << 20);
}

TEST_F(ConfigTest, YamlErrorsNameTheFileAndKey) {
  absl::Status unknown = ApplyYaml(registry_, "optimizer:\n  threadz: 2\n", "a.yaml");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound);
  EXPECT_NE(unknown.message().find("a.yaml"), std::string::npos);
  EXPECT_NE(unknown.message().find("optimizer.threadz"), std::string::npos);
  EXPECT_EQ(ApplyYaml(registry_, "optimizer: [1, 2\n", "b.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyYaml(registry_, "- 1\n- 2\n", "c.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyYaml(registry_, "optimizer:\n  threads: [1]\n", "d.yaml").code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApplyYamlFile(registry_, "/nonexistent/offloadd.yaml").code(),
            absl::StatusCode::kNotFound);
  // A setting given twice (a key repeated, or nested and dotted) is named,
  // not the last one silently taken; nothing is applied.
  for (const char* twice : {"optimizer: {threads: 2}\noptimizer: {threads: 3}\n",
                            "optimizer: {threads: 2}\noptimizer.threads: 3\n"}) {
    absl::Status s = ApplyYaml(registry_, twice, "e.yaml");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << twice;
    EXPECT_NE(s.message().find("'optimizer.threads' is set twice"), std::string::npos) << s;
  }
  EXPECT_NE(options_.optimizer.threads, 3);
  // gpu.prefetch_bytes' default, -1 (each trainer's own), is taken back.
  ASSERT_TRUE(ApplyYaml(registry_, "gpu: {prefetch_bytes: 64MiB}\n", "f.yaml").ok());
  ASSERT_TRUE(ApplyYaml(registry_, "gpu: {prefetch_bytes: -1}\n", "f.yaml").ok());
}

TEST_F(ConfigTest, YamlFileRoundTrip) {
  std::string path = std::string(getenv("TEST_TMPDIR")) + "/offloadd.yaml";
  std::ofstream(path) << "# comment\noptimizer:\n  tile_elems: 4096\n";
  ASSERT_TRUE(ApplyYamlFile(registry_, path).ok());
  EXPECT_EQ(options_.optimizer.tile_elems, 4096);
}

// A reload takes a setting the file no longer names back to its default; a
// reload refused (an unknown name) changes nothing, not even what the file
// is known to have set, so the next one still resets it.
TEST_F(ConfigTest, AReloadResetsWhatTheFileNoLongerSets) {
  const std::string path = std::string(getenv("TEST_TMPDIR")) + "/reload.yaml";
  const std::string fallback = registry_.Get("optimizer.tile_elems")->default_value;
  std::ofstream(path) << "optimizer:\n  tile_elems: 4096\n";
  std::vector<std::string> from_file;
  ASSERT_TRUE(ApplyYamlFile(registry_, path, &from_file).ok());
  EXPECT_EQ(from_file, std::vector<std::string>{"optimizer.tile_elems"});
  std::ofstream(path, std::ios::trunc) << "optimizer:\n  tile_elemz: 1\n";
  EXPECT_EQ(ReloadYamlFile(registry_, path, {}, &from_file).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(options_.optimizer.tile_elems, 4096);
  std::ofstream(path, std::ios::trunc) << "# nothing set\n";
  auto r = ReloadYamlFile(registry_, path, {}, &from_file);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_EQ(registry_.Get("optimizer.tile_elems")->value, fallback);
  EXPECT_TRUE(from_file.empty());
}

}  // namespace
}  // namespace offload
