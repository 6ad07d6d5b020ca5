"""DeepSpeed's CPU work for one ZeRO-3 optimizer step of a partition, as the peer of
benches/cpu_adam's "bf16 grads + bf16 copy" (bf16 training) and "fp32 grads + fp32 copy" (fp32
training): DeepSpeed's CPU Adam (the peer's op, built by its own harness,
../shared/peers/deepspeed_cpu_adam) over the partition's fp32 parameters, gradients and moments,
then the copy of the updated fp32 parameters into the partition's working ones that DeepSpeed's
ZeRO-3 makes after every step (deepspeed/runtime/zero/stage3.py,
_reassign_or_swap_out_partitioned_parameters: fp16_partitioned_groups_flat[i].data.copy_(
fp32_partitioned_groups_flat[i].data), on the CPU where the parameters are offloaded). With fp32
training the working parameters are a copy too: with offload_optimizer, _create_fp32_partitions
makes the fp32 partition with `.to(...).clone()` whatever the parameters' dtype (the alias it
makes otherwise is only for parameters kept on the optimizer's device, not offloaded).

usage: OMP_NUM_THREADS=T ds_zero3_step.py --peer=DIR --n=N --threads=T [--reps=R]
       [--dtypes=bf16,fp32]
Prints per dtype: deepspeed_cpu_adam CASE n=N threads=T Gparam/s=X (CASE zero3 for bf16,
zero3_fp32 for fp32; the best of R steps after one).
"""
import argparse
import sys
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", required=True)
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dtypes", default="bf16,fp32")
    a = ap.parse_args()
    sys.path.insert(0, a.peer)
    import bench as peer  # the peer's harness: its build() loads the op it built (cached)
    ds = peer.build()
    torch.set_num_threads(a.threads)  # the op's `omp parallel for` and the copy use this pool
    cases = {"bf16": ("zero3", torch.bfloat16), "fp32": ("zero3_fp32", torch.float32)}
    for dtype in a.dtypes.split(","):
        if dtype not in cases:
            sys.exit(f"--dtypes: bf16 or fp32, not {dtype!r}")
        name, working = cases[dtype]
        p, g, m, v = peer.tensors("fp32", a.n)
        lp = torch.zeros(a.n, dtype=working)
        ds.create_adam(0, peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True, False)
        best = float("inf")
        for step in range(1, a.reps + 2):
            t0 = time.perf_counter()
            ds.adam_update(0, step, peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True,
                           p, g, m, v)
            lp.copy_(p)
            if step > 1:  # the first is the warm-up
                best = min(best, time.perf_counter() - t0)
        ds.destroy_adam(0)
        del p, g, m, v, lp
        print(f"deepspeed_cpu_adam {name} n={a.n} threads={a.threads} "
              f"Gparam/s={a.n / best / 1e9:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
