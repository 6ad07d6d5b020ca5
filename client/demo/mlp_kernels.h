// The boundary between the demo's CUDA kernels (mlp_kernels.cu, built by
// nvcc) and the C++ that launches them (cuda_mlp_kernels.cc): plain C, so
// that neither compiler sees the other's headers.
#ifndef OFFLOADD_CLIENT_DEMO_MLP_KERNELS_H_
#define OFFLOADD_CLIENT_DEMO_MLP_KERNELS_H_

#ifdef __cplusplus
extern "C" {
#endif

struct OffloadDemoMlpArgs {
  int inputs, hidden, count;
  const float *x, *y;              // count x inputs, count
  const float *w1, *b1, *w2, *b2;  // parameters
  float *gw1, *gb1, *gw2, *gb2;    // their gradients (overwritten)
  float* loss;                     // the mean squared error
  float *h, *err;                  // workspace: count x hidden, count
};

// Issues the forward and backward on `stream` (a cudaStream_t); returns a
// cudaError_t (0: issued).
int OffloadDemoMlpForwardBackward(const struct OffloadDemoMlpArgs* args, void* stream);

#ifdef __cplusplus
}
#endif

#endif  // OFFLOADD_CLIENT_DEMO_MLP_KERNELS_H_
