"""The Python demo (README command 1): a small GPT-style character-level
transformer learns a licence text through offloadd, with its optimizer state
on the NVMe tier, and the same model learns it in-process with
torch.optim.AdamW to compare.

usage: train_gpt.py [--steps N] [--out DIR] [--placement host|nvme] ...
The daemon's address comes from --address or $OFFLOADD_ADDRESS (else its
default socket). Writes DIR/loss.png and prints a summary and a sample."""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import offloadd  # noqa: E402
import offloadd.torch  # noqa: E402


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--text", default="/usr/share/common-licenses/GPL-3")
    p.add_argument("--placement", default="nvme", choices=["host", "nvme"],
                   help="where offloadd keeps the optimizer state")
    p.add_argument("--address", default="")
    p.add_argument("--out", default=".", help="directory for loss.png")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args()


def mib(n):
    return n / (1 << 20)


def train(args, text, use_offloadd, progress):
    torch.manual_seed(0)
    model = gpt.GPT(text.vocab, args.context, dim=args.dim, layers=args.layers, heads=4)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and "weight" in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and "weight" in n)]
    groups = [{"params": decay}, {"params": other, "weight_decay": 0.0}]
    client = None
    if use_offloadd:
        model, opt = offloadd.torch.wrap(
            model, {"lr": args.lr, "weight_decay": 0.1, "params": groups},
            {"address": args.address, "session_name": "demo", "gradient_clipping": 1.0,
             "placement": {"optimizer_state": args.placement}})
        client = model.offloadd.client
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.1)
    warmup = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.1, 1 - s / args.steps)))
    gen = torch.Generator().manual_seed(1)
    losses = []
    tokens = args.batch * args.context
    label = "offloadd" if use_offloadd else "torch AdamW"
    bar = progress(range(args.steps), desc=f"{label:>11}", unit="step")
    start = time.perf_counter()
    first = client.stats()["counters"] if client else None
    for step in bar:
        x, y = text.batch(args.batch, args.context, gen)
        loss = model(x, y)
        loss.backward()
        if not use_offloadd:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
        if hasattr(bar, "set_postfix") and (step % 10 == 0 or step == args.steps - 1):
            post = {"loss": f"{losses[-1]:.3f}",
                    "tok/s": f"{tokens * (step + 1) / (time.perf_counter() - start):.0f}"}
            if client:
                c = client.stats()["counters"]
                post["nvme in/out MiB"] = (f"{mib(c['swap_in_bytes'] - first['swap_in_bytes']):.0f}/"
                                           f"{mib(c['swap_out_bytes'] - first['swap_out_bytes']):.0f}")
            bar.set_postfix(post)
    seconds = time.perf_counter() - start
    result = {"losses": losses, "seconds": seconds, "tokens_per_s": tokens * args.steps / seconds}
    if client:
        c = client.stats()["counters"]
        result["swap_in"] = c["swap_in_bytes"] - first["swap_in_bytes"]
        result["swap_out"] = c["swap_out_bytes"] - first["swap_out_bytes"]
        result["timings"] = dict(model.offloadd.timings)
        session = [s for s in client.stats()["sessions"] if s["id"] == model.offloadd.session.id]
        result["placed"] = session[0] if session else {}
    sample = model.sample(torch.tensor([[text.index["\n"]]]), 120,
                          generator=torch.Generator().manual_seed(2))[0, 1:].tolist()
    result["sample"] = text.decode(sample).strip().split("\n")[0]
    if use_offloadd:
        opt.close()
    return result


def plot(path, mine, ref):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs, k=10):
        return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1])
                for i in range(len(xs))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(smooth(ref["losses"]), label="in-process torch.optim.AdamW", linewidth=2)
    ax.plot(smooth(mine["losses"]), label="through offloadd", linestyle="--", linewidth=2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (10-step mean)")
    ax.set_title("char-level GPT on a licence text")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main():
    args = parse()
    torch.set_num_threads(max(1, (os.cpu_count() or 1)))
    text = gpt.Text(args.text)
    if args.no_progress:
        def progress(it, **_):
            return it
    else:
        from tqdm import tqdm

        def progress(it, **kw):
            return tqdm(it, **kw, dynamic_ncols=True)
    n_params = sum(p.numel() for p in gpt.GPT(text.vocab, args.context, dim=args.dim,
                                              layers=args.layers).parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, {args.layers} layers, vocabulary "
          f"{text.vocab} characters of {args.text}; optimizer state on {args.placement}")
    mine = train(args, text, True, progress)
    ref = train(args, text, False, progress)
    os.makedirs(args.out, exist_ok=True)
    png = os.path.join(args.out, "loss.png")
    plot(png, mine, ref)
    last = max(1, args.steps // 10)
    m = sum(mine["losses"][-last:]) / last
    r = sum(ref["losses"][-last:]) / last
    t = mine["timings"]
    print(f"\nsteps: {args.steps} of {args.batch}x{args.context} tokens")
    print(f"final loss (mean of the last {last} steps): offloadd {m:.4f}, torch AdamW {r:.4f} "
          f"({100 * (m - r) / r:+.2f}%)")
    print(f"tokens/s: offloadd {mine['tokens_per_s']:.0f}, torch AdamW {ref['tokens_per_s']:.0f}")
    print(f"offloadd time per step: fetch {1e3 * t['fetch'] / args.steps:.1f} ms, "
          f"return {1e3 * t['return'] / args.steps:.1f} ms, step {1e3 * t['step'] / args.steps:.1f}"
          f" ms, compute and the rest "
          f"{1e3 * (mine['seconds'] - t['fetch'] - t['return'] - t['step']) / args.steps:.1f} ms")
    p = mine["placed"]
    if p:
        print(f"optimizer state placed: {mib(p['state_host_bytes']):.1f} MiB host, "
              f"{mib(p['state_nvme_bytes']):.1f} MiB NVMe; swapped in {mib(mine['swap_in']):.0f}"
              f" MiB, out {mib(mine['swap_out']):.0f} MiB")
    print(f"loss curves: {png}")
    print(f"sample (offloadd's model): {mine['sample']!r}")
    print(f"sample (torch's model):    {ref['sample']!r}")


if __name__ == "__main__":
    main()
