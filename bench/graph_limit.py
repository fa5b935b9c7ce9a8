#!/usr/bin/env python3
"""What a pooled batch costs above the largest CUDA graph, and what the alternatives cost (GPU).

Eagerly, a 528-token qwen3 batch took 3.6-6.0 ms on the H200 against ~1 ms for 480 tokens in a
graph (bench/results/2026-12-04-worker-calls-h200.md). Since then a batch above the largest
bucket runs as chunks of graph replays, up to ``CudaGraphExperts.max_chunked_tokens`` (8 x the
largest bucket), and eagerly above. Measured here in one process (no gRPC), on the server's own
``ComputeWorker`` and one synthetic layer:

- ``whole``: the batch as one ``ComputeWorker.run``, with graphs up to each ``--graph-limits`` N
  (N = 512 is the server's default; larger N captures more buckets), as the server runs it: one
  graph, chunks of graphs, or eager (the row's path);
- ``eager``: the same batch with chunking off (``max_chunked_tokens = 0``), where ``whole`` ran chunks:
  the cost before chunking;
- ``split``: the same requests cut, in order, into runs of at most N tokens (what a scheduler that
  never pools past the largest graph would do), times summed.

Per (N, size): the median over ``--repeats`` of the back-to-back time, microseconds. Per size, once (CUDA only): the eager experts call alone on
device tensors, as the CPU time to launch it and the GPU time between two events around it, to
tell launch overhead from kernel time. Each N gets its own worker (graphs captured, eager sizes warmed
up to the largest size, as the server starts), freed before the next; the GPU memory its capture took
(allocated: the graphs' live buffers, shared by the layers, which ``deploy/sizing.py`` estimates;
reserved: with their pool) goes into the JSON::

    PYTHONPATH=kernels:client:server python3 bench/graph_limit.py --out $OUT/limit
    PYTHONPATH=kernels:client:server python3 bench/graph_limit.py --out /tmp/l --shape smoke --device cpu --backend reference

``--profile-sizes``: cProfile of 20 eager experts calls at each of those sizes (launch only, after the timed
ones), top functions by own time into ``launch-profile-T<size>.txt``: why a size's launch costs what it does.
``--graph-limits ''`` skips the graph runs. ``--pairwise-max-routes R`` sets
``lutb_kernels.routing_triton.PAIRWISE_MAX_ROUTES`` for the run (the most routes the one-launch routing kernel
takes over more than 64 experts; above it the plain-torch version runs), to time eager calls both ways.

Results: ``graph_limit.json`` under ``--out``; the table prints last. On a CPU device there are
no graphs: every run is eager (the smoke form only checks that the script runs).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SHAPES, make_checkpoint, prepared_requests  # noqa: E402  (bench/serving.py: the same synthetic layer)

REQUEST_TOKENS = 16


def split_runs(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive groups of request indices of at most ``limit`` tokens each (a larger request alone)."""
    groups: list[list[int]] = []
    tokens = 0
    for i, size in enumerate(sizes):
        if not groups or tokens + size > limit:
            groups.append([])
            tokens = 0
        groups[-1].append(i)
        tokens += size
    return groups


