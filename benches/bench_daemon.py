"""Starting an offloadd for the Python benchmarks (torch_tokens, ranks_per_node)."""
import os
import subprocess
import sys
import time

import offloadd


def start_daemon(binary, root, extra, restart=False, timeout=20.0, poll=0.05):
    """Starts `binary` with its data directory `root` (created, or with `restart` the existing
    one of a stopped offloadd; short, for the socket's path) and the flags `extra`; returns the
    process and its address once it answers (asked every `poll` seconds). Exits with the log's
    path if it does not start within `timeout` seconds; then, or if anything interrupts the
    wait (a signal the caller turned into an exception), the process is killed first: none is
    left running unseen."""
    os.makedirs(root, exist_ok=restart)
    log = open(os.path.join(root, "log"), "w")
    proc = subprocess.Popen([binary, f"--server.data_dir={root}"] + extra, stdout=log,
                            stderr=subprocess.STDOUT)
    address = "unix:" + os.path.join(root, "offloadd.sock")
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                offloadd.Client(address)
                return proc, address
            except offloadd.UnavailableError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"offloadd did not start; see {root}/log")
                time.sleep(poll)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def host_stream(nbytes):
    """Host memory bandwidth in bytes/s: a triad (c = a + 1.5 b) over three
    fp32 arrays of `nbytes` on torch's threads, best of 5: reads of a and b,
    the write of c and the read its ordinary stores make of each line first
    (16 B an element, as benches/cpu_adam and ranks_per_node count it)."""
    import torch  # (here: the other users of this module need no torch)
    n = nbytes // 4
    a, b, c = torch.ones(n), torch.ones(n), torch.empty(n)
    torch.add(a, b, alpha=1.5, out=c)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        torch.add(a, b, alpha=1.5, out=c)
        best = min(best, time.perf_counter() - start)
    return 4 * 4 * n / best
