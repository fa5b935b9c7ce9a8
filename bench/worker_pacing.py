#!/usr/bin/env python3
"""Why the server's compute time at concurrency 1 exceeds the in-process baseline (issue 5).

bench/serving.py measured, for the same ``ComputeWorker.run`` on the same 16-token batch, 293 us
in a tight in-process loop but a 578 us median ``timing.compute_us`` inside the server at
concurrency 1 (bench/results/2026-12-02-serving-5-h200.md). This separates the suspects, all in
one process, no gRPC:

- ``direct``: ``worker.run`` back to back on this thread (the serving bench's in-process baseline);
- ``direct+gap``: the same with an idle gap between calls, as between the requests of one client
  at concurrency 1 (the GPU and the CPU core idle in between: clocks, sleep states, caches);
- ``direct+spin``: the same gaps spent spinning on this thread: the GPU idles but the CPU core
  stays busy, which tells the host's wake-up from the GPU's (on the H200 machine, gaps up to
  1 ms cost ~175-200 us slept and 0-35 us spun: bench/results/2026-12-03-idle-gap-h200.md);
- ``thread``: each batch submitted to the worker thread, this thread blocking on its future
  (``thread+gap``: after sleeping 1 ms);
- ``asyncio``: submitted from an asyncio loop awaiting ``asyncio.wrap_future`` (the server's path);
- ``asyncio+busy``: the same while another task keeps the loop always busy with small Python steps
  (what gRPC's callbacks do under load), competing for the GIL; once per GIL switch interval in
  ``--busy-switch-intervals-us`` (each torch call of the worker releases and retakes the GIL, and
  a thread asking for it back waits up to one interval while the loop holds it);
- ``process`` and ``process+busy``: ``asyncio`` and ``asyncio+busy`` (at ``--switch-interval-us``)
  through a :class:`~lutb_server.worker_process.ProcessComputeWorker` on the same loop
  (``compute_worker = "process"``, as the server runs it): the batch runs in a child process,
  whose GIL nothing else wants. (A child that spun on its socket for 2 ms after each answer
  instead of sleeping gained nothing clear: bench/results/2026-12-03-worker-h200.md, commit ff449ee.)

Columns: the median of ``run``'s own seconds (what the server reports as compute) and of the
round trip seen by the submitter, in microseconds. Usage (GPU):

    python bench/worker_pacing.py --out DIR [--shape qwen3-30b-a3b] [--tokens 1 16] [--seconds 1.0]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import SHAPES, make_checkpoint  # noqa: E402

GAPS_US = (300, 1000, 3000)


class _Samples:
    """Per call: the worker's own seconds and the round trip the caller saw."""

    def __init__(self) -> None:
        self.compute: list[float] = []
        self.trip: list[float] = []

    def add(self, started: float, compute_s: float) -> None:
        self.trip.append(time.perf_counter() - started)
        self.compute.append(compute_s)

    def summary(self) -> dict:
        median_us = lambda xs: statistics.median(xs) * 1e6 if xs else float("nan")  # noqa: E731
        return {"compute_us": median_us(self.compute), "round_trip_us": median_us(self.trip), "calls": len(self.compute)}


def run_blocking(call, seconds: float, gap_s: float = 0.0, spin: bool = False) -> dict:  # noqa: ANN001
    """``call() -> BatchOutput`` back to back (after a gap of ``gap_s`` each: slept, or spun if ``spin``) for ``seconds``."""
    samples = _Samples()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        if gap_s and spin:
            gap_end = time.perf_counter() + gap_s
            while time.perf_counter() < gap_end:
                pass
        elif gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        samples.add(t0, call().seconds)
    return samples.summary()


async def _asyncio(worker, prepared, seconds: float, busy_tasks: int) -> dict:  # noqa: ANN001
    """``worker.submit`` awaited on an event loop, with ``busy_tasks`` tasks keeping the loop busy."""
    stop = False

    async def busy() -> None:  # small Python steps with yields, like gRPC callbacks under load
        while not stop:
            sum(range(200))
            await asyncio.sleep(0)

    others = [asyncio.ensure_future(busy()) for _ in range(busy_tasks)]
    samples = _Samples()
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        samples.add(t0, (await asyncio.wrap_future(worker.submit(prepared))).seconds)
    stop = True
    await asyncio.gather(*others)
    return samples.summary()


