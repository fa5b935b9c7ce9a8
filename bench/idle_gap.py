#!/usr/bin/env python
"""Does idleness between batches slow a batch down? ``ComputeWorker.run`` back to back vs after a gap.

Issue 5's concurrency-1 target compares a lone caller's latency with ``bench/serving.py``'s
in-process compute, which calls ``ComputeWorker.run`` back to back. In the server, a lone
caller leaves the worker idle for a round trip between batches, and the server's own compute
timing came out about twice the in-process one (525-574 vs 278 us, qwen3 T=16,
bench/results/2026-12-03-front-ends-h200.md). This times the same batch, on the same worker:

- ``direct``: run on this thread; after the gap this thread slept (``sleep``: the CPU may drop
  into an idle state, the GPU idles) or spun (``spin``: the CPU stays hot, the GPU idles);
- ``thread``: handed to the worker thread (``submit``, as the server does) after sleeping,
  and waited for on a ``concurrent.futures.Future``: the server's path minus gRPC and asyncio.

Gap 0 with ``direct`` is the in-process baseline. If ``spin`` stays near it while ``sleep``
grows, the cost is the host waking up; if both grow, it is the GPU (or its driver) waking up.

    python bench/idle_gap.py --out /tmp/gap                       # packed on CUDA, qwen3 shape
    python bench/idle_gap.py --smoke --out /tmp/gap               # tiny CPU run (reference backend)

Writes ``idle_gap.json`` under ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent)] + [str(Path(__file__).resolve().parents[1] / p) for p in ("kernels", "client", "server")]

from serving import SHAPES, make_checkpoint  # noqa: E402


def _wait(gap_s: float, how: str) -> None:
    if gap_s <= 0:
        return
    if how == "sleep":
        time.sleep(gap_s)
        return
    end = time.perf_counter() + gap_s
    while time.perf_counter() < end:
        pass


def measure(worker, prepared: list, mode: str, gap_us: float, calls: int) -> dict:  # noqa: ANN001
    """Median and p90 us of ``calls`` batches (the caller's wall time, and the worker's own ``seconds``)."""
    wall, own = [], []
    how = "spin" if mode == "direct-spin" else "sleep"
    for _ in range(calls):
        _wait(gap_us / 1e6, how)
        start = time.perf_counter()
        out = worker.submit(prepared).result() if mode == "thread" else worker.run(prepared)
        wall.append(time.perf_counter() - start)
        own.append(out.seconds)

    def q(values: list[float], p: float) -> float:
        return sorted(values)[min(len(values) - 1, int(p * len(values)))] * 1e6

    return {"mode": mode, "gap_us": gap_us, "calls": calls, "wall_p50_us": statistics.median(wall) * 1e6,
            "wall_p90_us": q(wall, 0.9), "run_p50_us": statistics.median(own) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16])
    p.add_argument("--gaps-us", type=float, nargs="+", default=[0, 100, 300, 1000, 3000])
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, reference backend")
    args = p.parse_args(argv)

    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker

    device = "cpu" if args.smoke else "cuda"
    shape_name = "smoke" if args.smoke else args.shape
    if args.smoke:
        args.calls, args.gaps_us, args.tokens = 5, [0, 100], [1]
    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[shape_name]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Checkpoint(make_checkpoint(Path(tmp), shape_name, dtype="bfloat16", scale_mode="rceil", device=device))
        engine = ExpertEngine(ckpt, choose_backend("reference" if args.smoke else "packed", ckpt.config, resolve_device(device)),
                              validate_tiles=False)
    worker = ComputeWorker(engine, cuda_graph_top_k=shape["top_k"]).start()
    worker.call(worker.capture_graphs).result()
    gen = torch.Generator().manual_seed(0)
    rows = []
    for tokens in args.tokens:
        x = torch.randn(tokens, shape["hidden"], generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, shape["experts"], generator=gen).topk(shape["top_k"], dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(tokens, shape["top_k"], generator=gen), dim=1)
        prepared = [engine.prepare(0, x, ids, w)]
        for _ in range(20):
            worker.run(prepared)
        for gap in args.gaps_us:
            for mode in ("direct-sleep", "direct-spin", "thread"):
                if gap == 0 and mode == "direct-spin":
                    continue  # the same as direct-sleep at gap 0
                row = {"tokens": tokens, **measure(worker, prepared, mode, gap, args.calls)}
                rows.append(row)
                print(f"[idle_gap] T={tokens} {mode:12s} gap {gap:6.0f} us: wall p50 {row['wall_p50_us']:.0f} "
                      f"p90 {row['wall_p90_us']:.0f} run p50 {row['run_p50_us']:.0f}", flush=True)
    worker.close()
    (args.out / "idle_gap.json").write_text(json.dumps({"shape": shape_name, "device": str(engine.device),
                                                        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
                                                        "rows": rows}, indent=1))
    lines = [f"idle_gap: {shape_name}, ComputeWorker.run us (wall p50 / p90 of the caller; run = the worker's own timing)",
             f"{'T':>4s} {'mode':12s} {'gap us':>7s} {'wall p50':>9s} {'wall p90':>9s} {'run p50':>8s}"]
    for r in rows:
        lines.append(f"{r['tokens']:4d} {r['mode']:12s} {r['gap_us']:7.0f} {r['wall_p50_us']:9.0f} {r['wall_p90_us']:9.0f} "
                     f"{r['run_p50_us']:8.0f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
