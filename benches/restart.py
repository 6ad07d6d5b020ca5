"""offloadd stopped with SIGTERM and started again while a trainer waits (an upgrade, a
supervisor's restart), with the reconnect lease (on by default): how long the stop takes to
keep the sessions, how long the next offloadd takes to serve them again, and how long the
trainer then takes to have its partitions back, against the disk's own direct writes and
reads of the same bytes in the same directory, measured in the same run (the limit: what a
stop that writes every session can reach).

usage: restart.py --offloadd=PATH [--params=268435456] [--partitions=16] [--dir=DIR]
       [--write_threads=4] [--rounds=2] [--pool_dir=/dev/shm/offloadd_restart_bench | --pool_dir=]
       [--tiny]

One session holds --params parameters in --partitions partitions, as ZeRO-3 mixed precision
keeps them: a bf16 working copy and bf16 gradients in the trainer's arena, fp32 master weights
and Adam moments in the pool (14 bytes a parameter kept: 2 + 4 + 4 + 4), after one step.
  stop      SIGTERM to exit: calls drained, the session checkpointed into
            <data_dir>/preserved (checkpoint.write_threads chunks at once), memory freed
  start     exec to serving: the kept session reopened (its state read back)
  resume    ResumeSession, then a fetch of every partition and its release
  step      the second step before the stop (what the pool's memory costs while training)
Each round runs twice, one after the other: with the pool in private memory (the stop writes
every session), and with the pool in a file in --pool_dir (memory.pool_dir, on tmpfs: the stop
leaves the host-resident state there and writes only the rest, here the bf16 working copy;
the next offloadd reads it from there). An empty --pool_dir runs the first only.
Limit: 16 MiB O_DIRECT writes (then fsync) and reads of the same number of bytes into a file
in the same directory, by 1 and by 8 threads at once. Ratio: bytes kept / stop time against
the best limit's GB/s; for the pool in a file, the stop against writing every kept byte at the
disk's best write (below 1: the stop takes less than writing every session). Medians over
--rounds.
"""
import argparse
import datetime
import mmap
import os
import re
import shutil
import signal
import statistics
import tempfile
import threading
import time

import offloadd
from bench_daemon import start_daemon

CHUNK = 16 << 20

# The offloadd processes started and not yet waited for: killed on the way
# out, whatever ends the bench (an error, ^C, a timeout's SIGTERM), so that
# none is left serving with gigabytes of kept state.
_live = []


def _start(*a, **kw):
    proc, address = start_daemon(*a, **kw)
    _live.append(proc)
    return proc, address


def _reap(proc):
    proc.wait()
    if proc in _live:
        _live.remove(proc)