def _with_switch_interval(interval_us: int, fn):  # noqa: ANN001, ANN202
    before = sys.getswitchinterval()
    sys.setswitchinterval(interval_us / 1e6)
    try:
        return fn()
    finally:
        sys.setswitchinterval(before)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=1.0, help="per mode")
    p.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a smoke run: --shape smoke --backend reference)")
    p.add_argument("--backend", default="packed")
    p.add_argument("--switch-interval-us", type=int, default=200, help="sys.setswitchinterval, as the server sets it on CUDA")
    p.add_argument("--busy-switch-intervals-us", type=int, nargs="+", default=[200, 50, 20, 5],
                   help="switch intervals of the asyncio+busy mode")
    args = p.parse_args()

    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker
    from lutb_server.worker_process import ProcessComputeWorker, WorkerSpec

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/worker_pacing.py needs a CUDA GPU (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    sys.setswitchinterval(args.switch_interval_us / 1e6)
    torch.set_num_threads(1)  # as the server on a CUDA device
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    ckpt = make_checkpoint(args.out / "checkpoints", args.shape, dtype="bfloat16", scale_mode="rceil", device=args.device)
    checkpoint = Checkpoint(ckpt)
    device = resolve_device(args.device)
    engine = ExpertEngine(checkpoint, choose_backend(args.backend, checkpoint.config, device), validate_tiles=False)
    worker = ComputeWorker(engine, cuda_graph_max_tokens=512, cuda_graph_top_k=shape["top_k"])
    worker.capture_graphs()
    worker.start()
    loop = asyncio.new_event_loop()  # every asyncio mode runs on it; the compute process's I/O too, as in the server
    spec = WorkerSpec(str(ckpt), args.backend, args.device, validate_tiles=False, cuda_graph_max_tokens=512, cuda_graph_top_k=shape["top_k"])
    child = ProcessComputeWorker(spec, loop=loop).start()
    rows = []
    gen = torch.Generator().manual_seed(0)
    for tokens in args.tokens:
        x = torch.randn(tokens, shape["hidden"], generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, shape["experts"], generator=gen).topk(shape["top_k"], dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(tokens, shape["top_k"], generator=gen), dim=1)
        prepared = [engine.prepare(0, x, ids, w)]
        for _ in range(20):
            worker.run(prepared)
        modes = {"direct": lambda: run_blocking(lambda: worker.run(prepared), args.seconds)}
        for gap in GAPS_US:
            modes[f"direct+gap {gap}us"] = lambda gap=gap: run_blocking(lambda: worker.run(prepared), args.seconds, gap / 1e6)
        for gap in GAPS_US:
            modes[f"direct+spin {gap}us"] = lambda gap=gap: run_blocking(lambda: worker.run(prepared), args.seconds, gap / 1e6, spin=True)
        modes["thread"] = lambda: run_blocking(lambda: worker.submit(prepared).result(), args.seconds)
        modes["thread+gap 1000us"] = lambda: run_blocking(lambda: worker.submit(prepared).result(), args.seconds, 1e-3)
        modes["asyncio"] = lambda: loop.run_until_complete(_asyncio(worker, prepared, args.seconds, 0))
        for interval in args.busy_switch_intervals_us:
            modes[f"asyncio+busy si={interval}us"] = lambda interval=interval: _with_switch_interval(
                interval, lambda: loop.run_until_complete(_asyncio(worker, prepared, args.seconds, 1)))
        modes["process"] = lambda: loop.run_until_complete(_asyncio(child, prepared, args.seconds, 0))
        modes["process+busy"] = lambda: loop.run_until_complete(_asyncio(child, prepared, args.seconds, 1))
        for mode, fn in modes.items():
            r = fn()
            rows.append({"tokens": tokens, "mode": mode, **r})
            print(f"T={tokens:3d} {mode:20s} compute {r['compute_us']:7.1f} us  round trip {r['round_trip_us']:7.1f} us  ({r['calls']} calls)",
                  flush=True)
    worker.close()
    loop.run_until_complete(asyncio.to_thread(child.close, 30))  # close() blocks; the loop must run meanwhile
    loop.close()
    meta = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "backend": args.backend, "torch": torch.__version__, "shape": args.shape,
            "switch_interval_us": args.switch_interval_us, "threads": threading.active_count()}
    (args.out / "worker_pacing.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print("\n| T | mode | compute us (run's own) | round trip us |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['mode']} | {r['compute_us']:.1f} | {r['round_trip_us']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
