#!/usr/bin/env python3
"""How long a compute-worker-like thread waits for the GIL while another thread runs Python.

The serving process has two busy threads: the asyncio event loop (gRPC, decoding, encoding:
mostly Python) and the compute worker, which releases the GIL whenever it waits (for the GPU,
for a copy) and must take it back afterwards. While the loop runs Python without pause, the
interpreter hands the GIL over only when the switch interval (``sys.setswitchinterval``) has
passed. This script times a "batch" of the worker (``--waits`` short GIL-releasing waits of
``--wait-us`` each, between small torch ops) with an idle loop and with a busy Python thread,
for several switch intervals; median of ``--batches`` batches, microseconds.

    python bench/gil_handover.py                     # CPU only, a few seconds
"""

from __future__ import annotations

import argparse
import sys
import threading
import time

import torch


def batch_time_us(switch_s: float, waits: int, wait_us: float, batches: int, busy: bool) -> float:
    sys.setswitchinterval(switch_s)
    stop = threading.Event()

    def python_loop() -> None:
        x = 0
        while not stop.is_set():
            x += 1  # pure Python: keeps the GIL until the interpreter forces a switch

    other = threading.Thread(target=python_loop) if busy else None
    if other is not None:
        other.start()
    a = torch.zeros(4096)
    times = []
    try:
        for _ in range(batches):
            start = time.perf_counter()
            for _ in range(waits):
                a.add_(1)  # a launch's worth of Python and dispatch
                time.sleep(wait_us / 1e6)  # a wait that releases the GIL, like synchronizing with the GPU
            times.append(time.perf_counter() - start)
    finally:
        stop.set()
        if other is not None:
            other.join()
    times.sort()
    return times[len(times) // 2] * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--waits", type=int, default=4, help="GIL-releasing waits per batch (default 4)")
    p.add_argument("--wait-us", type=float, default=50.0, help="length of each wait (default 50 us)")
    p.add_argument("--batches", type=int, default=30)
    p.add_argument("--switch-us", default="5000,2000,500,200", help="switch intervals to try, microseconds")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    default = sys.getswitchinterval()
    try:
        idle = batch_time_us(default, args.waits, args.wait_us, args.batches, busy=False)
        print("| switch interval us | batch us, idle loop | batch us, busy Python thread |")
        print("|---|---|---|")
        for sw in (float(v) for v in args.switch_us.split(",")):
            busy = batch_time_us(sw / 1e6, args.waits, args.wait_us, args.batches, busy=True)
            print(f"| {sw:.0f} | {idle:.0f} | {busy:.0f} |")
    finally:
        sys.setswitchinterval(default)
    return 0


if __name__ == "__main__":
    sys.exit(main())
