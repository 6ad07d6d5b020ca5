"""DeepSpeed's CPU work for one ZeRO-3 optimizer step of a bf16-trained partition, as the peer of
benches/cpu_adam's "bf16 grads + bf16 copy": DeepSpeed's CPU Adam (the peer's op, built by its
own harness, ../shared/peers/deepspeed_cpu_adam) over the partition's fp32 parameters, gradients
and moments, then the copy of the updated fp32 parameters into the partition's bf16 ones that
DeepSpeed's ZeRO-3 makes after every step (deepspeed/runtime/zero/stage3.py,
_reassign_or_swap_out_partitioned_parameters: fp16_partitioned_groups_flat[i].data.copy_(
fp32_partitioned_groups_flat[i].data), on the CPU where the parameters are offloaded).

usage: OMP_NUM_THREADS=T ds_zero3_step.py --peer=DIR --n=N --threads=T [--reps=R]
Prints: deepspeed_cpu_adam zero3 n=N threads=T Gparam/s=X (the best of R steps after one).
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
    a = ap.parse_args()
    sys.path.insert(0, a.peer)
    import bench as peer  # the peer's harness: its build() loads the op it built (cached)
    ds = peer.build()
    torch.set_num_threads(a.threads)  # the op's `omp parallel for` and the copy use this pool
    p, g, m, v = peer.tensors("fp32", a.n)
    lp = torch.zeros(a.n, dtype=torch.bfloat16)
    ds.create_adam(0, peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True, False)
    best = float("inf")
    for step in range(1, a.reps + 2):
        t0 = time.perf_counter()
        ds.adam_update(0, step, peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True, p, g, m, v)
        lp.copy_(p)
        if step > 1:  # the first is the warm-up
            best = min(best, time.perf_counter() - t0)
    ds.destroy_adam(0)
    print(f"deepspeed_cpu_adam zero3 n={a.n} threads={a.threads} Gparam/s={a.n / best / 1e9:.3f}",
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
