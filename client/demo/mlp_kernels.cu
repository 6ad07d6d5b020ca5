// The demo MLP's forward and backward (mlp.h's ForwardBackward) as CUDA
// kernels, compiled by nvcc where the build has the toolkit
// (client/demo/BUILD). Plain kernels for a small model: one block per
// sample forward, one block per hidden unit backward; each sum runs in a
// fixed order, so a run repeats itself bit for bit.
#include <cuda_runtime_api.h>

#include "client/demo/mlp_kernels.h"

namespace {

constexpr int kThreads = 128;

// Block k: h[k, :] = tanh(w1 x_k + b1), err[k] = w2 . h[k, :] + b2 - y[k].
__global__ void Forward(int inputs, int hidden, const float* x, const float* y, const float* w1,
                        const float* b1, const float* w2, const float* b2, float* h, float* err) {
  __shared__ float partial[kThreads];
  const int k = blockIdx.x;
  const float* xk = x + static_cast<size_t>(k) * inputs;
  float acc = 0.0f;
  for (int j = threadIdx.x; j < hidden; j += blockDim.x) {
    float z = b1[j];
    for (int i = 0; i < inputs; ++i) z += w1[static_cast<size_t>(j) * inputs + i] * xk[i];
    const float hj = tanhf(z);
    h[static_cast<size_t>(k) * hidden + j] = hj;
    acc += w2[j] * hj;
  }
  partial[threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float out = b2[0];
    for (int t = 0; t < blockDim.x; ++t) out += partial[t];
    err[k] = out - y[k];
  }
}

// Block j < hidden: the gradients of hidden unit j (row j of w1, b1[j],
// w2[j]); block `hidden`: b2's gradient and the loss.
__global__ void Backward(int inputs, int hidden, int count, const float* x, const float* h,
                         const float* err, const float* w2, float* gw1, float* gb1, float* gw2,
                         float* gb2, float* loss) {
  const int j = blockIdx.x;
  const float scale = 2.0f / static_cast<float>(count);
  if (j == hidden) {
    if (threadIdx.x == 0) {
      float g = 0.0f, l = 0.0f;
      for (int k = 0; k < count; ++k) {
        g += scale * err[k];
        l += err[k] * err[k];
      }
      gb2[0] = g;
      *loss = l / static_cast<float>(count);
    }
    return;
  }
  for (int i = threadIdx.x; i < inputs; i += blockDim.x) {
    float g = 0.0f;
    for (int k = 0; k < count; ++k) {
      const float hk = h[static_cast<size_t>(k) * hidden + j];
      g += scale * err[k] * w2[j] * (1.0f - hk * hk) * x[static_cast<size_t>(k) * inputs + i];
    }
    gw1[static_cast<size_t>(j) * inputs + i] = g;
  }
  if (threadIdx.x == 0) {
    float g2 = 0.0f, g1 = 0.0f;
    for (int k = 0; k < count; ++k) {
      const float hk = h[static_cast<size_t>(k) * hidden + j];
      const float dout = scale * err[k];
      g2 += dout * hk;
      g1 += dout * w2[j] * (1.0f - hk * hk);
    }
    gw2[j] = g2;
    gb1[j] = g1;
  }
}

}  // namespace

extern "C" int OffloadDemoMlpForwardBackward(const OffloadDemoMlpArgs* a, void* stream) {
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  Forward<<<a->count, kThreads, 0, s>>>(a->inputs, a->hidden, a->x, a->y, a->w1, a->b1, a->w2,
                                        a->b2, a->h, a->err);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  Backward<<<a->hidden + 1, kThreads, 0, s>>>(a->inputs, a->hidden, a->count, a->x, a->h, a->err,
                                              a->w2, a->gw1, a->gb1, a->gw2, a->gb2, a->loss);
  return cudaGetLastError();
}
