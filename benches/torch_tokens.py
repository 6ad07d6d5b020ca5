"""Tokens/s of the Python demo's transformer trained through offloadd.torch,
with the optimizer state on the host and on NVMe, against the same model
trained in-process with torch.optim.AdamW in the same run; and where each
offloadd step's time goes (fetch + all-gather, compute, gradient return,
optimizer step).

usage: torch_tokens.py --offloadd=PATH [--steps=N] [--warmup=N] [--rounds=R]
       [--dim=D] [--layers=L] [--batch=B] [--context=T] [--swap_dir=DIR]
       [--device=cpu|cuda] [--tiny] [--profile] [--trace] [--modes=LIST]
       [--daemon_args="FLAGS"]
--profile: only the delayed-update run with the state on the host, under
cProfile: where the trainer's thread spends its time (top functions by own
time), for work on the Python side.
--trace: the delayed-update and synchronous runs under torch.profiler: the
GPU's busy time per step, in which phase of the loop (batch, forward,
backward, step, zero_grad) it sits idle, and inside which of offloadd's
calls (the tier's and the session's, each marked for the profiler).
With --device=cuda the model computes on the GPU in every run: the reference
keeps its AdamW state on the GPU too, offloadd keeps it in the daemon (the
trade ZeRO-Offload makes: GPU memory for host time).
The three runs alternate for R rounds (the machine's noise hits all alike);
each figure is the median over the rounds.
Starts its own daemons: one with the default pool (state on host), one
whose pool is smaller than the model's optimizer state, with an NVMe tier
in --swap_dir (ext4 for O_DIRECT; default /var/tmp)."""
import argparse
import contextlib
import json
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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pinned_bandwidth(device, nbytes=256 << 20):
    """Host-to-device and back through cudaMallocHost memory (torch's
    pinned tensors): the link's bound, bytes/s, measured in this run."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = []
    for src, dst in ((host, dev), (dev, host)):
        dst.copy_(src, non_blocking=True)
        sync(device)
        start = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        sync(device)
        out.append(5 * nbytes / (time.perf_counter() - start))
    return out


def tier_config(args, gpu_tier):
    """zero_config's "gpu": the tier where the model computes on a GPU, or
    (--tier=emulated) on the host-emulated device, the same code on the CPU
    (for profiling the trainer's thread without a GPU)."""
    if not gpu_tier:
        return {"tier": False}
    return {"device": "emulated"} if args.tier == "emulated" else {"tier": "auto"}


def run(args, text, address, placement, overlap=False, dpu=False, gpu_tier=True,
        compute_only=False, profiler=None):
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = gpt.GPT(text.vocab, args.context, dim=args.dim, layers=args.layers,
                    heads=4).to(device)
    engine = None
    if address is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    else:
        model, opt = offloadd.torch.wrap(model, {"lr": 1e-3, "weight_decay": 0.1},
                                         {"address": address, "session_name": "bench",
                                          "placement": {"optimizer_state": placement},
                                          "overlap_step": overlap, "delayed_update": dpu,
                                          "gpu": tier_config(args, gpu_tier)})
        engine = model.offloadd
    t_opt = []
    gen = torch.Generator().manual_seed(1)
    before = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            sync(device)
            before = dict(engine.timings) if engine else None
            tier_before = engine.gpu_stats() if engine else None
            start = time.perf_counter()
        if profiler is not None and step == args.warmup:
            profiler.start()
        with _phase(profiler, "batch"):
            x, y = (t.to(device) for t in text.batch(args.batch, args.context, gen))
        with _phase(profiler, "forward"):
            loss = model(x, y)
        with _phase(profiler, "backward"):
            loss.backward()
        if not compute_only:
            with _phase(profiler, "step"):
                opt.step()
            if engine and opt.last_step and step >= args.warmup:
                t_opt.append(opt.last_step["compute_us"] / 1e6)
        with _phase(profiler, "zero_grad"):
            opt.zero_grad()
    if engine and not compute_only:
        opt.wait_overlapped()  # the last step's update, still running, is in the time too
    sync(device)
    wall = time.perf_counter() - start
    if profiler is not None:
        profiler.stop()
    out = {"wall": wall / args.steps, "tokens_per_s": args.batch * args.context * args.steps / wall}
    if engine:
        for k in ("fetch", "return", "step", "device_wait"):
            out[k] = (engine.timings[k] - before[k]) / args.steps
        out["compute"] = out["wall"] - out["fetch"] - out["return"] - out["step"]
        out["t_opt"] = statistics.median(t_opt) if t_opt else 0.0
        g = engine.gpu_stats()
        out["tier"] = 1.0 if g else 0.0
        if g and tier_before:
            # The tier's calls to offloadd a step, and the trainer's time in
            # them (after the warm-up: its DMA registrations are the first
            # iteration's).
            out["tier_calls"] = (g["daemon_calls"] - tier_before["daemon_calls"]) / args.steps
            out["tier_ms"] = (g["daemon_us"] - tier_before["daemon_us"]) / 1e3 / args.steps
        opt.close()
    return out


def _phase(profiler, name):
    if profiler is None:
        return contextlib.nullcontext()
    return torch.profiler.record_function("phase:" + name)


def _busy_and_idle(gpu, lo, hi):
    """`gpu`: (start, end) of GPU work. Returns its busy spans within [lo,
    hi], merged and sorted, and the idle gaps between them."""
    merged = []
    for s0, e0 in sorted(gpu):
        s0, e0 = max(s0, lo), min(e0, hi)
        if e0 <= s0:
            continue
        if merged and s0 <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e0))
        else:
            merged.append((s0, e0))
    gaps = [(a[1], b[0]) for a, b in zip([(lo, lo)] + merged, merged + [(hi, hi)]) if b[0] > a[1]]
    return merged, gaps


