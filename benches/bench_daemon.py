"""Starting an offloadd for the Python benchmarks (torch_tokens, ranks_per_node)."""
import os
import subprocess
import sys
import time

import offloadd


def start_daemon(binary, root, extra):
    """Starts `binary` with its data directory `root` (created; short, for the socket's path)
    and the flags `extra`; returns the process and its address once it answers. Exits with
    the log's path if it does not start within 20 s."""
    os.makedirs(root)
    log = open(os.path.join(root, "log"), "w")
    proc = subprocess.Popen([binary, f"--server.data_dir={root}"] + extra, stdout=log,
                            stderr=subprocess.STDOUT)
    address = "unix:" + os.path.join(root, "offloadd.sock")
    deadline = time.monotonic() + 20
    while True:
        try:
            offloadd.Client(address)
            return proc, address
        except offloadd.UnavailableError:
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit(f"offloadd did not start; see {root}/log")
            time.sleep(0.05)
