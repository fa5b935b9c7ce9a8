"""Expert-parallel serving: one server holding every expert against 2 and 4 shard servers.

For each shard count N (``--shards``, default 1 2 4) the checkpoint's experts are split
with ``lutb shard``'s contiguous placement (N = 1: the whole checkpoint), N ``lutb serve``
processes are started on this machine (devices from ``--device``, round-robin when several
are given), and :class:`lutb_client.AsyncShardedExpertClient` drives them at each
concurrency level (``--concurrency``, default 1 2 4 8 16 32 64) for ``--duration`` seconds
after a warm-up: the same client code path for every N, the same total experts, the same
routed batches (``--tokens`` tokens per request, top-``--topk`` of uniform random logits).

Reported per (N, concurrency): requests, latency p50/p99/mean (ms), requests/s, tokens/s,
errors, and each shard's p50/p99 as the client saw it (the JSON holds the client's per-shard
stats). The servers' logs go to ``OUT/servers.log``.

The load comes from one client process by default. A sharded forward costs its client 2-4
messages each way plus planning and a combine, so one asyncio process can be the limit
(it was, on the H200: bench/results/2026-12-02-expert-parallel-5-h200.md);
``--client-procs P`` spreads each row's concurrency over P spawned processes, each with its
own client, started together (a barrier) and measured over the same window, as P attention
nodes would. Latency percentiles are then over every process's requests; a shard's p50/p99
and server-side medians are the median of the processes' values.

Usage::

    python bench/expert_parallel.py --out bench/results/ep-h200 --backend auto --device cuda:0 \\
        --checkpoint /models/ds-v3-lutb-layer3 --duration 10
    python bench/expert_parallel.py --out /tmp/ep --backend reference --device cpu \\
        --experts 8 --hidden 128 --intermediate 128 --concurrency 1 4 --duration 1 --server-threads 1   # CPU smoke test

Without ``--checkpoint`` a synthetic checkpoint of random valid tiles (no quantizer, so
it is made in seconds) of the given shape is written under the work directory.
Writes ``OUT/expert_parallel.md`` and ``OUT/expert_parallel.json``; prints a short table last.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from lutb_client import AsyncShardedExpertClient, ExpertServiceError
from lutb_client.routing import softmax_topk
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.sharding import contiguous_placement, write_shards
from lutb_server.testing import ServeProcess, make_tiny_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="directory for expert_parallel.md and expert_parallel.json")
    p.add_argument("--checkpoint", type=Path, help="LUT-B checkpoint to serve (default: a synthetic one of the shape below)")
    p.add_argument("--layers", type=int, default=1, help="synthetic: MoE layers (default 1)")
    p.add_argument("--experts", type=int, default=64, help="synthetic: experts per layer (default 64)")
    p.add_argument("--hidden", type=int, default=2048, help="synthetic: hidden size H (default 2048)")
    p.add_argument("--intermediate", type=int, default=1024, help="synthetic: intermediate size I (default 1024)")
    p.add_argument("--activation", default="silu", help="synthetic: activation (default silu)")
    p.add_argument("--dtype", default="bfloat16", help="synthetic: model dtype (default bfloat16)")
    p.add_argument("--backend", default="auto", help="lutb serve --backend (default auto)")
    p.add_argument("--device", nargs="+", default=["auto"], help="lutb serve --device; several are given to shards round-robin")
    p.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4], help="shard counts to compare (default 1 2 4)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64], help="requests in flight")
    p.add_argument("--tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--topk", type=int, default=8, help="routes per token (default 8, at most the expert count)")
    p.add_argument("--layer", type=int, help="layer to run (default: the first)")
    p.add_argument("--duration", type=float, default=5.0, help="seconds measured per (shards, concurrency) (default 5)")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of warm-up before each measurement (default 1)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of one forward in seconds (default 60)")
    p.add_argument("--transport", default="stream", choices=("stream", "unary"),
                   help="AsyncShardedExpertClient transport: one ForwardStream per shard (default) or a Forward call per sub-request")
    p.add_argument("--client-procs", type=int, default=1,
                   help="load-generator processes per row, each with its own client, sharing the concurrency (default 1)")
    p.add_argument("--client-threads", type=int, default=1,
                   help="torch intra-op threads of each load-generator process (default 1; 0: torch's, one per core). "
                        "The client's split and combine are small tensor ops; full OpenMP pools in several load "
                        "processes spin on the cores the shard servers need (H200, 2 shards, C=8, 4 load processes: "
                        "447 tokens/s with torch's default, 49k with 1; bench/results/2026-12-02-expert-parallel-6-h200.md)")
    p.add_argument("--server-threads", type=int, help="OMP_NUM_THREADS of each server process (default: inherited); "
                   "on a small CPU machine use 1, or the processes' spinning threads starve each other")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `lutb serve` flag (repeatable), e.g. --serve-arg=--max-wait-us=200")
    p.add_argument("--work-dir", type=Path, help="where checkpoints and shards go (default: a temporary directory, removed after)")
    p.add_argument("--machine", default="", help="free text describing the machine, recorded in the report")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, round(q / 100 * (len(values) - 1)))]


async def _drive(targets: list[str], layer: int, batches: list[tuple[torch.Tensor, ...]], concurrency: int,
                 warmup: float, duration: float, timeout: float, transport: str) -> dict[str, Any]:
    async with AsyncShardedExpertClient(targets, timeout=timeout, transport=transport) as client:
        latencies: list[float] = []
        errors: dict[str, int] = {}
        measuring = False
        stop_at = 0.0

        async def worker(index: int) -> None:
            i = index
            while time.monotonic() < stop_at:
                x, ids, w = batches[i % len(batches)]
                i += 1
                start = time.perf_counter()
                try:
                    await client.forward(layer, x, ids, w)
                except ExpertServiceError as exc:
                    if measuring:
                        errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    continue
                if measuring:
                    latencies.append(time.perf_counter() - start)

        stop_at = time.monotonic() + warmup
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        client.reset_stats()
        measuring = True
        began = time.perf_counter()
        stop_at = time.monotonic() + duration
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - began
        stats = client.stats()
    shard_stats = [
        {"target": s.target, "requests": s.requests, "tokens": s.tokens, "p50_ms": s.latency_p50_ms, "p99_ms": s.latency_p99_ms,
         "server_queue_p50_ms": s.server_queue_p50_ms, "server_compute_p50_ms": s.server_compute_p50_ms,
         "server_total_p50_ms": s.server_total_p50_ms}
        for s in stats.shards
    ]
    return _row(concurrency, latencies, errors, elapsed, int(batches[0][0].shape[0]),
                sum(s.requests for s in stats.shards) / max(stats.calls, 1), shard_stats)


def _row(concurrency: int, latencies: list[float], errors: dict[str, int], elapsed: float, tokens: int,
         shard_requests_per_call: float, shard_stats: list[dict[str, Any]]) -> dict[str, Any]:
    """One report row from a measurement window's forward latencies (seconds) and per-shard stats."""
    return {
        "concurrency": concurrency,
        "requests": len(latencies),
        "errors": errors,
        "seconds": elapsed,
        "latency_p50_ms": _percentile(latencies, 50) * 1e3,
        "latency_p99_ms": _percentile(latencies, 99) * 1e3,
        "latency_mean_ms": (sum(latencies) / len(latencies) * 1e3) if latencies else float("nan"),
        "latencies_s": latencies,
        "requests_per_s": len(latencies) / elapsed,
        "tokens_per_s": len(latencies) * tokens / elapsed,
        "shard_requests_per_call": shard_requests_per_call,
        "shard_stats": shard_stats,
    }


