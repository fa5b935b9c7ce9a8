#!/usr/bin/env python
"""What switching MoE layers between experts calls costs, in-process (no gRPC, no compute process).

A deployment's calls walk the layers (an attention node sends layer 0, 1, ... of each decode step), while
``bench/serving.py``'s in-process baseline and most of its cells call one layer back to back. On an H100,
``bench/serving.py --layers 8`` showed a lone caller's experts calls taking ~340 us at qwen3-30b-a3b, 16 tokens,
against ~200 us in-process on one layer (bench/results/2026-12-07-layers-in-flight-h100.md). This script
separates the causes: the same ``ComputeWorker`` (staging, CUDA graphs or eager) runs batches that cycle over the
first ``n`` layers of an 8-layer checkpoint (n = 1, 2, 4, 8), with distinct routings or one routing repeated, back
to back or with an idle gap between calls (as a lone caller's are). If the time grows with ``n`` at a fixed
routing, the cost is in touching another layer's weights (caches, address translation), not in the routing.

    python bench/layer_switch.py --out /tmp/ls                                  # qwen3-30b-a3b, T = 1 and 16
    python bench/layer_switch.py --smoke --out /tmp/ls                          # tiny CPU run

Writes ``layer_switch.json`` and ``layer_switch.md`` under ``--out``; prints the table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from repo_state import git_state  # noqa: E402 - bench/, beside this script
from serving import SHAPES, make_checkpoint, prepared_requests  # noqa: E402

LAYERS = 8
DISTINCT = 8  # distinct routings per layer ("distinct" mode)
GPU_CYCLES_PER_S = 2.1e9
"""The ``gpu`` idle mode's spin kernel: cycles per second of gap, above an H100's or H200's top SM clock (1.98 GHz) so
that the kernel outlasts the gap (a slower clock makes it run into the next call, on one SM). Until 2026-12-07's
call 3 (bench/results/2026-12-07-layer-switch-h100.md) it was 1.7e9: the kernel ended ~14% of a gap early."""
GAP_MODES = ("sleep", "spin", "gpu")


def _batches(engine: Any, shape: dict[str, int], tokens: int, layers: int, seed: int) -> dict[int, list[Any]]:
    """``DISTINCT`` validated requests of ``tokens`` tokens per layer ``0 .. layers - 1``, each its own routing
    (:func:`serving.prepared_requests`' batches)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return {layer: prepared_requests(engine, shape, DISTINCT * tokens, gen, request_tokens=tokens, layer=layer)
            for layer in range(layers)}


