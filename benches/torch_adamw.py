"""Times torch.optim.AdamW steps for benches/cpu_adam (the peer it compares to).

usage: torch_adamw.py NUMEL THREADS REPS
Prints one line: the best time of REPS steps in seconds (after one warm-up).
"""
import sys
import time

import torch


def main():
    n, threads, reps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(threads)
    p = torch.randn(n, requires_grad=True)
    p.grad = torch.randn(n)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    opt.step()  # allocates the moments
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        opt.step()
        best = min(best, time.perf_counter() - start)
    print(f"{best:.9f}")


if __name__ == "__main__":
    main()
