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

TEST(LossScaler, RefusesOptionsItCannotUse) {
  LossScalingOptions o;
  o.backoff_factor = 1.5;
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.min_scale = 1e9;  // above the initial scale
  EXPECT_EQ(ValidateLossScaling(o).code(), absl::StatusCode::kInvalidArgument);
  o = {};
  o.growth_interval = 0;
  EXPECT_NE(ValidateLossScaling(o).message().find("growth_interval"), absl::string_view::npos);
}

}  // namespace
}  // namespace offload