def _idle_by_phase(gpu, phases):
    """`gpu`: sorted (start, end) of GPU work; `phases`: sorted (start, end,
    name) of the loop's phases on the CPU. Returns the GPU's busy time
    inside the phases' span, its idle time by the phase that was running
    meanwhile, and the span."""
    lo, hi = phases[0][0], phases[-1][1]
    merged, gaps = _busy_and_idle(gpu, lo, hi)
    busy = sum(e0 - s0 for s0, e0 in merged)
    idle = {}
    for g0, g1 in gaps:
        for p0, p1, name in phases:
            o = min(p1, g1) - max(p0, g0)
            if o > 0:
                idle[name] = idle.get(name, 0.0) + o
    return busy, idle, lo, hi


def _idle_inside(gpu, calls, lo, hi):
    """`gpu` as _idle_by_phase's; `calls`: (start, end, name) of offloadd's
    calls on the trainer's thread (they nest). Returns the GPU's idle time
    within [lo, hi] inside each name's calls, and inside none of them."""
    _, gaps = _busy_and_idle(gpu, lo, hi)
    inside, covered = {}, []
    for c0, c1, name in calls:
        for g0, g1 in gaps:
            o0, o1 = max(c0, g0), min(c1, g1)
            if o1 > o0:
                inside[name] = inside.get(name, 0.0) + (o1 - o0)
                covered.append((o0, o1))
    union, end = 0.0, None  # the idle time under any call, nested ones once
    for o0, o1 in sorted(covered):
        if end is None or o0 > end:
            union += o1 - o0
            end = o1
        elif o1 > end:
            union += o1 - end
            end = o1
    return inside, sum(g1 - g0 for g0, g1 in gaps) - union


def _annotate_offloadd_calls():
    """Marks offloadd.torch's calls (the GPU tier's, the session's, and the
    tier's Python steps around them) for torch.profiler as "offloadd:NAME",
    so that the trace tells which of them the GPU waits through. Returns
    what undoes it."""
    import offloadd.torch as ot
    record = torch.profiler.record_function
    undo = []

    def timed(name, f):
        def call(*a, **k):
            with record("offloadd:" + name):
                return f(*a, **k)
        return call

    for cls in (ot._TierGuard, ot._GuardedSession):
        get = cls.__getattr__

        def getattr_(self, name, get=get):
            attr = get(self, name)
            if not callable(attr):
                return attr
            call = timed(name, attr)
            if name in self.__dict__:  # (the tier's guard keeps its calls: keep this one)
                self.__dict__[name] = call
            return call
        cls.__getattr__ = getattr_
        undo.append((cls, "__getattr__", get))
    for cls, names in ((ot._GpuTier, ("begin_iteration", "flush_gradients", "_issue")),
                       (ot.Optimizer, ("zero_grad",))):
        for n in names:
            f = getattr(cls, n)
            setattr(cls, n, timed("py." + n.lstrip("_"), f))
            undo.append((cls, n, f))

    def restore():
        for cls, n, f in undo:
            setattr(cls, n, f)
    return restore


