#!/usr/bin/env python
"""Serving overhead on the CPU: the real server around a fake backend that only sleeps.

``bench/serving.py`` needs a GPU to say anything about the server's own cost; this script
isolates that cost anywhere. The server (``ExpertServer``: servicer, interceptors, metrics,
scheduler, compute worker) runs in its own process on a checkpoint whose layer is served by
``lutb_server.testing.SleepExperts`` (``--backend lutb_server.testing:SleepExperts``): ``forward``
sleeps ``base_us + per_token_us * T`` (``time.sleep`` releases the GIL, as a wait on the GPU does)
and returns zeros of the right shape. The default sleep (350 us + 4 us/token) is about what the
packed backend takes for one qwen3 layer on an H200 (``bench/results/2026-12-02-serving-h200.md``,
in-process column). Being a backend like the others, it also runs in a compute process
(``--compute-worker process``, ``--front-ends N``).

Closed-loop callers (unary ``Forward``, or with ``--api stream`` one ``ForwardStream`` each with one
request in flight; bytes in and out, no client-side decoding beyond ``timing``; ``bench/serving.py``'s
load loop) run in ``--load-procs`` other processes at each concurrency and tokens per request; a bare
grpc.aio echo server answering the same sizes with the same API gives the transport floor.
Per cell it prints:

- p50/p99 latency, tokens/s, median and mean batch tokens formed (``timing.batch_tokens``);
- ``compute``: median ``timing.compute_us`` (the worker's time for the request's batch,
  the sleep's own overshoot included);
- ``overhead``: median(latency - compute_us) - echo p50: what the server adds per request
  beyond compute and bare gRPC (the issue's C=1 target is overhead <= 150 us);
- ``hand-off``: median ``timing.handoff_us`` (the batch's hops to the worker and back, less compute);
- ``handler``: median ``timing.total_us - compute_us - queue_us - handoff_us`` (decode, validate,
  encode, resuming the request's coroutine), and of it ``prepare`` (``timing.prepare_us``: decode and
  validation) and ``encode`` (``timing.encode_us``);
- ``server CPU us/req``: CPU time of the server per answered request (its compute process and
  front ends included), from ``/proc`` (per thread in the JSON/log: ``main`` is the serving
  process's event loop, ``pid N/...`` a child's thread) -- robust on a busy machine;
  ``loop CPU us/req`` is the event loop thread's share;
- ``echo CPU us/req`` and ``echo loop CPU us/req``: the same for the echo server during its run
  (gRPC's own cost per request of these sizes: what the server's figures cannot go below);
- ``ideal tok/s``: back-to-back batches of the formed size (``T_b / sleep(T_b)``) and the
  ratio (the C=64 target is >= 80%).

    python bench/serving_overhead.py                                  # C=1,8,64 x T=1,16, ~1 min
    python bench/serving_overhead.py --concurrency 1,64 --tokens 16 --profile --out /tmp/ovh

The server runs with ``intra_op_threads`` 1 (``--intra-op-threads``), what it uses on a CUDA device.

The numbers depend on the machine's free cores: server, echo server and load generators
share them (say so when recording results).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving as _serving  # noqa: E402 - the sibling benchmark's helpers (server and echo children, load loop, /proc)

from lutb_server.testing import SLEEP_EXPERTS_ENV  # noqa: E402


# ----------------------------------------------------------------------------- load generator (other processes)


def run_load(pool: _serving.LoadPool, kind: str, target: str, payloads: list[bytes], concurrency: int,
             warmup_s: float, duration_s: float, api: str = "unary", connections: int = 1) -> dict[str, Any]:
    """One measurement over the pool's processes (``bench/serving.py``'s load loop; ``api``: unary or stream).

    ``rows``: per request answered inside the window, ``(latency s, batch tokens, compute, queue, total, hand-off,
    prepare, encode, wait us)`` from the response's ``timing`` (zeros but the latency for the echo).
    """
    parts = pool.gather(concurrency, {"kind": kind, "target": target, "payloads": payloads, "tokens": 0,
                                      "warmup_s": warmup_s, "duration_s": duration_s, "api": api, "connections": connections})
    rows: list[tuple[float, ...]] = []
    for p in parts:  # the load loop appends a response's latency and its timing fields together: zip pairs them
        if kind == "expert":
            rows += zip(p["latencies"], p["batch_tokens"], p["compute_us"], p["queue_us"], p["total_us"],
                        p["handoff_us"], p["prepare_us"], p["encode_us"], p["wait_us"])
        else:
            rows += [(latency, 0, 0, 0, 0, 0, 0, 0, 0) for latency in p["latencies"]]
    return {"rows": rows, "answered": sum(p["answered"] for p in parts),
            "errors": [e for p in parts for e in p["errors"]][:5],
            "request_bytes": parts[0]["sizes"]["request"], "response_bytes": max(p["sizes"]["response"] for p in parts)}


# ----------------------------------------------------------------------------- the run


def _make_checkpoint(root: Path, hidden: int, experts: int) -> Path:
    from lutb_server.testing import make_tiny_checkpoint

    path = root / f"overhead-h{hidden}-e{experts}"
    if not any(path.glob("*.safetensors")):
        make_tiny_checkpoint(path, layers=(0,), num_experts=experts, hidden=hidden, intermediate=128)
    return path


def _payloads(hidden: int, experts: int, top_k: int, tokens: int) -> list[bytes]:
    import torch

    from lutb_client.client import build_request

    gen = torch.Generator().manual_seed(tokens)
    out = []
    for i in range(8):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
        w = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
        out.append(build_request(0, x, ids, w, request_id=i + 1).SerializeToString())
    return out


def _thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds so far per thread of process ``pid`` and its children (a compute process, front ends): the
    process's own threads by name (``main``: its event loop), a child's as ``pid N/name``."""
    return {key.removeprefix("root/"): seconds for key, seconds in _serving.thread_cpu_s(_serving.process_tree(pid)).items()}


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` and its children (all their threads) so far."""
    return sum(_thread_cpu_s(pid).values())


def _median(values: list[float]) -> float:
    return _serving._pct(values, 0.5)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    out: Path = args.out
    ckpt = _make_checkpoint(out / "checkpoints", args.hidden, args.experts)
    port, echo_port = _serving._free_port(), _serving._free_port()
    config = {"checkpoint": str(ckpt), "backend": "lutb_server.testing:SleepExperts", "device": "cpu", "host": "127.0.0.1",
              "port": port, "metrics_port": 0, "validate_checkpoint": False, "max_wait_us": args.max_wait_us,
              "max_batch_tokens": args.max_batch_tokens, "max_queue_requests": 4096, "shutdown_grace_s": 2,
              "cuda_graph_max_tokens": 0, "intra_op_threads": args.intra_op_threads,
              "gil_switch_interval_us": args.switch_interval_us, "event_loop": args.event_loop,
              "compute_worker": args.compute_worker, "front_ends": args.front_ends,
              "cpu_wakeup_latency_us": args.cpu_wakeup_latency_us}
    os.environ[SLEEP_EXPERTS_ENV] = f"{args.base_us},{args.per_token_us},{args.launches}"  # the server's and its children's
    server = _serving._spawn_child(["serve", json.dumps(config)], out / "server.log")
    echo = _serving._spawn_child(["echo", str(echo_port), args.event_loop], out / "echo.log")
    pool = _serving.LoadPool(max(1, min(args.load_procs, max(args.concurrency))))
    profiler = None
    rows: list[dict[str, Any]] = []
    try:
        _serving._wait_port(echo_port)
        _serving._wait_serving(f"127.0.0.1:{port}", server, 120)
        if args.profile:
            profiler = _serving.Profiler(out, "overhead", native=args.profile == "native")
            if not profiler.py_spy:
                print("[overhead] --profile needs py-spy on PATH; not profiling", flush=True)
            profiler.attach(server.pid)
        sleep_us = lambda t: args.base_us + args.per_token_us * t  # noqa: E731
        for tokens in args.tokens:
            payloads = _payloads(args.hidden, args.experts, args.top_k, tokens)
            for c in args.concurrency:
                cpu0, threads0 = _cpu_s(server.pid), _thread_cpu_s(server.pid)
                res = run_load(pool, "expert", f"127.0.0.1:{port}", payloads, c, args.warmup_s, args.duration_s, args.api,
                               connections=args.front_ends)
                cpu = _cpu_s(server.pid) - cpu0  # warm-up included: divided by all requests answered meanwhile
                threads = {k: v - threads0.get(k, 0.0) for k, v in _thread_cpu_s(server.pid).items()}
                echo_cpu0, echo_main0 = _cpu_s(echo.pid), _thread_cpu_s(echo.pid).get("main", 0.0)
                echo_res = run_load(pool, "echo", f"127.0.0.1:{echo_port}",
                                    _serving.echo_payloads(res["request_bytes"], res["response_bytes"]), c,
                                    args.warmup_s / 2, args.duration_s, args.api)
                echo_cpu = _cpu_s(echo.pid) - echo_cpu0
                echo_main = _thread_cpu_s(echo.pid).get("main", 0.0) - echo_main0
                lat = [r[0] * 1e6 for r in res["rows"]]
                batch = [float(r[1]) for r in res["rows"]]
                overhead = [r[0] * 1e6 - r[2] for r in res["rows"]]
                handler = [float(r[4] - r[2] - r[3] - r[5]) for r in res["rows"]]
                echo_p50 = _median([r[0] * 1e6 for r in echo_res["rows"]])
                formed = _median(batch) if batch else float(tokens)
                ideal = formed / (sleep_us(formed) / 1e6)
                row = {"api": args.api, "concurrency": c, "tokens": tokens, "requests": len(lat), "p50_us": _median(lat),
                       "p99_us": _serving._pct(lat, 0.99), "tokens_per_s": len(lat) * tokens / args.duration_s,
                       "batch_tokens_p50": formed, "batch_tokens_mean": sum(batch) / max(1, len(batch)),
                       "sleep_us": sleep_us(formed), "echo_p50_us": echo_p50,
                       "overhead_us": _median(overhead) - echo_p50, "handler_us": _median(handler),
                       "handoff_us": _median([float(r[5]) for r in res["rows"]]),
                       "wait_us": _median([float(r[8]) for r in res["rows"]]),
                       "prepare_us": _median([float(r[6]) for r in res["rows"]]),
                       "encode_us": _median([float(r[7]) for r in res["rows"]]),
                       "compute_us_p50": _median([float(r[2]) for r in res["rows"]]),
                       "cpu_us_per_request": cpu * 1e6 / max(1, res["answered"]),
                       "thread_cpu_us_per_request": {k: round(v * 1e6 / max(1, res["answered"])) for k, v in threads.items() if v > 0},
                       "echo_cpu_us_per_request": echo_cpu * 1e6 / max(1, echo_res["answered"]),
                       "echo_main_cpu_us_per_request": echo_main * 1e6 / max(1, echo_res["answered"]),
                       "ideal_tokens_per_s": ideal, "errors": res["errors"]}
                row["ratio"] = row["tokens_per_s"] / ideal
                rows.append(row)
                print(f"[overhead] C={c} T={tokens}: p50 {row['p50_us']:.0f} us, {row['tokens_per_s']:.0f} tok/s "
                      f"({row['ratio']:.0%} of ideal), batch p50 {formed:.0f} mean {row['batch_tokens_mean']:.1f}, "
                      f"overhead {row['overhead_us']:.0f} us, server CPU {row['cpu_us_per_request']:.0f} us/request "
                      f"{row['thread_cpu_us_per_request']}; echo CPU {row['echo_cpu_us_per_request']:.0f} us/request "
                      f"(main {row['echo_main_cpu_us_per_request']:.0f})" + (f", errors {res['errors']}" if res["errors"] else ""),
                      flush=True)
    finally:
        if profiler is not None and profiler.py_spy and server.poll() is None:
            print(f"[overhead] profile: {profiler.detach()}", flush=True)
        pool.close()
        _serving._stop_child(server)
        _serving._stop_child(echo)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| C | T | p50 us | p99 us | tok/s | batch p50 | batch mean | compute us | echo p50 us | overhead us "
             "| hand-off (wait) us | handler us | prepare us | encode us | server CPU us/req | loop CPU us/req | echo CPU us/req | echo loop CPU us/req "
             "| ideal tok/s | tok/s / ideal |", "|" + "---|" * 20]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['tokens']} | {r['p50_us']:.0f} | {r['p99_us']:.0f} | {r['tokens_per_s']:.0f} "
                     f"| {r['batch_tokens_p50']:.0f} | {r['batch_tokens_mean']:.1f} | {r['compute_us_p50']:.0f} | {r['echo_p50_us']:.0f} "
                     f"| {r['overhead_us']:.0f} | {r['handoff_us']:.0f} ({r['wait_us']:.0f}) | {r['handler_us']:.0f} | {r['prepare_us']:.0f} "
                     f"| {r['encode_us']:.0f} | {r['cpu_us_per_request']:.0f} | {r['thread_cpu_us_per_request'].get('main', 0)} "
                     f"| {r['echo_cpu_us_per_request']:.0f} | {r['echo_main_cpu_us_per_request']:.0f} "
                     f"| {r['ideal_tokens_per_s']:.0f} | {r['ratio']:.0%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    raw = sys.argv[1:] if argv is None else argv
    from typing import get_args

    from lutb_server.event_loop import EventLoopKind

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=None, help="directory for logs, checkpoint, overhead.json/.md (default: a temp dir)")
    p.add_argument("--base-us", type=float, default=350.0, help="fake backend: sleep per experts call")
    p.add_argument("--per-token-us", type=float, default=4.0, help="fake backend: extra sleep per token")
    p.add_argument("--launches", type=int, default=0,
                   help="fake backend: small torch ops (GIL held) per experts call before the sleep, like kernel launches")
    p.add_argument("--switch-interval-us", type=int, default=0,
                   help="the server's gil_switch_interval_us (default 0: the server's default on a CPU device, Python's 5000)")
    p.add_argument("--compute-worker", default="thread", choices=("thread", "process"), help="server setting")
    p.add_argument("--front-ends", type=int, default=1, help="server setting (needs --compute-worker process)")
    p.add_argument("--cpu-wakeup-latency-us", type=int, default=None,
                   help="server setting cpu_wakeup_latency_us (default: unset, the machine's idle states); the server "
                        "holds it while it runs, the echo's runs included")
    p.add_argument("--event-loop", default="uvloop", choices=get_args(EventLoopKind),
                   help="the server's and the echo server's event loop (the server setting event_loop)")
    p.add_argument("--api", default="unary", choices=("unary", "stream"),
                   help="unary Forward calls, or one ForwardStream per caller with one request in flight (the echo likewise)")
    p.add_argument("--concurrency", default="1,8,64")
    p.add_argument("--tokens", default="1,16")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--duration-s", type=float, default=3.0)
    p.add_argument("--warmup-s", type=float, default=0.5)
    p.add_argument("--max-wait-us", type=int, default=0, help="server setting (default 0, the server default)")
    p.add_argument("--max-batch-tokens", type=int, default=8192)
    p.add_argument("--load-procs", type=int, default=2)
    p.add_argument("--intra-op-threads", type=int, default=1,
                   help="server setting; default 1, what the server uses on a CUDA device (0: torch's default, as on a CPU device)")
    p.add_argument("--profile", nargs="?", const="python", choices=["python", "native"], default=None,
                   help="py-spy the server during the run (needs py-spy on PATH; 'native': C frames too)")
    args = p.parse_args(raw)
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.tokens = [int(t) for t in args.tokens.split(",")]
    from lutb_client.allocator import tune_malloc

    args.malloc = tune_malloc()  # the server, echo and load processes each apply the same (lutb_client.allocator)
    temp = None
    if args.out is None:
        temp = args.out = Path(tempfile.mkdtemp(prefix="lutb-overhead-"))
    args.out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = measure(args)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    (args.out / "overhead.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    md = table(rows)
    (args.out / "overhead.md").write_text(md + "\n")
    print()
    print(md, flush=True)
    if temp is not None:
        shutil.rmtree(temp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
