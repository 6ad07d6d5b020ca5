"""N trainer ranks of one node stepping their optimizers at the same moment, as ZeRO-Offload's
ranks do after every backward pass: offloadd's one pool of optimizer threads serving every
rank's session, against DeepSpeed's CPU Adam running in every rank with a thread pool of its
own (the peer: ../shared/peers/deepspeed_cpu_adam, unmodified, its op built by its own
harness), and against the machine's memory bandwidth measured in the same run.

usage: ranks_per_node.py --offloadd=PATH [--ranks=4] [--params=25000000] [--steps=8]
       [--rounds=3] [--dtype=bf16|fp32] [--peer=DIR|none] [--tiny]

Each configuration runs --ranks processes started together; every step begins at a barrier,
and a step's time is from the first rank's start to the last rank's end (the ranks' next
collective waits for the slowest). Every step also ends at a barrier: ZeRO-3's next forward
begins with an all-gather, so no rank's next iteration runs beside another rank's step (without
it, offloadd's ranks that finished first handed over their next gradients beside the others'
steps: 78-86 ms a step against 71-74 ms with it, same sitting). Per configuration: the median
over the steps after the first of each run. Each round runs offloadd next to every other
configuration (offloadd first in even rounds; in odd ones the configurations in reversed order,
each followed by offloadd), and "vs offloadd" is the median over the rounds of the
configuration's median step over that of the run of offloadd beside it (each round's ratio
printed below the table).
  offloadd              one daemon; each rank a session holding one partition of --params
                        parameters, a --dtype working copy and gradients (bf16 by default, as
                        ZeRO-Offload trains: fp32 master weights and moments in the daemon),
                        its gradients handed over (ReturnGradients with hand_over), their
                        norm taken (GetPendingGradients, before the step's opening barrier: the ranks'
                        all-reduce for clipping comes between it and Step), then Step;
                        the daemon's optimizer threads (one per core) serve every rank's step
  DeepSpeed, T threads  each rank runs DeepSpeed's adam_update over its own --params fp32
                        parameters with OpenMP threads of its own: T = the cores (what every
                        rank gets by default: torch and OpenMP size their pools to the
                        machine), and T = cores / ranks (shared out by hand, at least one)
  DeepSpeed ZeRO-3 step the same, then the copy of the updated fp32 parameters into the
                        rank's --dtype ones that DeepSpeed's ZeRO-3 makes after every
                        optimizer step (stage3.py, _reassign_or_swap_out_partitioned_
                        parameters: fp16_partitioned_groups_flat[i].copy_(
                        fp32_partitioned_groups_flat[i]), on the CPU where the parameters are
                        offloaded; with fp32 parameters too, whose fp32 partition the
                        offloaded optimizer makes as a clone), with torch's threads (T): the
                        work offloadd's step does, which writes the working copy itself (in
                        the same pass: bf16 30 B against 36, fp32 36 against 40; the same job,
                        not the same bytes). Still less than DeepSpeed's ZeRO-3 step on the
                        CPU: its unscale and clip pass over the fp32 gradients is left out.
Bound: ranks x params x bytes per parameter / triad bandwidth, counted as benches/cpu_adam
counts them (a write to memory not read first costs its allocate read too): offloadd with bf16
30 B (reads fp32 master weights and moments, 12, and bf16 gradients, 2; writes master weights
and moments, 12, and the bf16 working copy the trainers fetch, 2 + 2), with fp32 36 B (16 read,
12 + 4 + 4 written); where the daemon's kernel is AVX-512 it writes the copy around the cache,
without the allocate read: 28 B and 32 B; DeepSpeed 28 B (reads params, gradients and moments, writes params and
moments in place: fp32 throughout, no separate working copy, which is the peer's only case
with fp32 master weights, so the two sides do not do the same work); the ZeRO-3 step 36 B
with bf16 (adam_update's 28, and the copy: 4 read, 2 + 2 written), 40 B with fp32 (4 read,
4 + 4 written). The triad (a = b + s * c
on floats, torch, one thread per core) counts 16 bytes per element, as benches/cpu_adam does.
Rate = ranks x params / step time, in Gparam/s.
"""
import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

