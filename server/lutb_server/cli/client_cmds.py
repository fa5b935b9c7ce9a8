"""Client-side commands: ``lutb info`` and ``lutb bench`` against a running server.

Exit codes: 0 success; 2 the server could not be reached or refused. (``lutb check``
and ``lutb record`` live in :mod:`lutb_server.cli.check_cmd`.)
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lutb_server.cli._args import positive_float, positive_int

EXIT_OK = 0
EXIT_ERROR = 2


def register(subparsers: argparse._SubParsersAction) -> None:
    info = subparsers.add_parser("info", help="print a server's ModelInfo", description="Print TARGET's ModelInfo.")
    info.add_argument("target", metavar="TARGET", help="server address host:port")
    info.add_argument("--json", action="store_true", help="print it as JSON")
    info.add_argument("--timeout", type=positive_float, default=10.0, help="seconds (default: 10)")
    info.set_defaults(run=run_info)

    bench = subparsers.add_parser(
        "bench", help="load a server with random routed batches and report latency and throughput",
        description="Send random routed batches to TARGET from CONCURRENCY concurrent callers; print latency "
                    "percentiles, requests/s, tokens/s and the server's own queue/compute split.",
    )
    bench.add_argument("target", metavar="TARGET", help="server address host:port")
    bench.add_argument("--concurrency", type=positive_int, default=4, help="requests in flight (default: 4)")
    bench.add_argument("--tokens", type=positive_int, default=32, help="tokens per request (default: 32)")
    bench.add_argument("--topk", type=positive_int, default=4, help="routes per token, capped at the expert count (default: 4)")
    bench.add_argument("--layer", type=int, default=None, help="layer to call (default: the server's first)")
    group = bench.add_mutually_exclusive_group()
    group.add_argument("--count", type=positive_int, default=None, help="requests to send (default: 200)")
    group.add_argument("--duration", type=positive_float, default=None, help="seconds to run instead of a count")
    bench.add_argument("--stream", action="store_true", help="send over ForwardStream sessions instead of unary calls")
    bench.add_argument("--connections", type=positive_int, default=None,
                       help="TCP connections, evened out over the server's front ends (default: one per front end)")
    bench.add_argument("--timeout", type=positive_float, default=60.0, help="deadline of each call in seconds (default: 60)")
    bench.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    bench.set_defaults(run=run_bench)


def random_batch(tokens: int, hidden: int, num_experts: int, topk: int, dtype: Any, gen: Any) -> tuple[Any, Any, Any]:
    """Standard-normal hidden states and softmax-top-k routes to distinct experts."""
    import torch

    from lutb_client.routing import softmax_topk

    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=gen)
    weights, ids = softmax_topk(logits, min(topk, num_experts))
    return x, ids, weights


def _model_dtype(info: Any) -> Any:
    from lutb_client.codec import to_torch_dtype

    return to_torch_dtype(info.dtype)


def _model_info_json(info: Any) -> str:
    """``ModelInfo`` as JSON for scripts: every field, zeros and empty strings included, named as in the
    proto, and 64-bit integers as JSON numbers (the proto3 JSON mapping writes them as strings)."""
    from google.protobuf import json_format

    data = json_format.MessageToDict(info, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for field in info.DESCRIPTOR.fields:
        if field.type in (field.TYPE_INT64, field.TYPE_UINT64) and isinstance(data.get(field.name), str):
            data[field.name] = int(data[field.name])
    return json.dumps(data, indent=2)


def run_info(args: argparse.Namespace) -> int:
    from lutb_client.client import ExpertClient
    from lutb_client.codec import dtype_name
    from lutb_client.errors import ExpertServiceError

    try:
        with ExpertClient(args.target, timeout=args.timeout, retries=0) as client:
            info = client.model_info()
    except ExpertServiceError as exc:
        print(f"lutb info: {args.target}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(_model_info_json(info))
        return EXIT_OK
    rows = [
        ("format", f"{info.format} v{info.format_version}"),
        ("hidden_size", info.hidden_size),
        ("intermediate_size", info.intermediate_size),
        ("num_experts", info.num_experts),
        ("activation", info.activation),
        ("dtype", dtype_name(info.dtype)),
        ("mxfp8_scale_mode", info.mxfp8_scale_mode),
        ("backend", info.backend),
        ("backend_reason", info.backend_reason),
        ("device", info.device),
        ("max_tokens_per_request", info.max_tokens_per_request),
        ("max_top_k", info.max_top_k or "not said (an older server)"),
        ("max_batch_tokens", info.max_batch_tokens),
        ("max_message_bytes", info.max_message_bytes or "not said (an older server)"),
        ("content_hash", info.content_hash),
        ("server_version", info.server_version),
        ("front_end", f"{info.front_end} of {info.front_ends}"),
        ("instance_id", info.instance_id or "not said (an older server)"),
    ]
    for layer in info.layers:
        rows.append((f"layer {layer.layer}", f"{len(layer.expert_ids)} experts: {_ranges(list(layer.expert_ids))}"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return EXIT_OK


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    parts, start = [], None
    for i, v in enumerate(ids):
        if start is None:
            start = v
        if i + 1 == len(ids) or ids[i + 1] != v + 1:
            parts.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ",".join(parts)


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[index]


def run_bench(args: argparse.Namespace) -> int:
    import asyncio

    from lutb_client.allocator import tune_malloc
    from lutb_client.errors import ExpertServiceError

    tune_malloc()  # large requests must not pay page faults on this side (the server does the same)
    try:
        return asyncio.run(_bench(args))
    except ExpertServiceError as exc:
        print(f"lutb bench: {args.target}: {exc}", file=sys.stderr)
        return EXIT_ERROR


async def _bench(args: argparse.Namespace) -> int:
    import asyncio
    import time

    import torch
    from tqdm import tqdm

    from lutb_client.client import AsyncExpertClient, ForwardResult
    from lutb_client.errors import ExpertServiceError

    count = args.count if args.count is not None or args.duration is not None else 200
    async with AsyncExpertClient(args.target, timeout=args.timeout) as probe:
        info = await probe.model_info()
    connections = args.connections or max(1, info.front_ends)  # default one per front end: calls stay on theirs
    async with AsyncExpertClient(args.target, timeout=args.timeout, connections=connections) as client:
        fronts = await client.spread_connections()
        layer = args.layer if args.layer is not None else info.layers[0].layer
        dtype = _model_dtype(info)
        gen = torch.Generator().manual_seed(args.seed)
        pool = [random_batch(args.tokens, info.hidden_size, info.num_experts, args.topk, dtype, gen) for _ in range(8)]
        latencies: list[float] = []
        results: list[ForwardResult] = []
        errors: dict[str, int] = {}
        sent = 0
        stop_at = time.monotonic() + args.duration if args.duration is not None else None
        bar = tqdm(total=count if stop_at is None else None, unit="req", desc="bench", file=sys.stderr)

        def more() -> bool:
            nonlocal sent
            if stop_at is not None:
                ok = time.monotonic() < stop_at
            else:
                ok = sent < count
            if ok:
                sent += 1
            return ok

        async def worker(index: int) -> None:
            session = client.stream() if args.stream else None
            try:
                i = index
                while more():
                    x, ids, w = pool[i % len(pool)]
                    i += 1
                    start = time.perf_counter()
                    try:
                        if session is not None:
                            result = await session.forward(layer, x, ids, w, detailed=True)
                        else:
                            result = await client.forward_detailed(layer, x, ids, w)
                    except ExpertServiceError as exc:
                        errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                    else:
                        latencies.append(time.perf_counter() - start)
                        results.append(result)
                    bar.update(1)
            finally:
                if session is not None:
                    await session.close()

        began = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - began
        bar.close()

    lat = sorted(latencies)
    ok = len(lat)
    print(f"target {args.target}  layer {layer}  backend {info.backend} on {info.device}  "
          f"{'stream' if args.stream else 'unary'}  concurrency {args.concurrency}  tokens/request {args.tokens}  "
          f"top-k {min(args.topk, info.num_experts)}")
    print(f"connections: {connections}, on front end(s) {' '.join(str(f) for f in fronts)} of {max(1, info.front_ends)}")
    print(f"requests: {ok} ok" + "".join(f", {n} {code}" for code, n in sorted(errors.items())) + f" in {elapsed:.2f}s")
    print(f"latency ms: p50 {_percentile(lat, 50) * 1e3:.2f}  p90 {_percentile(lat, 90) * 1e3:.2f}  "
          f"p99 {_percentile(lat, 99) * 1e3:.2f}")
    print(f"throughput: {ok / elapsed:.1f} requests/s  {ok * args.tokens / elapsed:.1f} tokens/s")
    if results:
        def mean(values: list[float]) -> float:
            return sum(values) / len(values)

        queue = mean([r.timing.queue_us for r in results]) / 1e3
        compute = mean([r.timing.compute_us for r in results]) / 1e3
        handoff = mean([r.timing.handoff_us for r in results]) / 1e3
        wait = mean([r.timing.wait_us for r in results]) / 1e3
        prepare = mean([r.timing.prepare_us for r in results]) / 1e3
        encode = mean([r.timing.encode_us for r in results]) / 1e3
        total = mean([r.timing.total_us for r in results]) / 1e3
        batch = mean([r.timing.batch_tokens for r in results])
        print(f"server (mean): prepare {prepare:.2f} ms  queue {queue:.2f} ms  compute {compute:.2f} ms  "
              f"hand-off {handoff:.2f} ms (to the call {wait:.2f})  encode {encode:.2f} ms  total {total:.2f} ms  "
              f"batch {batch:.1f} tokens")
    return EXIT_OK if not errors else EXIT_ERROR
