"""What a ``/metrics`` scrape of a server with several front ends costs the serving processes' event loops.

Every front end serves its registry on loopback, and the server's endpoint merges them
(``lutb_server.metrics_gateway``: in a process of its own since it was measured here to stall front end 0; before,
front end 0 merged them itself). This script builds N real ``ServerMetrics`` registries holding the per-layer series
of ``--layers`` layers (and ``--experts`` experts each with ``--expert-metrics``), serves them as the server does
(front ends 1..N-1 in processes of their own, front end 0 in this one), and scrapes the merged endpoint ``--scrapes``
times while an asyncio heartbeat (a 1 ms sleep in a loop) runs in front end 0's process, as its event loop would. It
reports, per scrape, the wall time, front end 0's CPU time, the heartbeat's longest gap (how long front end 0's
event loop could not run), and the CPU time of the process that merged the answers.

    python bench/metrics_scrape.py --front-ends 8 --layers 8
    python bench/metrics_scrape.py --front-ends 8 --layers 8 --expert-metrics --experts 256

Linux (reads /proc), CPU only; prints one markdown table row per configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import sys
import threading
import time
import urllib.request
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("kernels", "client", "server")]

from lutb_server.metrics import ServerMetrics  # noqa: E402
from lutb_server.metrics_gateway import MetricsGateway  # noqa: E402


def populated(layers: int, expert_metrics: bool, experts: int, seed: int) -> ServerMetrics:
    """A front end's registry with every per-layer series a serving run makes, for ``layers`` layers."""
    m = ServerMetrics(expert_metrics=expert_metrics)
    m.describe_backend(backend="packed", device="cuda:0", compute_capability="9.0", dtype="bfloat16",
                       activation="silu", content_hash="0" * 16, weight_bytes=1 << 30)
    for method in ("Forward", "ForwardStream", "GetModelInfo"):
        m.grpc_requests.labels("lutb.v1.ExpertService", method, "OK").inc(seed + 1)
        m.grpc_duration.labels("lutb.v1.ExpertService", method).observe(0.001)
        m.grpc_in_flight.labels("lutb.v1.ExpertService", method).set(0)
    for rpc in ("Forward", "ForwardStream"):
        m.forward_requests.labels(rpc, "OK").inc(seed + 1)
    for layer in map(str, range(layers)):
        for value in (0.0001, 0.001, 0.01):
            m.queue_wait.labels("packed", layer).observe(value)
            m.compute.labels("packed", layer).observe(value)
            m.handoff.labels("packed", layer, "to_call").observe(value)
            m.handoff.labels("packed", layer, "back").observe(value)
            m.batch_tokens.labels("packed", layer).observe(value * 1e5)
            m.batch_requests.labels("packed", layer).observe(value * 1e3)
        for path in ("graph", "chunks", "eager"):
            m.batches.labels("packed", layer, path).inc()
        m.tokens.labels("packed", layer).inc(1000)
        m.deadline_dropped.labels(layer).inc(0)
    if m.expert_load is not None:  # every expert held and routed to
        engine = SimpleNamespace(config=SimpleNamespace(num_experts=experts), layer_ids=list(range(layers)),
                                 expert_ids=lambda layer: list(range(experts)))
        for layer in range(layers):
            m.expert_load.record(engine, SimpleNamespace(layer=layer, topk_ids=torch.arange(experts).view(-1, 1)))
    return m


def _serve_front_end(k: int, layers: int, expert_metrics: bool, experts: int, ports: Connection) -> None:
    """Front end ``k`` (> 0) in a process of its own, as the server runs it: its registry on loopback."""
    ports.send(populated(layers, expert_metrics, experts, k).serve("127.0.0.1", 0))
    ports.recv()  # until told to stop


async def _heartbeat(stop: threading.Event, gaps: list[float]) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


def measure(front_ends: int, layers: int, expert_metrics: bool, experts: int, scrapes: int) -> dict[str, float]:
    ctx = mp.get_context("fork")
    pipes = [ctx.Pipe() for _ in range(1, front_ends)]
    others = [ctx.Process(target=_serve_front_end, args=(k, layers, expert_metrics, experts, theirs), daemon=True)
              for k, (_, theirs) in enumerate(pipes, 1)]
    for process in others:
        process.start()
    ports = [ours.recv() for ours, _ in pipes]
    zero = populated(layers, expert_metrics, experts, 0)
    gateway = MetricsGateway.start("127.0.0.1", 0, [zero.serve("127.0.0.1", 0)] + ports)
    url = f"http://127.0.0.1:{gateway.port}/metrics"
    urllib.request.urlopen(url).read()  # warm
    walls, cpus, merges, stalls, lines = [], [], [], [], 0
    for _ in range(scrapes):
        stop, gaps = threading.Event(), []
        loop_thread = threading.Thread(target=lambda: asyncio.run(_heartbeat(stop, gaps)))
        loop_thread.start()
        time.sleep(0.05)
        merge0, cpu0, t0 = _cpu_s(gateway.process.pid), resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        body = _scrape(url)
        t1, cpu1, merge1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF), _cpu_s(gateway.process.pid)
        time.sleep(0.02)
        stop.set()
        loop_thread.join()
        walls.append(t1 - t0)
        # the scraper (urllib, this process) reads and discards the answer: small next to the merge
        cpus.append(cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime)
        merges.append(merge1 - merge0)
        stalls.append(max(gaps))
        lines = body.count(b"\n")
    gateway.close()
    zero.close()
    for (ours, _), process in zip(pipes, others):
        ours.send("stop")
        process.join(10)
    return {"lines": lines, "wall_ms": 1e3 * statistics.median(walls), "cpu_ms": 1e3 * statistics.median(cpus),
            "merge_cpu_ms": 1e3 * statistics.median(merges), "stall_ms": 1e3 * statistics.median(stalls), "stall_max_ms": 1e3 * max(stalls)}


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _scrape(url: str) -> bytes:
    with urllib.request.urlopen(url) as answer:
        return answer.read()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--front-ends", type=int, default=8)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--expert-metrics", action="store_true")
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--scrapes", type=int, default=7)
    args = p.parse_args(argv)
    r = measure(args.front_ends, args.layers, args.expert_metrics, args.experts, args.scrapes)
    print("| front ends | layers | expert metrics | lines | scrape wall ms | front end 0 CPU ms | "
          "its loop's longest gap ms (median) | (max) | merging process CPU ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    experts = f"{args.experts} experts" if args.expert_metrics else "off"
    print(f"| {args.front_ends} | {args.layers} | {experts} | {r['lines']} | {r['wall_ms']:.1f} | {r['cpu_ms']:.1f} | "
          f"{r['stall_ms']:.1f} | {r['stall_max_ms']:.1f} | {r['merge_cpu_ms']:.0f} |")
    print(f"(cpus: {os.cpu_count()}, python {sys.version.split()[0]})")


if __name__ == "__main__":
    main()
