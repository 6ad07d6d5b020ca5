// Our kernels against torch.optim.Adam / AdamW (Debian's python3-torch) over
// 100 steps: norm-wise relative error at most 1e-6, every element within
// rtol 1e-5 / atol 1e-7. Skips with the reason when torch is not installed.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/kernel_select.h"
#include "gtest/gtest.h"

namespace offload {
namespace {

constexpr char kPython[] = "/usr/bin/python3";

struct Trajectory {
  uint64_t n = 0, steps = 0;
  uint32_t grad_bits = 32, adamw = 0;
  AdamHyperparams h;
  std::vector<float> p0, p, m, v;
  std::vector<unsigned char> grads;  // steps * n elements
};

bool ReadTrajectory(const std::string& path, Trajectory* t) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  auto read = [&in](void* dst, size_t bytes) {
    in.read(static_cast<char*>(dst), static_cast<std::streamsize>(bytes));
  };
  read(&t->n, 8);
  read(&t->steps, 8);
  read(&t->grad_bits, 4);
  read(&t->adamw, 4);
  double f[5];  // exactly the Python floats torch was given
  read(f, sizeof(f));
  t->h.lr = f[0];
  t->h.beta1 = f[1];
  t->h.beta2 = f[2];
  t->h.eps = f[3];
  t->h.weight_decay = f[4];
  t->h.decoupled_weight_decay = t->adamw != 0;
  t->p0.resize(t->n);
  read(t->p0.data(), t->n * 4);
  t->grads.resize(t->steps * t->n * (t->grad_bits / 8));
  read(t->grads.data(), t->grads.size());
  for (auto* vec : {&t->p, &t->m, &t->v}) {
    vec->resize(t->n);
    read(vec->data(), t->n * 4);
  }
  return static_cast<bool>(in);
}

class TorchReferenceTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (access(kPython, X_OK) != 0) {
      skip_reason_ = "no /usr/bin/python3 (install python3-torch)";
      return;
    }
    if (std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") != 0) {
      skip_reason_ = "python3 cannot import torch (install python3-torch)";
      return;
    }
    dir_ = std::string(std::getenv("TEST_TMPDIR")) + "/torch_ref";
    std::string cmd =
        "mkdir -p " + dir_ + " && " + kPython + " cpu_adam/torch_reference.py " + dir_;
    generated_ = std::system(cmd.c_str()) == 0;
  }

  void SetUp() override {
    if (!skip_reason_.empty()) GTEST_SKIP() << skip_reason_;
    ASSERT_TRUE(generated_) << "torch_reference.py failed";
  }

  static std::string skip_reason_;
  static std::string dir_;
  static bool generated_;
};

std::string TorchReferenceTest::skip_reason_;
std::string TorchReferenceTest::dir_;
bool TorchReferenceTest::generated_ = false;

void ExpectClose(const std::vector<float>& got, const float* want, size_t n, const char* what) {
  double diff2 = 0, ref2 = 0;
  size_t bad = 0, identical = 0;
  for (size_t i = 0; i < n; ++i) {
    identical += std::memcmp(&got[i], &want[i], 4) == 0;
    const double d = static_cast<double>(got[i]) - want[i];
    diff2 += d * d;
    ref2 += static_cast<double>(want[i]) * want[i];
    if (std::fabs(d) > 1e-7 + 1e-5 * std::fabs(want[i])) {
      if (bad++ < 5) ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", torch " << want[i];
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": elements outside rtol 1e-5 / atol 1e-7";
  // Informational: same op order as torch makes most elements bit-identical.
  std::printf("%-36s bit-identical to torch: %zu of %zu\n", what, identical, n);
  EXPECT_LE(std::sqrt(diff2 / ref2), 1e-6) << what << ": norm-wise relative error";
}

TEST_F(TorchReferenceTest, EveryKernelMatchesTorchOver100Steps) {
  int compared = 0;
  for (const char* name : {"adamw_fp32", "adam_l2_fp32", "adamw_bf16", "adam_nodecay_fp32"}) {
    Trajectory t;
    ASSERT_TRUE(ReadTrajectory(dir_ + "/" + name + ".bin", &t)) << name;
    ASSERT_EQ(t.steps, 100u);
    const DType gdt = t.grad_bits == 16 ? DType::kBf16 : DType::kFp32;
    const size_t gsize = DTypeSize(gdt);
    for (const AdamKernels* k : SupportedAdamKernels()) {
      // One element of offset: unaligned starts for every buffer.
      std::vector<float> p(t.n + 1), m(t.n + 1, 0.0f), v(t.n + 1, 0.0f);
      std::vector<unsigned char> g((t.n + 1) * gsize);
      std::memcpy(p.data() + 1, t.p0.data(), t.n * 4);
      for (uint64_t step = 1; step <= t.steps; ++step) {
        std::memcpy(g.data() + gsize, t.grads.data() + (step - 1) * t.n * gsize, t.n * gsize);
        AdamSpan s{p.data() + 1, m.data() + 1, v.data() + 1, g.data() + gsize,
                   gdt,          nullptr,      DType::kFp32, t.n};
        k->adam(ComputeStepConstants(t.h, step), s);
      }
      const std::string what = std::string(name) + "/" + k->name;
      std::vector<float> pp(p.begin() + 1, p.end()), mm(m.begin() + 1, m.end()),
          vv(v.begin() + 1, v.end());
      ExpectClose(pp, t.p.data(), t.n, (what + " param").c_str());
      ExpectClose(mm, t.m.data(), t.n, (what + " exp_avg").c_str());
      ExpectClose(vv, t.v.data(), t.n, (what + " exp_avg_sq").c_str());
      ++compared;
    }
  }
  EXPECT_GE(compared, 4);
}

}  // namespace
}  // namespace offload