def _child(drive_args: tuple[Any, ...], client_threads: int | None, barrier: Any, results: Any) -> None:
    """One load-generator process of ``--client-procs``: waits for the others, then runs :func:`_drive`."""
    if client_threads:
        torch.set_num_threads(client_threads)
    try:
        barrier.wait(300)
        results.put(asyncio.run(_drive(*drive_args)))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent, which would otherwise wait
        results.put({"failed": f"{type(exc).__name__}: {exc}"})


def _drive_procs(procs: int, targets: list[str], layer: int, batches: list[tuple[torch.Tensor, ...]], concurrency: int,
                 warmup: float, duration: float, timeout: float, transport: str, client_threads: int | None) -> dict[str, Any]:
    """:func:`_drive` with ``concurrency`` spread over ``procs`` spawned processes (grpc and fork do not mix)."""
    import multiprocessing as mp

    shares = [concurrency // procs + (1 if j < concurrency % procs else 0) for j in range(procs)]
    shares = [c for c in shares if c > 0]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(len(shares))
    results = ctx.Queue()
    children = [ctx.Process(target=_child, args=((targets, layer, batches, c, warmup, duration, timeout, transport),
                                                 client_threads, barrier, results), daemon=True) for c in shares]
    for child in children:
        child.start()
    try:
        parts = [results.get(timeout=300 + warmup + duration + timeout) for _ in children]
    finally:
        for child in children:
            child.join(30)
            if child.is_alive():
                child.kill()
    failed = [p["failed"] for p in parts if "failed" in p]
    if failed:
        raise RuntimeError(f"a load-generator process failed: {failed[0]}")
    return _merge(parts, concurrency, int(batches[0][0].shape[0]))


def _merge(parts: list[dict[str, Any]], concurrency: int, tokens: int) -> dict[str, Any]:
    """One row from the rows of several load processes measured over the same window."""
    def median(values: list[float]) -> float:
        return _percentile(values, 50)

    latencies = [x for p in parts for x in p["latencies_s"]]
    elapsed = max(p["seconds"] for p in parts)
    errors: dict[str, int] = {}
    for p in parts:
        for code, n in p["errors"].items():
            errors[code] = errors.get(code, 0) + n
    shard_stats = []
    for per_shard in zip(*(p["shard_stats"] for p in parts)):
        merged = {"target": per_shard[0]["target"], "requests": sum(s["requests"] for s in per_shard),
                  "tokens": sum(s["tokens"] for s in per_shard)}
        for key in ("p50_ms", "p99_ms", "server_queue_p50_ms", "server_compute_p50_ms", "server_total_p50_ms"):
            merged[key] = median([s[key] for s in per_shard])
        shard_stats.append(merged)
    calls = sum(p["requests"] for p in parts)
    row = _row(concurrency, latencies, errors, elapsed, tokens,
               sum(p["shard_requests_per_call"] * p["requests"] for p in parts) / max(calls, 1), shard_stats)
    row["client_procs"] = len(parts)
    return row


def _shard_dirs(checkpoint: Checkpoint, shards: int, work: Path) -> list[Path]:
    if shards == 1:
        return [checkpoint.path]
    out = work / f"shards-{shards}"
    if (out / "shards.json").exists():
        return [out / f"shard-{s}" for s in range(shards)]
    plan = {layer: contiguous_placement(checkpoint.expert_ids(layer).tolist(), shards) for layer in checkpoint.layers}
    return write_shards(checkpoint, out, plan, overwrite=True)


def _git_commit() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, check=True).stdout.strip()
        return commit + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _per_shard(row: dict[str, Any], key: str) -> str:
    return " / ".join(f"{s[key]:.2f}" for s in row["shard_stats"])