def _time_calls(worker: Any, sequence: list[Any], seconds: float, gap_s: float, mode: str) -> dict[str, float]:
    """Median and p90 microseconds of ``worker.run([request])`` over ``sequence`` in turn for ``seconds``, idle
    ``gap_s`` between calls (0: back to back). ``mode``: ``sleep`` (the thread sleeps in the kernel), ``spin`` (it
    polls the clock: the CPU stays busy, so only the GPU's side of an idle gap remains) or ``gpu`` (it sleeps while
    a one-block spin kernel, ``torch.cuda._sleep``, keeps the GPU busy on a stream of its own for the gap: only the
    CPU's side remains)."""
    import torch

    side = torch.cuda.Stream() if mode == "gpu" and gap_s else None
    for request in sequence:  # every layer and routing of the cell once, so that none is timed cold
        worker.run([request])
    times: list[float] = []
    i = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 20:
        start = time.perf_counter()
        worker.run([sequence[i % len(sequence)]])
        times.append(time.perf_counter() - start)
        i += 1
        if gap_s and mode == "spin":
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:
                pass
        elif gap_s:
            if side is not None:
                with torch.cuda.stream(side):
                    torch.cuda._sleep(int(gap_s * GPU_CYCLES_PER_S))
            time.sleep(gap_s)
    if side is not None:
        side.synchronize()  # the last spin kernel must not run into the next cell
    times.sort()
    return {"p50_us": statistics.median(times) * 1e6, "p90_us": times[int(0.9 * (len(times) - 1))] * 1e6,
            "calls": len(times)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path, default=None, help="checkpoint cache (default OUT/checkpoints)")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--gaps-us", default="0,500", help="idle time between calls")
    p.add_argument("--gap-modes", default="sleep", help="sleep, spin and/or gpu: how the caller idles between calls "
                   "(see _time_calls)")
    p.add_argument("--layer-counts", default="1,2,4,8", help="how many layers the calls cycle over")
    p.add_argument("--seconds", type=float, default=0.4, help="per measurement")
    p.add_argument("--graphs", default="512,0", help="cuda_graph_max_tokens values to compare (0: eager)")
    p.add_argument("--smoke", action="store_true", help="tiny shape on the CPU")
    args = p.parse_args(argv)
    modes = args.gap_modes.split(",")
    if any(m not in GAP_MODES for m in modes):
        p.error(f"--gap-modes: each of {', '.join(GAP_MODES)}")
    counts = [int(c) for c in args.layer_counts.split(",")]
    if any(not 1 <= n <= LAYERS for n in counts):
        p.error(f"--layer-counts: each from 1 to {LAYERS} (the checkpoint's layers)")

    import torch

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.app import apply_intra_op_threads
    from lutb_server.backends import choose_backend, resolve_device
    from lutb_server.engine import ExpertEngine
    from lutb_server.worker import ComputeWorker

    shape_name = "smoke" if args.smoke else args.shape
    shape = SHAPES[shape_name]
    device = resolve_device("cpu" if args.smoke else "auto")
    if "gpu" in modes and device.type != "cuda":
        p.error(f"--gap-modes gpu needs a CUDA device (this run's: {device})")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work_dir or args.out / "checkpoints"
    ckpt = make_checkpoint(Path(work), shape_name, dtype="bfloat16", scale_mode="rceil", device=device.type,
                           layers=LAYERS)
    checkpoint = Checkpoint(ckpt)
    apply_intra_op_threads(0, device)
    engine = ExpertEngine(checkpoint, choose_backend("auto", checkpoint.config, device), validate_tiles=False,
                          max_tokens_per_request=1 << 16)
    rows: list[dict[str, Any]] = []
    graph_limits = [int(g) for g in args.graphs.split(",")] if device.type == "cuda" else [0]
    for graphs in graph_limits:
        worker = ComputeWorker(engine, cuda_graph_max_tokens=graphs, cuda_graph_top_k=shape["top_k"])
        worker.capture_graphs()
        for tokens in [int(t) for t in args.tokens.split(",")]:
            batches = _batches(engine, shape, tokens, LAYERS, seed=tokens)
            for gap_us, mode in [(int(g), m) for g in args.gaps_us.split(",") for m in modes]:
                if gap_us == 0 and mode != modes[0]:
                    continue  # no gap: nothing to idle in
                for n in counts:
                    for routing in ("one", "distinct"):
                        # layer-major interleave: call i runs layer i % n (one routing per layer, or its i // n-th)
                        sequence = [batches[i % n][0 if routing == "one" else (i // n) % DISTINCT]
                                    for i in range(n * DISTINCT)]
                        row = {"graphs": graphs, "tokens": tokens, "gap_us": gap_us, "gap_mode": mode if gap_us else "-",
                               "layers": n, "routing": routing,
                               **_time_calls(worker, sequence, args.seconds, gap_us / 1e6, mode)}
                        rows.append(row)
                        print(f"[layer_switch] {row}", flush=True)
        del worker
        if device.type == "cuda":
            torch.cuda.synchronize()
    env = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None}
    commit, dirty = git_state(Path(__file__).resolve().parent)
    report = {"provenance": {"utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "commit": commit,
                             "dirty": dirty, "argv": sys.argv}, "environment": env, "shape": shape_name, "backend": engine.backend.name,
              "rows": rows}
    (args.out / "layer_switch.json").write_text(json.dumps(report, indent=2))
    table = ["| graphs | T | gap us | idle | routing | " + " | ".join(f"{n} layer(s) p50 us" for n in counts)
             + f" | {counts[-1]} / {counts[0]} |", "|---" * (6 + len(counts)) + "|"]
    keyed = {(r["graphs"], r["tokens"], r["gap_us"], r["gap_mode"], r["routing"], r["layers"]): r["p50_us"] for r in rows}
    for (graphs, tokens, gap, mode, routing, n), _ in sorted(keyed.items()):
        if n != counts[0]:
            continue
        cells = [keyed[(graphs, tokens, gap, mode, routing, m)] for m in counts]
        table.append(f"| {graphs} | {tokens} | {gap} | {mode} | {routing} | " + " | ".join(f"{c:.0f}" for c in cells)
                     + f" | {cells[-1] / cells[0]:.2f} |")
    text = "\n".join([f"# Layer switching ({report['provenance']['utc']}, {shape_name}, {engine.backend.name}, "
                      f"{env['gpu'] or 'cpu'})", "", f"Provenance: {json.dumps(report['provenance'])}", "", *table, ""])
    (args.out / "layer_switch.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