import offloadd
from bench_daemon import start_daemon

LR, BETA1, BETA2, EPS = 1e-3, 0.9, 0.999, 1e-8


def triad_gbs(n, reps=5):
    torch.set_num_threads(os.cpu_count())
    a, b, c = torch.zeros(n), torch.ones(n), torch.full((n,), 2.0)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.add(b, c, alpha=3.0, out=a)
        best = min(best, time.perf_counter() - t0)
    if a[n // 2].item() != 7.0:
        sys.exit("triad result wrong")
    return 16.0 * n / best / 1e9


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@contextlib.contextmanager
def barrier_aborted_on_error(barrier):
    """A rank that fails breaks the barrier, so that the others fail too instead of waiting."""
    try:
        yield
    except BaseException:
        barrier.abort()
        raise


def offloadd_rank(rank, address, n, dtype, steps, barrier, out):
    with barrier_aborted_on_error(barrier):
        offloadd_rank_steps(rank, address, n, dtype, steps, barrier, out)


def offloadd_rank_steps(rank, address, n, dtype, steps, barrier, out):
    client = offloadd.Client(address)
    session = client.open_session(f"rank{rank}")
    part = session.register("w", n, param_dtype=dtype, grad_dtype=dtype)
    torch.frombuffer(part.params, dtype=DTYPES[dtype]).fill_(0.5)
    session.release([part.id])
    times = []
    for _ in range(steps):
        view, = session.fetch([part.id], grads=True)
        torch.frombuffer(view.grads, dtype=DTYPES[dtype]).fill_(0.01)
        session.return_gradients([view], release=True, hand_over=True)
        # The step protocol: the gradients' norm and overflow first (what the
        # ranks all-reduce to decide clipping or skipping), then Step.
        session.pending_gradients()
        barrier.wait()
        t0 = time.monotonic()
        session.step(lr=LR, beta1=BETA1, beta2=BETA2, eps=EPS, weight_decay=0.0)
        times.append((t0, time.monotonic()))
        # ZeRO-3's next forward starts with an all-gather of the parameters, which
        # waits for every rank's step: no rank's next iteration (its gradients,
        # their norm) runs beside another rank's step. The barrier after the last
        # step also keeps the sessions' closes (which free their state) out of it.
        barrier.wait()
    session.close()
    out.put((rank, times))


def deepspeed_rank(rank, peer, n, threads, copy_to, steps, barrier, out):
    with barrier_aborted_on_error(barrier):
        deepspeed_rank_steps(rank, peer, n, threads, copy_to, steps, barrier, out)


def deepspeed_rank_steps(rank, peer, n, threads, copy_to, steps, barrier, out):
    sys.path.insert(0, peer)
    import bench as peer_bench  # the peer's own harness: its build() loads the cached op
    ds = peer_bench.build()
    torch.set_num_threads(threads)  # the op's `omp parallel for` uses this thread's pool size
    p, g = torch.full((n,), 0.5), torch.full((n,), 0.01)
    m, v = torch.zeros(n), torch.zeros(n)
    # ZeRO-3's copy of the partition in the working dtype (written every step, as DeepSpeed
    # does, bf16 or fp32).
    lp = torch.zeros(n, dtype=DTYPES[copy_to]) if copy_to else None
    ds.create_adam(0, LR, BETA1, BETA2, EPS, 0.0, True, False)
    times = []
    for s in range(1, steps + 1):
        barrier.wait()
        t0 = time.monotonic()
        ds.adam_update(0, s, LR, BETA1, BETA2, EPS, 0.0, True, p, g, m, v)
        if lp is not None:
            lp.copy_(p)
        times.append((t0, time.monotonic()))
        barrier.wait()  # as offloadd's ranks: the next forward's all-gather
    ds.destroy_adam(0)
    out.put((rank, times))


def run_ranks(target, args_of, ranks, steps):
    """Runs `ranks` processes of `target`; returns each step's time, first start to last end."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(ranks), ctx.Queue()
    procs = [ctx.Process(target=target, args=(r,) + args_of(r) + (steps, barrier, out))
             for r in range(ranks)]
    for p in procs:
        p.start()
    results = {}
    try:
        deadline = time.monotonic() + 600
        while len(results) < ranks:
            try:
                rank, times = out.get(timeout=1)
                results[rank] = times
            except queue.Empty:
                failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if failed:
                    sys.exit(f"a rank of {target.__name__} exited with {failed[0]}")
                if time.monotonic() > deadline:
                    sys.exit(f"the ranks of {target.__name__} gave no result in 600 s")
    except BaseException:
        for p in procs:
            p.terminate()  # none left waiting at a barrier for one that died
        raise
    for p in procs:
        p.join()
        if p.exitcode != 0:
            sys.exit(f"a rank of {target.__name__} exited with {p.exitcode}")
    return [max(results[r][s][1] for r in results) - min(results[r][s][0] for r in results)
            for s in range(steps)]


def peer_ready(peer):
    if peer == "none":
        return None, "skipped: --peer=none"
    if not os.path.isfile(os.path.join(peer, "bench.py")):
        return None, f"skipped: no {peer}/bench.py (pass --peer=DIR, or --peer=none)"
    missing = [pkg for pkg in ("libtorch-dev", "ninja-build")
               if subprocess.run(["dpkg", "-s", pkg], capture_output=True).returncode != 0]
    if missing:
        return None, f"skipped: missing Debian packages {', '.join(missing)}"
    print(f"peer DeepSpeed cpu_adam: {peer} (building its extension unless cached: a minute)",
          flush=True)
    built = subprocess.run(["/usr/bin/python3", os.path.join(peer, "bench.py"), "--build-only"])
    if built.returncode != 0:
        sys.exit("the peer's extension did not build")
    return peer, None


def main():
    here = os.path.dirname(os.path.realpath(__file__))  # the source tree, not runfiles
    ap = argparse.ArgumentParser()
    ap.add_argument("--offloadd", required=True)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--params", type=int, default=25_000_000)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--peer", default=os.path.join(here, "..", "..", "shared", "peers",
                                                   "deepspeed_cpu_adam"))
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    if a.tiny:
        a.ranks, a.params, a.steps, a.rounds = 2, 100_000, 3, 1
    if a.ranks < 1 or a.params < 1 or a.steps < 2 or a.rounds < 1:
        sys.exit("--ranks, --params and --rounds must be positive, --steps at least 2")
    cores = os.cpu_count()
    peer, why = peer_ready(os.path.abspath(a.peer) if a.peer != "none" else "none")
    if why:
        print(f"peer DeepSpeed cpu_adam: {why}")
    triad = triad_gbs(max(a.params, 4_000_000) if not a.tiny else 1_000_000)
    print(f"== ranks_per_node: {a.ranks} ranks x {a.params} parameters (offloadd: {a.dtype} "
          f"working copy and gradients), {cores} cores, "
          f"triad {triad:.1f} GB/s; {a.steps} steps per round (the first not counted), "
          f"{a.rounds} rounds", flush=True)

    configs = [("offloadd, one pool", 30 if a.dtype == "bf16" else 36, None, None)]
    if peer:
        share = max(1, cores // a.ranks)
        for t in (cores, share) if share != cores else (cores,):
            per = f"{t} thread{'s' if t > 1 else ''}/rank"
            configs.append((f"DeepSpeed, {per}", 28, t, None))
            configs.append((f"DeepSpeed ZeRO-3, {per}", 36 if a.dtype == "bf16" else 40, t,
                            a.dtype))
    steps = {name: [] for name, _, _, _ in configs}
    ratios = {name: [] for name, _, _, _ in configs}  # over offloadd's run beside it
    root = tempfile.mkdtemp(prefix="ranks_per_node.", dir="/tmp")  # short socket paths
    # Room for every rank's state in the pool: master, moments, accumulator (16 B),
    # working copy and gradients (at most 8 B), with slack.
    pool = a.ranks * a.params * 28 + (256 << 20)
    daemon, address = start_daemon(a.offloadd, os.path.join(root, "d"),
                                   [f"--memory.host_budget_bytes={pool}"])
    try:
        # The daemon's kernel decides offloadd's bytes: AVX-512 writes the
        # working copy around the cache (benches/cpu_adam counts the same).
        kernel = offloadd.Client(address).stats()["optimizer"]
        streams = kernel.startswith("avx512")
        configs[0] = (configs[0][0], (28 if a.dtype == "bf16" else 32) if streams
                      else configs[0][1], None, None)
        print(f"offloadd's optimizer: {kernel}", flush=True)
        def run(r, config):
            name, _, threads, copy_to = config
            if threads is None:
                got = run_ranks(offloadd_rank, lambda k: (address, a.params, a.dtype),
                                a.ranks, a.steps)
            else:
                got = run_ranks(deepspeed_rank,
                                lambda k, t=threads, c=copy_to: (peer, a.params, t, c),
                                a.ranks, a.steps)
            steps[name] += got[1:]
            print(f"round {r + 1}, {name}: " + ", ".join(f"{t * 1e3:.1f}" for t in got)
                  + " ms", flush=True)
            return statistics.median(got[1:])

        for r in range(a.rounds):
            # offloadd runs next to every configuration, before it in even
            # rounds and after it in odd ones (the configurations then in
            # reversed order), and each is compared with that run of offloadd.
            others = configs[1:] if r % 2 == 0 else configs[:0:-1]
            if not others:
                run(r, configs[0])
            for config in others:
                pair = (configs[0], config) if r % 2 == 0 else (config, configs[0])
                medians = {c[0]: run(r, c) for c in pair}
                ratios[config[0]].append(medians[config[0]] / medians[configs[0][0]])
    finally:
        daemon.terminate()
        daemon.wait()
        shutil.rmtree(root, ignore_errors=True)

    print(f"\n{'configuration':<36}{'step ms':>9}{'worst ms':>10}{'Gparam/s':>10}{'B/param':>9}"
          f"{'bound ms':>10}{'of bound':>10}{'vs offloadd':>13}")
    # "vs offloadd": the median of the configuration's ratios to the run of
    # offloadd beside it (seconds apart: the same phase of a machine whose
    # speed moves over minutes).
    for name, bytes_per, _, _ in configs:
        med, worst = statistics.median(steps[name]), max(steps[name])
        bound = a.ranks * a.params * bytes_per / (triad * 1e9)
        vs = statistics.median(ratios[name]) if ratios[name] else 1.0
        print(f"{name:<36}{med * 1e3:>9.1f}{worst * 1e3:>10.1f}"
              f"{a.ranks * a.params / med / 1e9:>10.3f}{bytes_per:>9}{bound * 1e3:>10.1f}"
              f"{bound / med:>9.0%} {vs:>12.2f}x")
    for name, _, _, _ in configs[1:]:
        print(f"  vs offloadd by round, {name}: " + " ".join(f"{r:.2f}" for r in ratios[name]))
    print("step = median over counted steps, first rank's start to last rank's end; "
          "vs offloadd = the median over the rounds of its median step over that of the run of "
          "offloadd beside it (above 1: offloadd faster); "
          f"DeepSpeed ZeRO-3 = adam_update and the copy into the {a.dtype} parameters ZeRO-3 "
          "makes after it: the job offloadd's step does (not the same bytes: "
          f"{36 if a.dtype == 'bf16' else 40} B against {configs[0][1]})")


if __name__ == "__main__":
    main()
