#!/usr/bin/env python3
"""What waking other processes costs a busy process, with and without a CPU of its own (Linux).

    python bench/wake_preemption.py [--readers 4] [--work-us 300] [--reader-us 20,50,120] [--rounds 1500]

The pattern of the compute process (``lutb_server.worker_process``) under load: one process computes for
``--work-us``, then wakes ``--readers`` sleeping processes, one write each (an AF_UNIX socket write, as the
compute process answers, or an ``eventfd`` write), and computes again; each woken reader burns
``--reader-us`` of CPU (a front end handling its answer) and sleeps again. Per round it reports the time
in the writes and the whole round, for each wake-up kind, with the processes placed by the kernel and with
the waker pinned to the last allowed CPU and the readers to the others (what ``--compute-cpu`` does). A
write that costs far more than the bare wake-up means the waker lost its CPU to a reader it woke, or to
anything else. Each configuration runs twice, interleaved.
"""

from __future__ import annotations

import argparse
import os
import select
import socket
import time


def burn(us: float) -> None:
    end = time.perf_counter_ns() + int(us * 1000)
    while time.perf_counter_ns() < end:
        pass


def reader(kind: str, fd: socket.socket | int, reader_us: float, cpus: set[int] | None) -> None:
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    while True:
        select.select([fd], [], [])
        if kind == "unix":
            assert isinstance(fd, socket.socket)
            if not fd.recv(4096):
                return
        else:
            assert isinstance(fd, int)
            os.read(fd, 8)
        burn(reader_us)


def one_run(kind: str, pinned: bool, args: argparse.Namespace, reader_us: float) -> tuple[float, float]:
    """(us in the writes per round, us per round)."""
    allowed = set(os.sched_getaffinity(0))
    waker_cpu = max(allowed)
    ends: list[socket.socket | int] = []
    pids = []
    for _ in range(args.readers):
        if kind == "unix":
            ours, theirs = socket.socketpair()
            ends.append(ours)
            fd: socket.socket | int = theirs
        else:
            fd = os.eventfd(0, os.EFD_NONBLOCK)
            ends.append(fd)
        pid = os.fork()
        if pid == 0:
            reader(kind, fd, reader_us, allowed - {waker_cpu} if pinned else None)
            os._exit(0)
        pids.append(pid)
    if pinned:
        os.sched_setaffinity(0, {waker_cpu})
    message = b"x" * 100
    in_writes = 0
    try:
        burn(20_000)  # the readers asleep
        start = time.perf_counter_ns()
        for _ in range(args.rounds):
            burn(args.work_us)
            t0 = time.perf_counter_ns()
            for end in ends:
                if isinstance(end, socket.socket):
                    end.send(message)
                else:
                    os.eventfd_write(end, 1)
            in_writes += time.perf_counter_ns() - t0
        total = time.perf_counter_ns() - start
    finally:
        for pid in pids:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        os.sched_setaffinity(0, allowed)
    return in_writes / args.rounds / 1000, total / args.rounds / 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--readers", type=int, default=4)
    p.add_argument("--work-us", type=float, default=300)
    p.add_argument("--reader-us", default="20,50,120", help="comma-separated: one table block each")
    p.add_argument("--rounds", type=int, default=1500)
    args = p.parse_args()
    if len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("needs at least 2 CPUs")
    print(f"{len(os.sched_getaffinity(0))} CPUs; {args.readers} readers; waker busy {args.work_us:.0f} us a round")
    print("| reader us | wake-up | placement | writes us/round (run 1, run 2) | round us (run 1, run 2) |")
    print("|---|---|---|---|---|")
    for reader_us in (float(v) for v in args.reader_us.split(",")):
        results: dict[tuple[str, bool], list[tuple[float, float]]] = {}
        for _ in range(2):
            for kind in ("unix", "eventfd"):
                for pinned in (False, True):
                    results.setdefault((kind, pinned), []).append(one_run(kind, pinned, args, reader_us))
        for (kind, pinned), runs in results.items():
            writes = ", ".join(f"{w:.1f}" for w, _ in runs)
            rounds = ", ".join(f"{r:.1f}" for _, r in runs)
            print(f"| {reader_us:.0f} | {kind} | {'waker pinned apart' if pinned else 'kernel'} | {writes} | {rounds} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
