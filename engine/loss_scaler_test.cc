#include "engine/loss_scaler.h"

#include <vector>

#include "gtest/gtest.h"

namespace offload {
namespace {

// The scales DeepSpeed's DynamicLossScaler(init_scale=1024, scale_window=3,
// delayed_shift=2, min_scale=64, scale_factor=2, consecutive_hysteresis=False)
// has after each step of this overflow sequence, worked through by hand
// from its update_scale.
TEST(LossScaler, FollowsDeepSpeedsRuleWithHysteresis) {
  LossScalingOptions o;
  o.initial_scale = 1024;
  o.growth_interval = 3;
  o.growth_factor = 2;
  o.backoff_factor = 0.5;
  o.hysteresis = 2;
  o.min_scale = 64;
  ASSERT_TRUE(ValidateLossScaling(o).ok());
  LossScaler s(o);
  const std::vector<bool> overflow = {false, true,  true, true, false, false, false,
                                      true,  false, true, true, true,  true,  true};
  const std::vector<double> want = {1024, 1024, 512, 256, 256, 256, 512,
                                    512,  512,  256, 128, 64,  64,  64};
  for (size_t i = 0; i < overflow.size(); ++i) {
    s.Update(overflow[i]);
    EXPECT_EQ(s.scale(), want[i]) << "after step " << i;
  }
}

// The scale grows only while fp32 holds it: an infinite one would make
// every later step overflow, and its checkpoints unrestorable.
TEST(LossScaler, GrowsNoFurtherThanFp32Holds) {
  LossScalingOptions o;
  o.initial_scale = 1e38;
  o.min_scale = 1;
  o.growth_interval = 1;
  o.growth_factor = 10;
  ASSERT_TRUE(ValidateLossScaling(o).ok());
  LossScaler s(o);
  for (int i = 0; i < 3; ++i) s.Update(false);
  EXPECT_EQ(s.scale(), 1e38);
  s.Update(true);  // (hysteresis 2: the first overflow is absorbed)
  s.Update(true);
  EXPECT_EQ(s.scale(), 5e37);
  EXPECT_TRUE(s.Restore(s.state()).ok());
  o.initial_scale = 1e39;  // past fp32: the trainer's scaled loss would be infinite
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
}

TEST(LossScaler, RefusesOptionsItCannotUse) {
  LossScalingOptions o;
  o.backoff_factor = 1.5;
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.min_scale = 1e9;  // above the initial scale
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  // So small that its reciprocal, the gradients' scale, passes fp32: every
  // step would be refused for a grad_scale the trainer never sent.
  o.initial_scale = 1e-39;
  o.min_scale = 1e-39;
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.min_scale = 1e-300;
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.growth_interval = 0;
  EXPECT_NE(ValidateLossScaling(o).message().find("growth_interval"), absl::string_view::npos);
}

}  // namespace
}  // namespace offload