def direct_io(path, total, threads, write):
    """Seconds to write (then fsync) or read `total` bytes of `path` with O_DIRECT, 16 MiB a
    call, `threads` calls at once."""
    flags = (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY
    fd = os.open(path, flags | os.O_DIRECT, 0o600)
    offsets = list(range(0, total, CHUNK))
    lock = threading.Lock()

    def work():
        buf = mmap.mmap(-1, CHUNK)  # page-aligned, as O_DIRECT needs
        buf.write(os.urandom(4096) * (CHUNK // 4096))
        while True:
            with lock:
                if not offsets:
                    return
                off = offsets.pop()
            if write:
                os.pwrite(fd, buf, off)
            else:
                os.preadv(fd, [buf], off)

    t = time.perf_counter()
    pool = [threading.Thread(target=work) for _ in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if write:
        os.fsync(fd)
    took = time.perf_counter() - t
    os.close(fd)
    return took


def log_time(line):
    """The timestamp of a log line (2026-11-27T04:49:32.685Z ...), in seconds."""
    stamp = line.split()[0].rstrip("Z")
    return datetime.datetime.fromisoformat(stamp).timestamp()


def one_round(args, root, pool_dir=""):
    shutil.rmtree(root, ignore_errors=True)
    flags = [f"--checkpoint.write_threads={args.write_threads}",
             f"--memory.host_budget_bytes={max(1 << 30, args.params * 24)}"]
    if pool_dir:
        flags.append(f"--memory.pool_dir={pool_dir}")
    proc, address = _start(args.offloadd, root, flags)
    client = offloadd.Client(address)
    session = client.open_session("restart_bench")
    each = args.params // args.partitions
    ids = []
    for i in range(args.partitions):
        part = session.register(f"w{i}", each, param_dtype="bf16", grad_dtype="bf16",
                                fp32_master=True)
        session.release([part.id])
        ids.append(part.id)
    views = session.fetch(ids, grads=True)
    session.return_gradients(views, release=True)
    session.step(lr=1e-3)
    # A second step, timed: what the pool's memory costs while training.
    views = session.fetch(ids, grads=True)
    session.return_gradients(views, release=True)
    t = time.perf_counter()
    session.step(lr=1e-3)
    step = time.perf_counter() - t
    sid, token = session.id, session.token

    t = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    _reap(proc)
    stop = time.perf_counter() - t
    with open(os.path.join(root, "log")) as f:
        lines = f.read().splitlines()
    kept_line = next(l for l in lines if "kept 1 session(s)" in l)
    term_line = next(l for l in lines if "received SIGTERM" in l)
    keep = log_time(kept_line) - log_time(term_line)
    written = int(re.search(r"(\d+) bytes written", kept_line).group(1))
    left = re.search(r", (\d+) left in the pool's file", kept_line)  # (with memory.pool_dir)
    in_memory = int(left.group(1)) if left else 0
    kept_bytes = written + in_memory

    os.rename(os.path.join(root, "log"), os.path.join(root, "log.first"))
    t = time.perf_counter()
    proc, address = _start(args.offloadd, root, flags, restart=True, timeout=600, poll=0.01)
    start = time.perf_counter() - t
    t = time.perf_counter()
    client = offloadd.Client(address)
    resumed = client.resume_session(sid, token)
    resumed.fetch(ids)
    resumed.release(ids)
    resume = time.perf_counter() - t
    resumed.close()
    proc.kill()
    _reap(proc)
    del session
    if pool_dir:
        # Every kept name taken (what stays: the directory's owner marker, and
        # the name the killed offloadd's taken-over file kept, which the next
        # start in this directory removes).
        left = [n for n in os.listdir(pool_dir) if n.startswith("kept-")]
        assert not left, f"the next offloadd left {left} in {pool_dir}"
        for name in os.listdir(pool_dir):
            os.unlink(os.path.join(pool_dir, name))
    return stop, keep, start, resume, kept_bytes, written, step


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--offloadd", required=True)
    ap.add_argument("--params", type=int, default=256 << 20)
    ap.add_argument("--partitions", type=int, default=16)
    ap.add_argument("--dir", default="/var/tmp/offloadd_restart_bench")
    ap.add_argument("--write_threads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--pool_dir", default="/dev/shm/offloadd_restart_bench")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.params, args.partitions, args.rounds = 1 << 20, 2, 1
        args.dir = tempfile.mkdtemp(prefix="rb.")  # short: the socket's path
        if args.pool_dir:
            args.pool_dir = tempfile.mkdtemp(prefix="rb.", dir="/dev/shm")
    args.offloadd = os.path.abspath(args.offloadd)
    os.makedirs(args.dir, mode=0o700, exist_ok=True)
    root = os.path.join(args.dir, "d")
    given_pool_dir = args.pool_dir
    if args.pool_dir:
        os.makedirs(args.pool_dir, mode=0o700, exist_ok=True)
        # (This run's own directory in it: what the finally below removes.)
        args.pool_dir = tempfile.mkdtemp(prefix="run.", dir=args.pool_dir)

    def stopped(signum, frame):
        raise SystemExit(f"restart: stopped by signal {signum}")
    signal.signal(signal.SIGTERM, stopped)
    signal.signal(signal.SIGHUP, stopped)
    try:
        measure(args, root)
    finally:
        # What this run wrote: the daemons' state (gigabytes), the probe,
        # the pool's files (memory, in /dev/shm).
        for proc in list(_live):
            proc.kill()
            _reap(proc)
        shutil.rmtree(root, ignore_errors=True)
        probe = os.path.join(args.dir, "direct.probe")
        if os.path.exists(probe):
            os.unlink(probe)
        if args.pool_dir:
            shutil.rmtree(args.pool_dir, ignore_errors=True)
            try:
                os.rmdir(given_pool_dir)  # (where nothing else is in it)
            except OSError:
                pass
        if args.tiny:
            shutil.rmtree(args.dir, ignore_errors=True)


def measure(args, root):
    results, limits, in_memory = [], [], []
    for r in range(args.rounds):
        results.append(one_round(args, root))
        if args.pool_dir:
            in_memory.append(one_round(args, root, args.pool_dir))
        kept = results[-1][4]
        probe = os.path.join(args.dir, "direct.probe")
        size = max(CHUNK, kept // CHUNK * CHUNK)
        row = {}
        for threads in (1, 8):
            # A new file each time, as the stop writes new files.
            if os.path.exists(probe):
                os.unlink(probe)
            row[("write", threads)] = size / direct_io(probe, size, threads, True) / 1e9
            row[("read", threads)] = size / direct_io(probe, size, threads, False) / 1e9
        os.unlink(probe)
        limits.append(row)
    med = lambda xs: statistics.median(xs)
    stop, keep, start, resume, kept, _, step = (med([x[i] for x in results]) for i in range(7))
    gb = kept / 1e9
    print(f"offloadd SIGTERM and restart with the reconnect lease: {args.params / 1e6:.1f}M "
          f"parameters in {args.partitions} partitions (bf16 working copy and gradients, fp32 "
          f"master and moments), {gb:.2f} GB kept, in {args.dir}; "
          f"checkpoint.write_threads {args.write_threads}; medians of {args.rounds} rounds")
    print(f"  stop (SIGTERM to exit)       {stop:7.2f} s   keeping the session {keep:.2f} s = "
          f"{gb / keep:.2f} GB/s")
    print(f"  start (exec to serving, the kept state read back within) {start:.2f} s = "
          f"{gb / start:.2f} GB/s of kept state")
    print(f"  resume (ResumeSession, fetch) {resume:6.3f} s")
    print(f"  a step (the second) before the stop {step:.3f} s")
    for kind in ("write", "read"):
        for threads in (1, 8):
            rate = med([row[(kind, threads)] for row in limits])
            print(f"  disk: O_DIRECT 16 MiB {kind}s, {threads} at once: {rate:.2f} GB/s")
    best_write = max(med([row[("write", t)] for row in limits]) for t in (1, 8))
    best_read = max(med([row[("read", t)] for row in limits]) for t in (1, 8))
    print(f"keeping: {gb / keep:.2f} GB/s = {gb / keep / best_write:.2f}x the disk's best direct "
          f"write; the stop {stop:.2f} s = {stop / (gb / best_write):.2f}x writing the bytes at "
          f"that speed")
    print(f"start: {gb / start:.2f} GB/s of kept state = {gb / start / best_read:.2f}x the disk's "
          f"best direct read")
    if not in_memory:
        return
    m_stop, m_keep, m_start, m_resume, m_kept, m_written, m_step = (
        med([x[i] for x in in_memory]) for i in range(7))
    writing_all = m_kept / 1e9 / best_write
    print(f"with the pool in a file in {args.pool_dir} (memory.pool_dir), same rounds: "
          f"{m_kept / 1e9:.2f} GB kept, {m_written / 1e9:.2f} GB of it written (the working copy), "
          f"the rest left in the pool's file")
    print(f"  stop (SIGTERM to exit)       {m_stop:7.2f} s   keeping the session {m_keep:.2f} s")
    print(f"  start (exec to serving, the kept state read back within) {m_start:.2f} s")
    print(f"  resume (ResumeSession, fetch) {m_resume:6.3f} s")
    print(f"  a step (the second) before the stop {m_step:.3f} s = {m_step / step:.2f}x the step "
          f"with the pool in private memory")
    print(f"pool in a file: the stop {m_stop:.2f} s = {m_stop / writing_all:.2f}x writing every kept "
          f"byte at the disk's best write ({writing_all:.2f} s; target below 1), "
          f"{m_stop / stop:.2f}x the stop writing the session; start {m_start / start:.2f}x "
          f"the start reading it from the disk")


if __name__ == "__main__":
    main()
