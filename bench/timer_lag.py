#!/usr/bin/env python3
"""How late the event loop's timers fire: ``loop.call_at`` for a due time 20-28 ms ahead, the lateness of the callback
against that time, ``--timers`` times, on uvloop and on asyncio's own loop. The scheduler's pooling wait ends on such a
timer, so its margin before a deadline (``lutb_server.scheduler.POOLING_DEADLINE_MARGIN_S``) must exceed this lag.

    python bench/timer_lag.py                 # both loops, the machine as it is
    python bench/timer_lag.py --busy 2        # with 2 processes spinning on the CPUs meanwhile
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time


async def _lags(timers: int) -> list[float]:
    loop = asyncio.get_running_loop()
    lags = []
    for i in range(timers):
        fired = loop.create_future()
        due = time.monotonic() + 0.02 + (i % 7) * 0.0013
        loop.call_at(loop.time() + (due - time.monotonic()), lambda f=fired: f.set_result(time.monotonic()))
        lags.append((await fired - due) * 1e3)
    return sorted(lags)


def _spin(stop: float) -> None:
    while time.monotonic() < stop:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--timers", type=int, default=200)
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPUs during the runs")
    args = p.parse_args()
    spinners = [mp.Process(target=_spin, args=(time.monotonic() + 60,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    try:
        print("| loop | busy processes | timers | median ms | p99 ms | worst ms |\n|---|---|---|---|---|---|")
        for name in ("uvloop", "asyncio"):
            if name == "uvloop":
                import uvloop
                lags = uvloop.run(_lags(args.timers))
            else:
                lags = asyncio.run(_lags(args.timers))
            p99 = lags[min(len(lags) - 1, int(0.99 * len(lags)))]
            print(f"| {name} | {args.busy} | {len(lags)} | {statistics.median(lags):.2f} | {p99:.2f} | {lags[-1]:.2f} |")
    finally:
        for s in spinners:
            s.terminate()


if __name__ == "__main__":
    main()