def trace(args, text, address):
    """The delayed-update and synchronous runs (state on the host) under
    torch.profiler: how long the GPU is busy in a step, in which phase of
    the training loop its idle time falls (the trainer's thread doing
    something the GPU waits for) and inside which of offloadd's calls; then
    the CPU's top operations."""
    from torch.profiler import ProfilerActivity, profile as tprofile
    run(args, text, address, "host", dpu=True)  # warm: CUDA, the daemon's pool
    restore = _annotate_offloadd_calls()
    try:
        _trace_runs(args, text, address, tprofile, ProfilerActivity)
    finally:
        restore()


def _trace_runs(args, text, address, tprofile, ProfilerActivity):
    for name, dpu in (("delayed update", True), ("synchronous", False)):
        prof = tprofile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        r = run(args, text, address, "host", dpu=dpu, profiler=prof)
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            prof.export_chrome_trace(f.name)
            events = json.load(open(f.name))
        if isinstance(events, dict):  # (kineto's format; a list without it)
            events = events.get("traceEvents", [])
        spans = [(e["ts"], e["ts"] + e.get("dur", 0), e.get("cat"), e.get("name", ""))
                 for e in events if "ts" in e]
        gpu = sorted((a, b) for a, b, cat, _ in spans
                     if cat in ("kernel", "gpu_memcpy", "gpu_memset"))
        # (The CPU's annotations: "user_annotation", or no category on some
        # torch versions; the GPU's copies of them are "gpu_user_annotation".)
        mine = [(a, b, n) for a, b, cat, n in spans if cat in ("user_annotation", None)]
        phases = sorted((a, b, n[6:]) for a, b, n in mine if n.startswith("phase:"))
        if not gpu or not phases:
            print(f"{name}: the profiler recorded no GPU activity or no phases")
            continue
        busy, idle, lo, hi = _idle_by_phase(gpu, phases)
        n = args.steps
        print(f"{name}: {1e3 * r['wall']:.1f} ms/step with the profiler; GPU busy "
              f"{busy / n / 1e3:.1f} ms/step, idle {(hi - lo - busy) / n / 1e3:.1f} ms/step, of it "
              + ", ".join(f"{k} {v / n / 1e3:.2f}" for k, v in
                          sorted(idle.items(), key=lambda kv: -kv[1])))
        calls = [(a, b, n[9:]) for a, b, n in mine if n.startswith("offloadd:")]
        inside, outside = _idle_inside(gpu, calls, lo, hi)
        print(f"  the GPU idle inside offloadd's calls, ms/step (nested: py.* hold the "
              f"others): " + ", ".join(f"{k} {v / n / 1e3:.2f}" for k, v in
                                       sorted(inside.items(), key=lambda kv: -kv[1]))
              + f"; inside none {outside / n / 1e3:.2f}")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def profile(args, text, address):
    """The delayed-update run under cProfile; prints the top of the trainer
    thread's own time."""
    import cProfile
    import pstats
    run(args, text, address, "host", dpu=True)  # warm: CUDA, the daemon's pool
    prof = cProfile.Profile()
    prof.enable()
    r = run(args, text, address, "host", dpu=True)
    prof.disable()
    print(f"profiled: {1e3 * r['wall']:.1f} ms/step (with the profiler's overhead), "
          f"{args.warmup + args.steps} steps")
    stats = pstats.Stats(prof, stream=sys.stdout)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(45)  # which of the loop's calls the time is under


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--offloadd", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 = one per CPU")
    p.add_argument("--swap_dir", default="/var/tmp")
    p.add_argument("--device", default="cpu", help="where the model computes: cpu or cuda")
    p.add_argument("--tiny", action="store_true", help="a few steps of a tiny model")
    p.add_argument("--modes", default="all",
                   help="comma-separated runs: torch,host,dpu,overlap,nvme,nvme_overlap,"
                        "no_tier (torch and host are always run: the ratios need them)")
    p.add_argument("--trace", action="store_true",
                   help="the GPU's busy and idle time per step under torch.profiler, by phase")
    p.add_argument("--tier", default="auto", choices=("auto", "emulated"),
                   help="the GPU tier as on a GPU (auto), or on the host-emulated device "
                        "(its copies without the tests' random delays: the trainer's thread's "
                        "own costs)")
    p.add_argument("--daemon_args", default="",
                   help="more flags for both daemons, space-separated "
                        "(--optimizer.threads=14, say)")
    p.add_argument("--profile", action="store_true",
                   help="profile the trainer's thread in the delayed-update run")
    args = p.parse_args()
    if args.tier == "emulated":
        # Copies complete without the random delays the tests use (to race
        # streams): what is left on the trainer's thread is offloadd's own.
        open_device = offloadd.open_device
        offloadd.open_device = lambda spec, *a, **kw: open_device(
            spec, *a, **dict(kw, max_copy_delay_us=0) if spec == "emulated" else kw)
    if args.tiny:
        args.steps, args.warmup, args.dim, args.layers, args.batch, args.context = 2, 1, 16, 1, 2, 8
        args.rounds = 1
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    text = gpt.Text("/usr/share/common-licenses/GPL-3")
    n = sum(q.numel() for q in gpt.GPT(text.vocab, args.context, dim=args.dim,
                                       layers=args.layers).parameters())
    state_bytes = 12 * n  # fp32 master + two moments
    # Sockets under a short path (a Unix socket's path has at most 107
    # bytes); swap space where asked.
    root = tempfile.mkdtemp(prefix="torch_tokens.", dir="/tmp")
    swap = tempfile.mkdtemp(prefix="torch_tokens.", dir=args.swap_dir)
    daemons = []
    try:
        extra = args.daemon_args.split()
        host = start_daemon(args.offloadd, os.path.join(root, "host"), extra)
        # The pool holds the working parameters and gradients (8 bytes per
        # parameter) and a third of the optimizer state: the rest must swap.
        pool = max(4 << 20, 8 * n + state_bytes // 3)
        nvme = start_daemon(args.offloadd, os.path.join(root, "nvme"),
                            [f"--nvme.dirs={swap}",
                             f"--memory.host_budget_bytes={pool}"] + extra)
        daemons = [host[0], nvme[0]]
        if args.profile:
            profile(args, text, host[1])
            return
        if args.trace:
            trace(args, text, host[1])
            return
        print(f"model: {n / 1e6:.2f}M parameters ({args.layers} layers, dim {args.dim}), "
              f"{args.batch}x{args.context} tokens per step, {args.steps} steps after "
              f"{args.warmup} warm-up on {args.device}, torch threads {torch.get_num_threads()}; "
              f"the NVMe daemon's pool "
              f"is {pool / (1 << 20):.1f} MiB: the working parameters and gradients "
              f"({8 * n / (1 << 20):.1f} MiB) and a third of the {state_bytes / (1 << 20):.1f} MiB "
              "of optimizer state")
        cuda = torch.device(args.device).type == "cuda"
        # name: (mode, address, placement, overlapped step, delayed update, GPU tier)
        every = [("torch AdamW (in-process)", "torch", None, None, False, False, True),
                 ("offloadd, state on host", "host", host[1], "host", False, False, True),
                 ("  the same, delayed update", "dpu", host[1], "host", False, True, True),
                 ("  the same, overlapped step", "overlap", host[1], "host", True, False, True),
                 ("offloadd, state on NVMe", "nvme", nvme[1], "nvme", False, False, True),
                 ("  the same, overlapped step ", "nvme_overlap", nvme[1], "nvme", True, False,
                  True)]
        if cuda:
            every.append(("host, no GPU tier (before)", "no_tier", host[1], "host", False, False,
                          False))
        modes = {m for _, m, *_ in every} if args.modes == "all" else \
            set(args.modes.split(",")) | {"torch", "host"}
        unknown = modes - {m for _, m, *_ in every}
        if unknown:
            p.error(f"--modes: no run named {', '.join(sorted(unknown))}")
        runs = {name: rest for name, m, *rest in every if m in modes}
        rounds = {name: [] for name in runs}
        compute = []
        c0 = offloadd.Client(nvme[1]).stats()["counters"]
        for _ in range(args.rounds):
            for name, (address, placement, overlap, dpu, tier) in runs.items():
                rounds[name].append(run(args, text, address, placement, overlap, dpu, tier))
            # GPU compute alone: forward and backward of the resident model.
            compute.append(run(args, text, None, None, compute_only=True)["wall"])
        c1 = offloadd.Client(nvme[1]).stats()["counters"]
        results = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                   for name, rs in rounds.items()}
    finally:
        for d in daemons:
            d.kill()
            d.wait()
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(swap, ignore_errors=True)
    ref = results["torch AdamW (in-process)"]["tokens_per_s"]
    # (wait: the part of return the trainer's thread waits for the GPU to
    # finish backward, with the GPU tier.)
    print(f"{'':28} {'tokens/s':>9} {'vs torch':>8} {'ms/step':>8} {'fetch':>7} {'compute':>8} "
          f"{'return':>7} {'step':>6} {'wait':>6}")
    for name, r in results.items():
        line = f"{name:28} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / ref:8.3f} " \
               f"{1e3 * r['wall']:8.1f}"
        if "fetch" in r:
            line += "".join(f" {1e3 * r[k]:{w}.1f}" for k, w in
                            (("fetch", 7), ("compute", 8), ("return", 7), ("step", 6),
                             ("device_wait", 6)))
        print(line)
    for name, r in results.items():
        if "tier_calls" in r:
            print(f"{name.strip():28} the GPU tier's calls to offloadd: {r['tier_calls']:.1f} a "
                  f"step, {r['tier_ms']:.2f} ms")
    swapped = (c1["swap_in_bytes"] - c0["swap_in_bytes"]) / (1 << 20)
    nvme_runs = args.rounds * len({"nvme", "nvme_overlap"} & modes)
    if nvme_runs:
        print(f"NVMe runs: {swapped / nvme_runs:.0f} MiB swapped in per run of "
              f"{args.warmup + args.steps} steps")
    # The bound of an offloadd step: the model's compute on the device, the
    # bytes each step moves over the link (working parameters there, fp32
    # gradients back) at the pinned bandwidth measured here, and the
    # optimizer's update (T_opt, measured by the daemon in the synchronous
    # run), which the delayed update and the overlapped step hide.
    t_compute = statistics.median(compute)
    t_opt = results["offloadd, state on host"]["t_opt"]
    link = 0.0
    if torch.device(args.device).type == "cuda":
        h2d, d2h = pinned_bandwidth(torch.device(args.device))
        link = 4 * n / h2d + 4 * n / d2h
        print(f"pinned memory: {h2d / 1e9:.1f} GB/s to the GPU, {d2h / 1e9:.1f} GB/s back")
    overlapped = max(t_compute, link, t_opt)
    bounds = {"offloadd, state on host": max(t_compute, link) + t_opt,
              "  the same, delayed update": overlapped,
              "  the same, overlapped step": overlapped}
    print(f"bound: compute {1e3 * t_compute:.1f} ms, link {1e3 * link:.1f} ms, "
          f"T_opt {1e3 * t_opt:.1f} ms")
    # T_opt is offloadd's own update time: against what its memory traffic
    # costs at this host's bandwidth (32 bytes a parameter: fp32 master,
    # moments and gradient read, master, moments and working copy written),
    # so that a slow update does not pass unseen inside the bound.
    bw = host_stream(16 << 20 if args.tiny else 256 << 20)
    t_mem = 32 * n / bw
    if t_opt:
        print(f"T_opt {1e3 * t_opt:.1f} ms = {t_opt / t_mem:.2f}x the update's memory traffic "
              f"({1e3 * t_mem:.1f} ms: 32 B a parameter at the host's triad, "
              f"{bw / 1e9:.1f} GB/s measured here)")
    for name, bound in bounds.items():
        if name not in results:
            continue
        r = results[name]
        vs = r["tokens_per_s"] / ref
        target = 0.6 if name == "offloadd, state on host" else 0.8
        print(f"{name.strip():28} {1e3 * r['wall']:.1f} ms/step = {r['wall'] / bound:.2f}x its "
              f"bound {1e3 * bound:.1f} ms (target <= 1.15x: "
              f"{'MET' if r['wall'] / bound <= 1.15 else 'NOT MET'}); {vs:.3f}x torch "
              f"(target >= {target}x: {'MET' if vs >= target else 'NOT MET'})"
              f"{'' if r.get('tier') else ' [no GPU tier]'}")


if __name__ == "__main__":
    main()
