"""DeepSpeed's CPU Adam as benches/cpu_adam's peer, one measurement per request, so that the
bench can time each of its cases and the peer's matching case back to back (seconds apart, the
same phase of a machine whose memory bandwidth drifts over minutes) instead of a child process
per round.

The peer's op is built by its own harness (../shared/peers/deepspeed_cpu_adam, `bench.py`:
`build()`, `tensors()` and its hyperparameters); this file only times it. Cases:

  fp32        the harness's fp32 case: `adam_update` on fp32 params, grads and moments (28 B/param)
  bf16        the harness's bf16 case: bf16 params and grads, fp32 moments, no master (22 B/param)
  zero3       DeepSpeed's CPU work for one ZeRO-3 step of bf16 training: `adam_update` over the
              partition's fp32 parameters, gradients and moments, then the copy of the updated
              fp32 parameters into the bf16 working ones that ZeRO-3 makes after every step
              (deepspeed/runtime/zero/stage3.py, _reassign_or_swap_out_partitioned_parameters:
              fp16_partitioned_groups_flat[i].data.copy_(fp32_partitioned_groups_flat[i].data),
              on the CPU where the parameters are offloaded): 36 B/param
  zero3_fp32  the same for fp32 training: with offload_optimizer, _create_fp32_partitions makes the
              fp32 partition with `.to(...).clone()` whatever the parameters' dtype (the alias it
              makes otherwise is only for parameters kept on the optimizer's device), so the
              working parameters are a copy too: 40 B/param

usage: OMP_NUM_THREADS=T ds_peer.py --peer=DIR --n=N --threads=T
Reads requests `CASE REPS` on stdin, one a line; answers each with
`deepspeed_cpu_adam CASE n=N threads=T Gparam/s=X` (the best of REPS steps after one), or
`error CASE: WHY`. Each case's tensors are made at its first request and kept, so that every
round measures the same memory: at N parameters about 34 N bytes (fp32 16 N, bf16 12 N, the
two ZeRO-3 copies 6 N), beside benches/cpu_adam's own 24 N (about 6 GB together at 100M).
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
    a = ap.parse_args()
    sys.path.insert(0, a.peer)
    import bench as peer  # the peer's harness: its build() loads the op it built (cached)
    ds = peer.build()
    torch.set_num_threads(a.threads)  # the op's `omp parallel for` and the copy use this pool
    ds.create_adam(0, peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True, False)
    tensors = {}  # "fp32" / "bf16": the harness's (p, g, m, v); "bf16_copy" / "fp32_copy"
    steps = {}    # per tensor set: the Adam step its state is at

    def step_fn(case):
        kind = "bf16" if case == "bf16" else "fp32"
        if kind not in tensors:
            tensors[kind] = peer.tensors(kind, a.n)
            steps[kind] = 0
        p, g, m, v = tensors[kind]
        copy = None
        if case in ("zero3", "zero3_fp32"):
            key = "bf16_copy" if case == "zero3" else "fp32_copy"
            if key not in tensors:
                tensors[key] = torch.zeros(a.n, dtype=torch.bfloat16 if case == "zero3"
                                           else torch.float32)
            copy = tensors[key]

        def one():
            steps[kind] += 1
            ds.adam_update(0, steps[kind], peer.LR, peer.BETA1, peer.BETA2, peer.EPS, 0.0, True,
                           p, g, m, v)
            if copy is not None:
                copy.copy_(p)
        return one

    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        case = words[0]
        if (case not in ("fp32", "bf16", "zero3", "zero3_fp32") or len(words) != 2
                or not words[1].isdigit()):
            print(f"error {case}: want `CASE REPS`, CASE one of fp32, bf16, zero3, zero3_fp32",
                  flush=True)
            continue
        reps = max(1, int(words[1]))
        one = step_fn(case)
        one()  # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            one()
            best = min(best, time.perf_counter() - t0)
        print(f"deepspeed_cpu_adam {case} n={a.n} threads={a.threads} "
              f"Gparam/s={a.n / best / 1e9:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
