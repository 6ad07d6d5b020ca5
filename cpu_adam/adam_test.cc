#include "cpu_adam/adam.h"

#include <cmath>
#include <random>
#include <vector>

#include "cpu_adam/kernel_select.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

// Double-precision reference of torch.optim.Adam/AdamW for one element.
struct RefState {
  double p, m, v;
};

void RefStep(RefState& s, double g, const AdamHyperparams& h, uint64_t t) {
  double lr = h.lr, b1 = h.beta1, b2 = h.beta2, wd = h.weight_decay;
  g *= h.grad_scale;
  if (h.decoupled_weight_decay) {
    s.p *= 1.0 - lr * wd;
  } else {
    g += wd * s.p;
  }
  s.m = b1 * s.m + (1.0 - b1) * g;
  s.v = b2 * s.v + (1.0 - b2) * g * g;
  double bc1 = h.bias_correction ? 1.0 - std::pow(b1, t) : 1.0;
  double bc2 = h.bias_correction ? 1.0 - std::pow(b2, t) : 1.0;
  s.p -= lr / bc1 * s.m / (std::sqrt(s.v) / std::sqrt(bc2) + h.eps);
}

class AdamScalarTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(AdamScalarTest, MatchesDoubleReferenceOver50Steps) {
  AdamHyperparams h;
  h.lr = 1e-2f;
  h.weight_decay = 0.1f;
  h.decoupled_weight_decay = std::get<0>(GetParam());
  h.bias_correction = std::get<1>(GetParam());
  h.grad_scale = 0.5f;
  const size_t n = 1003;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> p(n), m(n, 0.0f), v(n, 0.0f), g(n), w(n);
  std::vector<RefState> ref(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = dist(rng);
    ref[i] = {p[i], 0.0, 0.0};
  }
  for (uint64_t t = 1; t <= 50; ++t) {
    for (size_t i = 0; i < n; ++i) g[i] = dist(rng);
    AdamSpan s{p.data(), m.data(), v.data(), g.data(), DType::kFp32, w.data(), DType::kFp32, n};
    AdamScalar(ComputeStepConstants(h, t), s);
    for (size_t i = 0; i < n; ++i) RefStep(ref[i], g[i], h, t);
  }
  for (size_t i = 0; i < n; ++i) {
    EXPECT_NEAR(p[i], ref[i].p, 1e-5 * std::fabs(ref[i].p) + 1e-6) << i;
    EXPECT_EQ(w[i], p[i]);
  }
}

INSTANTIATE_TEST_SUITE_P(AllModes, AdamScalarTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

// Denormal, tiny and huge magnitudes (within what fp32 squares without
// overflow), odd size, unaligned start, every kernel, 30 steps.
TEST(AdamKernels, MatchDoubleReferenceAcrossMagnitudes) {
  const size_t n = 1021, off = 3;
  std::mt19937 rng(11);
  std::uniform_real_distribution<double> exponent(-20.0, 15.0);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> p0(n + off), scale(n);
  for (size_t i = 0; i < n; ++i) {
    scale[i] = static_cast<float>(std::pow(10.0, exponent(rng)));
    p0[off + i] = i % 5 == 0 ? 1e-40f : static_cast<float>(normal(rng));  // denormals too
  }
  std::vector<std::vector<float>> grads(30, std::vector<float>(n + off));
  for (auto& g : grads) {
    for (size_t i = 0; i < n; ++i) g[off + i] = static_cast<float>(normal(rng)) * scale[i];
  }
  for (bool adamw : {true, false}) {
    AdamHyperparams h;
    h.lr = 1e-3;
    h.weight_decay = 0.01;
    h.decoupled_weight_decay = adamw;
    std::vector<RefState> ref(n);
    for (size_t i = 0; i < n; ++i) ref[i] = {p0[off + i], 0.0, 0.0};
    for (uint64_t t = 1; t <= 30; ++t) {
      for (size_t i = 0; i < n; ++i) RefStep(ref[i], grads[t - 1][off + i], h, t);
    }
    for (const AdamKernels* k : SupportedAdamKernels()) {
      std::vector<float> p = p0, m(n + off, 0.0f), v(n + off, 0.0f);
      for (uint64_t t = 1; t <= 30; ++t) {
        AdamSpan s{p.data() + off, m.data() + off, v.data() + off, grads[t - 1].data() + off,
                   DType::kFp32,   nullptr,        DType::kFp32,   n};
        k->adam(ComputeStepConstants(h, t), s);
      }
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(p[off + i], ref[i].p, 1e-5 * std::fabs(ref[i].p) + 1e-7)
            << k->name << " adamw=" << adamw << " i=" << i << " scale=" << scale[i];
        ASSERT_TRUE(std::isfinite(p[off + i]));
      }
    }
  }
}

