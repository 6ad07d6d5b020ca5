"""Writes torch.optim.Adam/AdamW trajectories for cpu_adam's reference test.

usage: torch_reference.py OUT_DIR

For each case below, writes OUT_DIR/<case>.bin (little-endian):
  u64 n, u64 steps, u32 grad_bits (32 or 16: bf16), u32 adamw,
  f64 lr, beta1, beta2, eps, weight_decay,
  f32 p0[n], grads[steps][n] (f32, or bf16 bits as u16),
  f32 p[n], exp_avg[n], exp_avg_sq[n]   (after the last step)
"""
import struct
import sys

import torch

CASES = {
    # name: (adamw, grad_bits, lr, betas, eps, weight_decay)
    "adamw_fp32": (True, 32, 1e-3, (0.9, 0.999), 1e-8, 0.01),
    "adam_l2_fp32": (False, 32, 1e-3, (0.9, 0.999), 1e-8, 0.01),
    "adamw_bf16": (True, 16, 3e-4, (0.8, 0.95), 1e-6, 0.1),
    "adam_nodecay_fp32": (False, 32, 1e-2, (0.9, 0.99), 1e-8, 0.0),
}
N = 10007  # not a multiple of any vector width
STEPS = 100


def main(out_dir):
    for index, (name, (adamw, bits, lr, betas, eps, wd)) in enumerate(CASES.items()):
        torch.manual_seed(1234 + index)
        # Magnitudes spread over six decades, signs mixed.
        p0 = torch.randn(N) * torch.pow(10.0, torch.empty(N).uniform_(-3, 3))
        p = p0.clone().requires_grad_(True)
        cls = torch.optim.AdamW if adamw else torch.optim.Adam
        opt = cls([p], lr=lr, betas=betas, eps=eps, weight_decay=wd)
        scale = torch.pow(10.0, torch.empty(N).uniform_(-4, 1))
        grads = []
        for _ in range(STEPS):
            g = torch.randn(N) * scale
            if bits == 16:
                g = g.bfloat16()
            grads.append(g)
            p.grad = g.float()
            opt.step()
        state = opt.state[p]
        with open(f"{out_dir}/{name}.bin", "wb") as f:
            f.write(struct.pack("<QQII5d", N, STEPS, bits, int(adamw), lr, betas[0], betas[1], eps, wd))
            f.write(p0.numpy().astype("<f4").tobytes())
            for g in grads:
                if bits == 16:
                    f.write(g.view(torch.int16).numpy().astype("<i2").tobytes())
                else:
                    f.write(g.numpy().astype("<f4").tobytes())
            for t in (p.detach(), state["exp_avg"], state["exp_avg_sq"]):
                f.write(t.numpy().astype("<f4").tobytes())
    print("wrote", len(CASES), "cases")


if __name__ == "__main__":
    main(sys.argv[1])
