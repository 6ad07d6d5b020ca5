"""Sessions that register many small partitions and close, again and again, against one
offloadd: its resident memory after each cycle against what it had before the first (the
baseline, measured in the same run). What a node whose jobs come and go (mixture-of-experts
models hold tens of thousands of tensors) sees of the daemon's memory over time.

usage: session_churn.py --offloadd=PATH [--partitions=8000] [--cycles=3] [--tiny]

Each cycle opens a session, registers --partitions partitions of 256 fp32 elements with
200-byte names (released 256 at a time), closes it and waits 2.5 s (its teardown, and the
arena channel's once-a-second sweep that gives the heap's free pages back). Resident memory is
VmRSS of /proc/<offloadd>/status. Growth is also given from the first cycle to the last (what
keeps growing, not what the first session's connection and threads took once).
"""
import argparse
import os
import shutil
import sys
import tempfile
import time

import offloadd
from bench_daemon import start_daemon


def resident_mb(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return 0.0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--offloadd", required=True)
    ap.add_argument("--partitions", type=int, default=8000)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args()
    if args.tiny:
        args.partitions, args.cycles = 300, 1
    root = tempfile.mkdtemp(prefix="sc.")  # short: the socket's path
    proc, address = start_daemon(os.path.abspath(args.offloadd), os.path.join(root, "d"), [])
    try:
        client = offloadd.Client(address)
        rss = [resident_mb(proc.pid)]
        for _ in range(args.cycles):
            session = client.open_session("churn")
            held = []
            for i in range(args.partitions):
                name = str(i).rjust(200, "n")
                part = session.register(name, 256, param_dtype="fp32",
                                        grad_dtype="fp32", fp32_master=False)
                held.append(part.id)
                if len(held) == 256:
                    session.release(held)
                    held = []
            session.close()
            time.sleep(2.5)
            rss.append(resident_mb(proc.pid))
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
    print(f"offloadd's resident memory over {args.cycles} cycles of a session registering "
          f"{args.partitions} small partitions and closing: "
          + " -> ".join(f"{r:.0f}" for r in rss) + " MB")
    print(f"after the last cycle: {rss[-1] / rss[0]:.2f}x the baseline before the first "
          f"({rss[-1] - rss[0]:+.0f} MB); {rss[-1] - rss[1]:+.0f} MB from the first cycle's end")


if __name__ == "__main__":
    sys.exit(main())
