"""A GPT larger than the GPU, trained through offloadd.

In one run: the GPT (client/python/demo/gpt.py, --layers blocks of width
--dim) trained GPU-resident with torch.optim.AdamW the usual mixed-precision
way (fp32 weights, gradients and Adam moments on the GPU, 16 bytes a
parameter; bf16 autocast) runs out of GPU memory, and its error is printed.
The same model then trains through offloadd.torch: the bf16 working copy on
the GPU through the GPU tier, the fp32 master weights, Adam moments and fp32
gradients in the daemon on the host (on NVMe for the part of the optimizer
state the host cannot hold, if any), for --steps steps after --warmup.

Each mode's step time is set against its bound, measured in the same run:
  compute  forward and backward of the bf16 model held wholly on the GPU
           (no optimizer: it fits there without AdamW's state)
  link     the working copy to the GPU and the fp32 gradients back at the
           pinned bandwidth measured here
  T_opt    the daemon's update (StepResult.compute_us of the run's own steps)
sync: max(compute, link) + T_opt; the delayed update (dpu: the update of
step i beside the forward and backward of i+1, one step stale):
max(compute, link, T_opt). The overlapped step without it (overlap) is
reported against the same bound, though its update can hide only behind
the forward pass (the backward's gradients are what the next update needs).

usage: larger_than_gpu.py --offloadd=PATH [--dim=D --layers=L --heads=H
       --batch=B --context=T --steps=N --warmup=W --modes=sync,dpu,overlap
       --swap_dir=DIR --gpu_memory_gib=G --device=cuda|cpu] [--tiny]
--gpu_memory_gib caps what torch may allocate on the GPU (both runs alike),
to show the same on a GPU with more memory than the model needs; the output
says so. Without a GPU (--device=cpu, the smoke test) the tier runs on the
emulated device and the reference does not run out of memory: the output
says that too."""
import argparse
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "client", "python", "demo"))
import gpt  # noqa: E402

import offloadd  # noqa: E402
import offloadd.torch  # noqa: E402
from bench_daemon import host_stream, start_daemon  # noqa: E402
from torch_tokens import pinned_bandwidth, sync  # noqa: E402

GIB = 1 << 30


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def build(args, text, device, dtype):
    """The GPT in `dtype`, made on `device` (on a GPU: never through the
    host)."""
    torch.manual_seed(0)
    if device.type == "cuda":
        with torch.device(device):  # torch 2
            model = gpt.GPT(text.vocab, args.context, dim=args.dim, layers=args.layers,
                            heads=args.heads)
    else:
        model = gpt.GPT(text.vocab, args.context, dim=args.dim, layers=args.layers,
                        heads=args.heads)
    return model.to(dtype=dtype)


def batches(args, text, device):
    gen = torch.Generator().manual_seed(1)
    while True:
        yield (t.to(device) for t in text.batch(args.batch, args.context, gen))


