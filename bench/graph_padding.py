#!/usr/bin/env python3
"""What padding a batch to its CUDA-graph bucket costs the GPU: a layer's graph replay time by batch size, with the
padding routes going to no expert (id -1, ``lutb_kernels.experts.graphs.PAD_ROUTE``, since 2026-12-06) and, for
comparison, to the layer's first expert (what a layer holding every expert did before).

One process, bench/serving.py's synthetic layer (one per ``--shape``), the packed backend, graphs up to 512 tokens.
Each padding mode gets its own ``CudaGraphExperts`` (own static rows and graphs) over the same loaded experts; per
size, the modes' calls alternate, each timed alone on the GPU (CUDA events around ``forward_unchecked`` on inputs
already on the device: the copies into the graph's rows and the replay), median over ``--repeats``::

    PYTHONPATH=kernels:client:server python3 bench/graph_padding.py --out $OUT/pad --shapes qwen3-30b-a3b,deepseek-v3

Writes ``graph_padding.json`` under ``--out``; the table prints last. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serving import SHAPES, make_checkpoint  # noqa: E402  (bench/serving.py: the same synthetic layer)

MODES = {"none (-1)": -1, "first expert": 0}
"""Padding modes: the id every padding route carries."""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/lutb-graph-padding-ckpt"))
    p.add_argument("--shapes", default="qwen3-30b-a3b", help="comma list of bench/serving.py shapes")
    p.add_argument("--sizes", default="1,3,8,24,128,160,256,272,320,400,480,512", help="comma list of batch sizes (tokens)")
    p.add_argument("--repeats", type=int, default=40)
    args = p.parse_args()

    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.experts import graphs
    from lutb_kernels.experts.graphs import CudaGraphExperts, bucket_for
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine

    device = resolve_device("cuda")
    sizes = [int(s) for s in args.sizes.split(",") if s]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for shape_name in [s for s in args.shapes.split(",") if s]:
        shape = SHAPES[shape_name]
        checkpoint = Checkpoint(make_checkpoint(args.work_dir, shape_name, dtype="bfloat16", scale_mode="rceil", device="cuda"))
        engine = ExpertEngine(checkpoint, choose_backend("packed", checkpoint.config, device), validate_tiles=False)
        inner, k = engine.layer_experts(0), shape["top_k"]
        wrappers = {}
        for mode, pad in MODES.items():
            graphs.PAD_ROUTE = pad  # read when the wrapper's rows are made and whenever their padding is reset
            wrappers[mode] = CudaGraphExperts(inner, max_tokens=512)
            wrappers[mode].capture(k)
        gen = torch.Generator(device="cuda").manual_seed(0)
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        for tokens in sizes:
            x = torch.randn(tokens, checkpoint.config.hidden_size, device=device, generator=gen).to(torch.bfloat16)
            ids = torch.rand(tokens, checkpoint.config.num_experts, device=device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
            w = torch.softmax(torch.randn(tokens, k, device=device, generator=gen), dim=1)
            times: dict[str, list[float]] = {mode: [] for mode in MODES}
            outputs = {}
            for i in range(args.repeats + 1):  # the first call of each mode is not timed
                for mode, pad in MODES.items():
                    graphs.PAD_ROUTE = pad
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    out = wrappers[mode].forward_unchecked(x, ids, w, nonfinite=flag)
                    end.record()
                    torch.cuda.synchronize(device)
                    if i:
                        times[mode].append(start.elapsed_time(end) * 1e3)
                    else:
                        outputs[mode] = out.clone()
            assert int(flag) == 0, "an MXFP8 quantization met NaN/Inf"
            a, b = (outputs[m].double() for m in MODES)
            bucket = bucket_for(tokens, wrappers["none (-1)"].buckets)
            row = {"shape": shape_name, "tokens": tokens, "bucket": bucket, "padding_routes": ((bucket or tokens) - tokens) * k,
                   "us": {mode: statistics.median(t) for mode, t in times.items()},
                   "rel_l2_between_modes": float((a - b).norm() / b.norm().clamp_min(1e-30))}
            rows.append(row)
            print(f"[pad] {shape_name} T={tokens} (bucket {bucket}): " + ", ".join(f"{m} {u:.1f} us" for m, u in row["us"].items()),
                  flush=True)
        del wrappers, engine, inner
        torch.cuda.empty_cache()
    graphs.PAD_ROUTE = -1
    (args.out / "graph_padding.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(device), "rows": rows}, indent=1))
    modes = list(MODES)
    print(f"\n| shape | T | bucket | padding routes | GPU us, padding to {modes[0]} | to {modes[1]} | {modes[1]} / {modes[0]} |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        u = r["us"]
        print(f"| {r['shape']} | {r['tokens']} | {r['bucket']} | {r['padding_routes']} | {u[modes[0]]:.1f} | {u[modes[1]]:.1f} | "
              f"{u[modes[1]] / u[modes[0]]:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