def _server_split(row: dict[str, Any]) -> str:
    return " ; ".join(f"{s['server_queue_p50_ms']:.2f}/{s['server_compute_p50_ms']:.2f}/{s['server_total_p50_ms']:.2f}"
                      for s in row["shard_stats"])


def _markdown(meta: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    lines = ["# Expert-parallel serving benchmark", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += ["", "| shards | concurrency | requests | p50 ms | p99 ms | mean ms | req/s | tokens/s | shard calls/forward | shard p50 ms | shard p99 ms | server queue / compute / total p50 ms (per shard) | errors |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        errors = ", ".join(f"{n} {c}" for c, n in sorted(r["errors"].items())) or "0"
        lines.append(f"| {r['shards']} | {r['concurrency']} | {r['requests']} | {r['latency_p50_ms']:.2f} | {r['latency_p99_ms']:.2f} | "
                     f"{r['latency_mean_ms']:.2f} | {r['requests_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['shard_requests_per_call']:.2f} | {_per_shard(r, 'p50_ms')} | {_per_shard(r, 'p99_ms')} | {_server_split(r)} | {errors} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client_threads:
        torch.set_num_threads(args.client_threads)
    args.out.mkdir(parents=True, exist_ok=True)
    temp = None
    work = args.work_dir
    if work is None:
        temp = tempfile.mkdtemp(prefix="lutb-ep-bench-")
        work = Path(temp)
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.checkpoint is not None:
            checkpoint = Checkpoint(args.checkpoint)
        else:
            path = work / f"synthetic-l{args.layers}-e{args.experts}-h{args.hidden}-i{args.intermediate}-{args.activation}-{args.dtype}"
            if not any(path.glob("*.safetensors")):
                print(f"writing a synthetic checkpoint (random tiles) to {path}", file=sys.stderr)
                make_tiny_checkpoint(path, layers=tuple(range(args.layers)), num_experts=args.experts, hidden=args.hidden,
                                     intermediate=args.intermediate, activation=args.activation, dtype=args.dtype, seed=args.seed)
            checkpoint = Checkpoint(path)
        config = checkpoint.config
        layer = args.layer if args.layer is not None else checkpoint.layers[0]
        topk = min(args.topk, config.num_experts)
        gen = torch.Generator().manual_seed(args.seed)
        batches = []
        for _ in range(8):
            weights, ids = softmax_topk(torch.randn(args.tokens, config.num_experts, generator=gen), topk)
            x = torch.randn(args.tokens, config.hidden_size, generator=gen).to(config.torch_dtype)
            batches.append((x, ids, weights))
        rows: list[dict[str, Any]] = []
        for shards in args.shards:
            dirs = _shard_dirs(checkpoint, shards, work)
            procs = [
                ServeProcess("--checkpoint", str(d), "--backend", args.backend, "--device", args.device[i % len(args.device)],
                             "--no-validate-checkpoint", *args.serve_arg,
                             env={"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else None)
                for i, d in enumerate(dirs)
            ]
            starts = [0] * len(procs)  # server log lines at SERVING: what comes after was logged under load
            try:
                for proc in procs:
                    proc.wait_ready(600)
                starts = [len(p.lines) for p in procs]
                targets = [p.address for p in procs]
                for concurrency in args.concurrency:
                    if args.client_procs > 1:
                        row = _drive_procs(args.client_procs, targets, layer, batches, concurrency, args.warmup, args.duration,
                                           args.timeout, args.transport, args.client_threads)
                    else:
                        row = asyncio.run(_drive(targets, layer, batches, concurrency, args.warmup, args.duration, args.timeout,
                                                args.transport))
                    row.pop("latencies_s")
                    row["shards"] = shards
                    rows.append(row)
                    print(f"shards {shards} concurrency {concurrency}: p50 {row['latency_p50_ms']:.2f} ms  "
                          f"p99 {row['latency_p99_ms']:.2f} ms  {row['tokens_per_s']:.0f} tokens/s", file=sys.stderr)
            finally:
                for proc in procs:
                    proc.stop()
                with (args.out / "servers.log").open("a") as log:
                    for i, proc in enumerate(procs):
                        log.write(f"==== shards={shards} shard {i} ({proc.address}); lines after start-up: "
                                  f"{len(proc.lines) - starts[i]}\n")
                        log.writelines(proc.lines)
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    device_name = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or platform.machine()
    meta = {
        "date": dt.date.today().isoformat(),
        "machine": args.machine or platform.node(),
        "device": f"{device_name} (lutb serve --device {' '.join(args.device)}, --backend {args.backend})",
        "torch": torch.__version__,
        "git commit": _git_commit(),
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "checkpoint": f"{checkpoint.path} (H={config.hidden_size}, I={config.intermediate_size}, E={config.num_experts}, "
                      f"{config.activation}, {config.dtype})" if args.checkpoint else
                      f"synthetic random tiles (H={config.hidden_size}, I={config.intermediate_size}, E={config.num_experts}, "
                      f"{config.activation}, {config.dtype})",
        "server threads": args.server_threads or "inherited",
        "client threads": torch.get_num_threads(),
        "client processes": args.client_procs,
        "workload": f"layer {layer}, {args.tokens} tokens/request, top-{topk}, {args.duration:g} s per row after {args.warmup:g} s warm-up, "
                    f"AsyncShardedExpertClient (transport {args.transport})",
    }
    (args.out / "expert_parallel.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    (args.out / "expert_parallel.md").write_text(_markdown(meta, rows))
    print(f"wrote {args.out / 'expert_parallel.md'} and {args.out / 'expert_parallel.json'}")
    print(f"{'shards':>6} {'conc':>5} {'p50 ms':>9} {'p99 ms':>9} {'tokens/s':>10}")
    for r in rows:
        print(f"{r['shards']:>6} {r['concurrency']:>5} {r['latency_p50_ms']:>9.2f} {r['latency_p99_ms']:>9.2f} {r['tokens_per_s']:>10.0f}")
    return 0 if not any(r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