def torch_resident(args, text, device):
    """GPU-resident training with torch AdamW, fp32 state, bf16 autocast:
    the error that ends it (out of memory), or None if a step fits."""
    model = opt = None
    try:
        model = build(args, text, device, torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
        x, y = next(batches(args, text, device))
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = model(x, y)
        loss.backward()
        opt.step()
        sync(device)
        return None
    except getattr(torch.cuda, "OutOfMemoryError", MemoryError) as e:
        return str(e).splitlines()[0]
    finally:
        del model, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def compute_only(args, text, device, dtype, iters=3):
    """Seconds per forward and backward of the model held on the device in
    `dtype`, no optimizer."""
    model = build(args, text, device, dtype)
    data = batches(args, text, device)
    times = []
    for i in range(iters + 1):
        x, y = next(data)
        sync(device)
        start = time.perf_counter()
        model(x, y).backward()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
        for p in model.parameters():
            p.grad = None
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return statistics.median(times)


def through_offloadd(args, text, device, dtype, address, placement, mode):
    """Step times (seconds) and the daemon's update times of a run through
    offloadd.torch, and the GPU tier's stats."""
    # The previous run's session is closed; its memory leaves the pool
    # (pages freed in the background) before this one asks for as much.
    client = offloadd.Client(address)
    deadline = time.monotonic() + 300
    while client.stats()["tiers"]["host"]["used_bytes"] and time.monotonic() < deadline:
        time.sleep(0.2)
    model = build(args, text, device, dtype)
    working = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    zero = {"address": address, "session_name": f"large-{mode}", "working_dtype": working,
            "placement": {"optimizer_state": placement}, "overlap_step": mode == "overlap",
            "delayed_update": mode == "dpu",
            "gradient_clipping": 1.0,
            "gpu": {"tier": True} if device.type == "cuda" else {"device": "emulated"}}
    start = time.perf_counter()
    model, opt = offloadd.torch.wrap(model, {"lr": 1e-4, "weight_decay": 0.1}, zero)
    wrap_s = time.perf_counter() - start
    data = batches(args, text, device)
    walls, t_opt, losses = [], [], []
    loss = x = y = None
    try:
        for step in range(args.warmup + args.steps):
            x, y = next(data)
            sync(device)
            start = time.perf_counter()
            loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())  # waits for the GPU
            walls.append(time.perf_counter() - start)
            # The update's own time: the step just taken, or, overlapped,
            # the previous one (ended by this step()).
            done = opt.last_finished if mode != "sync" else opt.last_step
            if done and done.get("compute_us"):
                t_opt.append(done["compute_us"] / 1e6)
            print(f"  step {step}: {1e3 * walls[-1]:.0f} ms, loss {losses[-1]:.4f}", flush=True)
        stats = model.offloadd.gpu_stats()
    finally:
        opt.close()
        # The last loss's graph holds the hooks, and through them the
        # session: let go of everything.
        del model, opt, loss, x, y
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    timed = walls[args.warmup:]
    return {"wall": statistics.median(timed), "walls": timed, "losses": losses,
            "t_opt": statistics.median(t_opt[args.warmup:]) if len(t_opt) > args.warmup else 0.0,
            "wrap_s": wrap_s, "gpu": stats}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--offloadd", required=True)
    p.add_argument("--dim", type=int, default=4096)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--modes", default="sync,dpu")
    p.add_argument("--swap_dir", default="/var/tmp")
    p.add_argument("--gpu_memory_gib", type=float, default=0.0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a few steps of a tiny model")
    args = p.parse_args()
    if args.tiny:
        args.dim, args.layers, args.heads, args.batch, args.context = 32, 2, 2, 2, 16
        args.steps, args.warmup = 2, 1
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    # bf16 where the GPU computes; the CPU run (a smoke test on the emulated
    # device) keeps fp32, which every torch computes on the CPU.
    dtype = torch.bfloat16 if cuda else torch.float32
    esize = torch.empty(0, dtype=dtype).element_size()
    modes = args.modes.split(",")

    text = gpt.Text("/usr/share/common-licenses/GPL-3")
    per_block = 12 * args.dim * args.dim + 13 * args.dim
    n = per_block * args.layers + (text.vocab + args.context) * args.dim + \
        2 * args.dim + args.dim * text.vocab + text.vocab
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        name = torch.cuda.get_device_name(device)
        if args.gpu_memory_gib:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.gpu_memory_gib * GIB / total),
                                                       device)
        print(f"device: {name}, {total / GIB:.1f} GiB"
              + (f", torch capped at {args.gpu_memory_gib:.1f} GiB (--gpu_memory_gib)"
                 if args.gpu_memory_gib else ""))
    # What the daemon holds: the working copy (twice with the delayed
    # update), fp32 gradients, fp32 master and two moments (no gradient
    # accumulator: the gradients are handed over). The optimizer state goes
    # partly to NVMe only if the host cannot hold it beside the rest.
    state = 12 * n
    rest = ((2 if "dpu" in modes else 1) * esize + 4) * n
    avail = mem_available()
    room = int(0.92 * avail) - rest - 4 * GIB  # the trainer's own memory besides
    host_percent = 100 if room >= state else max(0, int(100 * room / state))
    pool = rest + state * host_percent // 100 + 2 * GIB
    print(f"model: {n / 1e6:.1f}M parameters ({args.layers} blocks, dim {args.dim}, "
          f"{args.heads} heads), {args.batch}x{args.context} tokens per step, working copy "
          f"{str(dtype).split('.')[-1]}; GPU-resident AdamW needs {16 * n / GIB:.1f} GiB for "
          f"weights, gradients and moments; the daemon holds {(rest + state) / GIB:.1f} GiB "
          f"(pool {pool / GIB:.1f} GiB, optimizer state {host_percent}% on the host; "
          f"MemAvailable {avail / GIB:.1f} GiB)", flush=True)

    start = time.perf_counter()
    err = torch_resident(args, text, device)
    if err is None:
        print(f"torch AdamW, GPU-resident: one step fits ({time.perf_counter() - start:.1f} s): "
              "this model is NOT larger than the device")
    else:
        print(f"torch AdamW, GPU-resident: out of memory after {time.perf_counter() - start:.1f} "
              f"s:\n  {err}")
    t_compute = compute_only(args, text, device, dtype)
    link = 0.0
    if cuda:
        h2d, d2h = pinned_bandwidth(device)
        link = esize * n / h2d + 4 * n / d2h
        print(f"pinned memory: {h2d / 1e9:.1f} GB/s to the GPU, {d2h / 1e9:.1f} GB/s back")
    print(f"compute (forward and backward, model on the device): {1e3 * t_compute:.0f} ms; "
          f"link: {1e3 * link:.0f} ms", flush=True)

    root = tempfile.mkdtemp(prefix="larger.", dir="/tmp")
    swap = tempfile.mkdtemp(prefix="larger.", dir=args.swap_dir)
    flags = [f"--memory.host_budget_bytes={pool}"]
    if host_percent < 100:
        flags.append(f"--nvme.dirs={swap}")
    daemon = None
    results = {}
    try:
        daemon, address = start_daemon(args.offloadd, os.path.join(root, "d"), flags)
        placement = host_percent if host_percent < 100 else "host"
        for mode in modes:
            print(f"offloadd, {mode}:", flush=True)
            results[mode] = through_offloadd(args, text, device, dtype, address, placement, mode)
    finally:
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(swap, ignore_errors=True)
    print(f"bound: compute {1e3 * t_compute:.0f} ms, link {1e3 * link:.0f} ms, T_opt (the "
          "daemon's update, median of the run's own steps) " +
          ", ".join(f"{m} {1e3 * r['t_opt']:.0f} ms" for m, r in results.items()))
    # The update's own time against what its memory traffic costs at this
    # host's bandwidth (per parameter: fp32 master, moments and gradient
    # read; master and moments written, and the working copy): a slow
    # update would otherwise pass unseen inside its own bound.
    bw = host_stream(256 << 20)
    t_mem = (28 + esize) * n / bw
    for m, r in results.items():
        if r["t_opt"]:
            print(f"T_opt {m}: {r['t_opt'] / t_mem:.2f}x the update's memory traffic "
                  f"({1e3 * t_mem:.0f} ms: {28 + esize} B a parameter at the host's triad, "
                  f"{bw / 1e9:.1f} GB/s measured here)")
    # The update's time in the bound is the synchronous run's, where it has
    # the host to itself: an overlapped update slowed by the forward and
    # backward beside it (their copies take the memory bandwidth it needs)
    # would otherwise raise its own bound by as much. Without a synchronous
    # run, each mode's own (said so).
    sync_t_opt = results["sync"]["t_opt"] if "sync" in results else 0.0
    if not sync_t_opt:
        print("(no synchronous run: each mode's bound takes its own update time, which the "
              "overlap may have slowed)")
    for mode, r in results.items():
        t_opt = sync_t_opt or r["t_opt"]
        bound = max(t_compute, link) + t_opt if mode == "sync" else max(t_compute, link, t_opt)
        ratio = r["wall"] / bound if bound else float("inf")
        g = r["gpu"] or {}
        print(f"offloadd, {mode:8} {1e3 * r['wall']:.0f} ms/step (median of {len(r['walls'])}; "
              f"{min(r['walls']) * 1e3:.0f}-{max(r['walls']) * 1e3:.0f}) = {ratio:.2f}x its bound "
              f"{1e3 * bound:.0f} ms (target <= 1.3x: {'MET' if ratio <= 1.3 else 'NOT MET'}); "
              f"{args.batch * args.context / r['wall']:.0f} tokens/s; wrap {r['wrap_s']:.1f} s; "
              f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}; GPU tier peak "
              f"{g.get('peak_resident_bytes', 0) / GIB:.1f} GiB")
    if cuda:
        print(f"GPU memory peak (torch, whole run): {torch.cuda.max_memory_allocated(device) / GIB:.1f} GiB")
    print("larger than the GPU: " + ("YES (torch AdamW ran out of memory)" if err else "NO"))


if __name__ == "__main__":
    main()
