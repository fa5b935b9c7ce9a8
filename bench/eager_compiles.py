#!/usr/bin/env python3
"""Which eager batch sizes still make Triton compile after the server's start-up warm-up (GPU).

The server captures CUDA graphs up to ``--cuda-graph-max-tokens`` N (batches up to 8 N run as
chunks of them) and then runs ``ComputeWorker.warm_up`` (eager batches above 8 N, up to
``max_batch_tokens``: every power of two and one size per other launch config), so that no
request pays for a kernel compile. This script builds the same worker on one synthetic layer (``--held N``: a shard of
N experts), does the same start-up, then runs batches of other sizes
(16-token requests, uniform random routing) and reports, per size, the first call's time, the
steady time, and every kernel Triton compiled during the first call (``triton.knobs.runtime.
jit_cache_hook`` sees each in-memory cache miss) with the specialisation it compiled.

    PYTHONPATH=kernels:client:server python3 bench/eager_compiles.py --out $OUT/eager
    PYTHONPATH=kernels:client:server python3 bench/eager_compiles.py --out $OUT/shard --shape mixtral-8x7b --held 2

A size whose first call compiles stalls every request pooled into it for that long on a live
server. Results: ``eager_compiles.json`` under ``--out``; the table prints last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SHAPES, make_checkpoint, prepared_requests  # noqa: E402  (bench/serving.py: the same synthetic layer)

DEFAULT_SIZES = "528,640,768,800,1008,1024,1040,1280,1536,2000,2048,2064,3000,4096,4112,6000,8192"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/lutb-eager-ckpt"))
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=list(SHAPES))
    p.add_argument("--held", type=int, default=None, help="a shard holding experts 0 .. HELD-1 (default: the whole layer)")
    p.add_argument("--backend", default="packed")
    p.add_argument("--cuda-graph-max-tokens", type=int, default=512)
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--sizes", default=DEFAULT_SIZES, help="comma list of batch sizes in tokens (multiples of 16)")
    args = p.parse_args()

    import torch
    import triton

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker, warm_up_sizes

    args.out.mkdir(parents=True, exist_ok=True)
    shape = SHAPES[args.shape]
    ckpt = make_checkpoint(args.work_dir, args.shape, dtype="bfloat16", scale_mode="rceil", device="cuda", held=args.held)
    checkpoint = Checkpoint(ckpt)
    engine = ExpertEngine(checkpoint, choose_backend(args.backend, checkpoint.config, resolve_device("cuda")),
                          validate_tiles=False, max_tokens_per_request=1 << 20)
    worker = ComputeWorker(engine, cuda_graph_max_tokens=args.cuda_graph_max_tokens, cuda_graph_top_k=shape["top_k"])

    compiles: list[dict] = []

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002, ANN001 - triton's names
        compiles.append({"kernel": fn.name, "key": str(key)[:400], "signature": str(repr)[:3000]})
        return False  # compile as usual

    triton.knobs.runtime.jit_cache_hook = hook
    start = time.perf_counter()
    graphs_s = worker.capture_graphs()
    warm_s = worker.warm_up(args.max_batch_tokens)
    inner = engine.layer_experts(0)
    eager_above = getattr(worker._experts[0], "eager_above", args.cuda_graph_max_tokens) if worker._experts else 0
    warm_sizes = warm_up_sizes(eager_above, args.max_batch_tokens, getattr(inner, "launch_key", None), shape["top_k"])
    startup = {"graphs_s": graphs_s, "warm_up_s": warm_s, "compiles": len(compiles), "seconds": time.perf_counter() - start,
               "warm_up_sizes": warm_sizes, "held": args.held}
    print(f"[eager] start-up: graphs {graphs_s:.1f} s, warm-up {warm_s:.1f} s at sizes {warm_sizes}, {len(compiles)} kernel compiles",
          flush=True)
    startup_count = len(compiles)

    gen = torch.Generator().manual_seed(1)
    rows = []
    for tokens in [int(s) for s in args.sizes.split(",") if s]:
        prepared = prepared_requests(engine, shape, tokens, gen)
        before = len(compiles)
        t0 = time.perf_counter()
        worker.run(prepared)
        first = time.perf_counter() - t0
        new = compiles[before:]
        steady = statistics.median(worker.run(prepared).seconds for _ in range(5))
        row = {"tokens": 16 * len(prepared), "first_ms": first * 1e3, "steady_ms": steady * 1e3,
               "compiles": [c["kernel"] for c in new], "compiled": new}
        rows.append(row)
        print(f"[eager] T={row['tokens']}: first {row['first_ms']:.1f} ms, steady {row['steady_ms']:.2f} ms, "
              f"compiled {row['compiles'] or 'nothing'}", flush=True)
        (args.out / "eager_compiles.json").write_text(json.dumps({"shape": args.shape, "startup": startup,
                                                                   "startup_compiles": compiles[:startup_count],
                                                                   "rows": rows}, indent=1))
    print("\n| T | first call ms | steady ms | kernels compiled on the first call |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['first_ms']:.1f} | {r['steady_ms']:.2f} | {', '.join(r['compiles']) or '-'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