// Restoring (p, m, v) saved at step 1000 and continuing with steps 1001..
// must equal the uninterrupted run: bias correction follows the step number.
TEST(AdamKernels, ContinueCorrectlyAfterRestoreAtAnyStep) {
  const size_t n = 257;
  AdamHyperparams h;
  h.lr = 1e-3;
  h.beta2 = 0.99;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<RefState> ref(n);
  std::vector<float> p(n), m(n), v(n);
  for (size_t i = 0; i < n; ++i) {
    p[i] = normal(rng);
    m[i] = 0.1f * normal(rng);
    v[i] = 0.01f * std::fabs(normal(rng));
    ref[i] = {p[i], m[i], v[i]};
  }
  for (const AdamKernels* k : SupportedAdamKernels()) {
    std::vector<float> kp = p, km = m, kv = v;
    std::vector<RefState> r = ref;
    std::mt19937 grng(4);
    for (uint64_t t = 1001; t <= 1010; ++t) {
      std::vector<float> g(n);
      for (float& x : g) x = normal(grng);
      k->adam(ComputeStepConstants(h, t),
              {kp.data(), km.data(), kv.data(), g.data(), DType::kFp32, nullptr, DType::kFp32, n});
      for (size_t i = 0; i < n; ++i) RefStep(r[i], g[i], h, t);
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(kp[i], r[i].p, 1e-5 * std::fabs(r[i].p) + 1e-7) << k->name << " " << i;
    }
  }
  // Step 1 and step 1000 really differ (bias correction is not a no-op).
  EXPECT_NE(ComputeStepConstants(h, 1).neg_step_size, ComputeStepConstants(h, 1000).neg_step_size);
}

TEST(AdamScalar, ReadsHalfGradientsAndWritesHalfWorkingCopy) {
  AdamHyperparams h;
  const size_t n = 64;
  std::vector<float> p(n, 1.0f), m(n, 0.0f), v(n, 0.0f);
  std::vector<float> p32 = p, m32 = m, v32 = v, g32(n);
  std::vector<uint16_t> g16(n), w16(n);
  for (size_t i = 0; i < n; ++i) {
    g16[i] = FloatToBf16(0.25f * static_cast<float>(i) - 3.0f);
    g32[i] = Bf16ToFloat(g16[i]);
  }
  AdamStepConstants c = ComputeStepConstants(h, 1);
  AdamScalar(c,
             {p.data(), m.data(), v.data(), g16.data(), DType::kBf16, w16.data(), DType::kBf16, n});
  AdamScalar(
      c, {p32.data(), m32.data(), v32.data(), g32.data(), DType::kFp32, nullptr, DType::kFp32, n});
  for (size_t i = 0; i < n; ++i) {
    EXPECT_EQ(p[i], p32[i]);
    EXPECT_EQ(w16[i], FloatToBf16(p[i]));
  }
}

TEST(Hyperparams, RejectsOutOfRange) {
  AdamHyperparams h;
  EXPECT_TRUE(ValidateHyperparams(h).ok());
  h.beta1 = 1.0f;
  absl::Status s = ValidateHyperparams(h);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("beta1"), std::string::npos);
  h = {};
  h.eps = 0.0f;
  EXPECT_EQ(ValidateHyperparams(h).code(), absl::StatusCode::kInvalidArgument);
  h = {};
  h.lr = NAN;
  EXPECT_EQ(ValidateHyperparams(h).code(), absl::StatusCode::kInvalidArgument);
  h = {};
  h.grad_scale = 0.0f;
  EXPECT_EQ(ValidateHyperparams(h).code(), absl::StatusCode::kInvalidArgument);
}

// Finite doubles that do not survive the fp32 update are refused, naming
// the field, instead of silently turning master weights into Inf/NaN.
TEST(Hyperparams, RejectsWhatOverflowsOrVanishesInFloat) {
  auto expect_refused = [](AdamHyperparams h, const char* field) {
    absl::Status s = ValidateHyperparams(h);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << field;
    EXPECT_NE(s.message().find(field), std::string::npos) << s;
  };
  AdamHyperparams h;
  h.lr = 1e39;
  expect_refused(h, "lr");
  h = {};
  h.lr = 3e38;  // a float, but lr / (1 - beta1) at step 1 is not
  expect_refused(h, "lr");
  h = {};
  h.eps = 1e-50;
  expect_refused(h, "eps");
  h = {};
  h.weight_decay = 1e39;
  expect_refused(h, "weight_decay");
  h = {};
  h.lr = 1e20;
  h.weight_decay = 1e20;  // 1 - lr * wd overflows
  h.beta1 = 0.0;
  expect_refused(h, "weight_decay");
  // Extreme but representable values still pass.
  h = {};
  h.eps = 1e-40;  // a subnormal float
  h.lr = 1e30;
  EXPECT_TRUE(ValidateHyperparams(h).ok());
}

}  // namespace
}  // namespace offload