def profile_launch(call: Callable[[], object], path: Path, sync: Callable[[], object], calls: int = 20) -> None:
    """cProfile of ``calls`` calls of ``call`` (``sync`` after each, outside the profile); top 30 by own time to ``path``."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    for _ in range(calls):
        sync()
        prof.enable()
        call()
        prof.disable()
    sync()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    path.write_text(f"cProfile of {calls} launches\n" + text.getvalue())
    print(f"[limit] launch profile: {path}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/lutb-graph-limit-ckpt"))
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--backend", default="packed")
    p.add_argument("--device", default="cuda")
    p.add_argument("--graph-limits", default="512,1024,2048", help="comma list of cuda_graph_max_tokens values")
    p.add_argument("--sizes", default="480,512,528,640,768,1024,1536,2048",
                   help=f"comma list of batch sizes in tokens (requests of {REQUEST_TOKENS} tokens)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--profile-sizes", default="", help="comma list of sizes whose eager launch cProfile records (CUDA)")
    p.add_argument("--pairwise-max-routes", type=int, default=None,
                   help="routing_triton.PAIRWISE_MAX_ROUTES for this run (default: the module's)")
    args = p.parse_args()
    if args.pairwise_max_routes is not None:
        from lutb_kernels import routing_triton

        routing_triton.PAIRWISE_MAX_ROUTES = args.pairwise_max_routes
        print(f"[limit] PAIRWISE_MAX_ROUTES = {args.pairwise_max_routes}", flush=True)

    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_kernels.experts.graphs import CudaGraphExperts
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker

    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    device = resolve_device(args.device)
    ckpt = make_checkpoint(args.work_dir, args.shape, dtype="bfloat16", scale_mode="rceil", device=device.type)
    checkpoint = Checkpoint(ckpt)
    engine = ExpertEngine(checkpoint, choose_backend(args.backend, checkpoint.config, device),
                          validate_tiles=False, max_tokens_per_request=1 << 20)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    limits = [int(s) for s in args.graph_limits.split(",") if s]
    profile_sizes = {int(s) for s in args.profile_sizes.split(",") if s}

    gen = torch.Generator().manual_seed(1)
    batches = {tokens: prepared_requests(engine, shape, tokens, gen, request_tokens=REQUEST_TOKENS) for tokens in sizes}

    def median_us(worker: ComputeWorker, groups: list[list]) -> float:
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            for group in groups:
                worker.run(group)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    eager = {}
    if device.type == "cuda":
        inner = engine.layer_experts(0)
        for tokens, requests in batches.items():
            args_dev = [torch.cat([getattr(r, name) for r in requests]).to(device) for name in ("x", "topk_ids", "topk_weights")]
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            launch, gpu = [], []
            for i in range(args.repeats + 1):  # the first call compiles
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize(device)
                begin.record()
                start = time.perf_counter()
                inner.forward_unchecked(*args_dev, nonfinite=flag)
                launched = time.perf_counter() - start
                end.record()
                torch.cuda.synchronize(device)
                if i:
                    launch.append(launched * 1e6)
                    gpu.append(begin.elapsed_time(end) * 1e3)
            eager[tokens] = {"launch_us": statistics.median(launch), "gpu_us": statistics.median(gpu)}
            if tokens in profile_sizes:
                profile_launch(lambda: inner.forward_unchecked(*args_dev, nonfinite=flag), args.out / f"launch-profile-T{tokens}.txt",
                               lambda: torch.cuda.synchronize(device))
            print(f"[limit] eager experts call T={tokens}: launch {eager[tokens]['launch_us']:.0f} us (CPU), "
                  f"{eager[tokens]['gpu_us']:.0f} us between events (GPU)", flush=True)

    rows = []
    memory: dict[int, dict[str, int]] = {}
    for limit in limits:
        cuda = device.type == "cuda"
        before = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)) if cuda else (0, 0)
        worker = ComputeWorker(engine, cuda_graph_max_tokens=limit, cuda_graph_top_k=shape["top_k"])
        start = time.perf_counter()
        graphs_s = worker.capture_graphs()
        # allocated: the graphs' live buffers (deploy/sizing.py estimates the static ones); reserved: with their pool
        after = (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)) if cuda else (0, 0)
        memory[limit] = {"allocated": after[0] - before[0], "reserved": after[1] - before[1]}
        warm_s = worker.warm_up(max(sizes))
        print(f"[limit] N={limit}: graphs {graphs_s:.1f} s ({memory[limit]['allocated'] / 2**20:.1f} MiB allocated, "
              f"{memory[limit]['reserved'] / 2**20:.1f} MiB reserved), warm-up {warm_s:.1f} s ({time.perf_counter() - start:.1f} s)",
              flush=True)
        wrappers = [e for e in worker._experts.values() if isinstance(e, CudaGraphExperts)] if worker._experts else []
        chunk_limit = wrappers[0].max_chunked_tokens if wrappers else 0
        for tokens, requests in batches.items():
            groups = [[requests[i] for i in g] for g in split_runs([r.tokens for r in requests], limit)]
            for group in groups:  # first calls (a variant captured on first use) stay out of the timing
                worker.run(group)
            worker.run(requests)
            total = sum(r.tokens for r in requests)
            path = "eager" if not wrappers else "graph" if total <= limit else "chunks" if total <= chunk_limit else "eager"
            row = {"limit": limit, "tokens": total, "path": path, "whole_us": median_us(worker, [requests]), "eager_us": None,
                   "split_us": median_us(worker, groups), "split_runs": len(groups)}
            if path == "chunks":  # the same batch as before chunking: one eager call
                for w in wrappers:
                    w.max_chunked_tokens = 0
                worker.run(requests)  # an eager size the warm-up (above the chunks) did not run may compile
                row["eager_us"] = median_us(worker, [requests])
                for w in wrappers:
                    w.max_chunked_tokens = chunk_limit
            rows.append(row)
            print(f"[limit] N={limit} T={total}: whole {row['whole_us']:.0f} us ({path})"
                  + (f", eagerly {row['eager_us']:.0f} us" if row["eager_us"] is not None else "")
                  + f", split into {row['split_runs']} run(s) {row['split_us']:.0f} us", flush=True)
        (args.out / "graph_limit.json").write_text(json.dumps({"shape": args.shape, "backend": args.backend,
                                                                "device": str(device), "rows": rows,
                                                                "eager_call": eager, "graph_memory_bytes": memory}, indent=1))
        del worker
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if eager:
        print("\n| T | eager experts call: CPU us to launch | GPU us between events |\n|---|---|---|")
        for tokens, e in eager.items():
            print(f"| {tokens} | {e['launch_us']:.0f} | {e['gpu_us']:.0f} |")
    print(f"\n{args.shape}, {args.backend} on {device}: median us of {args.repeats} back-to-back calls")
    print("| graphs up to N | T | whole batch us | path | eager (no chunks) us | split at N us | runs |\n|---|---|---|---|---|---|---|")
    for r in rows:
        eager_us = "-" if r["eager_us"] is None else f"{r['eager_us']:.0f}"
        print(f"| {r['limit']} | {r['tokens']} | {r['whole_us']:.0f} | {r['path']} | {eager_us} | {r['split_us']:.0f} | {r['split_runs']} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
