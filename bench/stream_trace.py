#!/usr/bin/env python
"""Where a lone streaming request's time goes on its way into and out of the server (one machine, one clock).

``bench/serving.py`` splits a request's latency into the server handler's parts and "outside" (everything between
the client's write and the handler's start, and between the handler's end and the client's read), and compares
that with a bare echo's round trip. This script splits "outside" itself: the client and the server run on one
machine, so ``time.monotonic()`` (CLOCK_MONOTONIC) is one clock for both, and each request's timestamps line up:

- ``in``: the client starts writing -> the server's ``ForwardStream`` reads the message;
- ``read->handler``: that read -> the handler's ``received`` (``ExpertServicer._stream_one`` starts);
- ``handler``: the handler's own time (``timing.total_us``: prepare, queue, compute, hand-off, encode);
- ``handler->yield``: the handler's end -> ``ForwardStream`` yields the response to gRPC;
- ``out``: that yield -> the client's read returns;
- ``yield->resume``: the yield -> gRPC resumes the generator (the send finished on the server's side).

The server is the real one (``lutb_server.app.serve``) in a child process, its servicer wrapped to take the
timestamps (a wrapper generator around ``ForwardStream``: a few microseconds of its own), with the fake backend
``lutb_server.testing:SleepExperts`` on the CPU (``--sleep-us``), or ``--checkpoint`` on a GPU. ``--canned``
answers every request with the first one's response (no decode, validation, batching or compute: the same gRPC
path with no work on it), and ``--echo`` runs a bare grpc.aio echo of the same sizes (raw bytes, no handler
work), whose ``in`` and ``out`` are the transport floor.

    python bench/stream_trace.py                       # the server (compute process, sleep 350 + 4/token us)
    python bench/stream_trace.py --canned              # the same server, canned answers
    python bench/stream_trace.py --echo                # the bare echo
    python bench/stream_trace.py --checkpoint CKPT --device cuda --backend packed     # on a GPU

Prints the medians over ``--requests`` (the first ``--warmup`` dropped) and the server's CPU per request by thread.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ECHO_METHOD = "/lutb.bench.Echo/EchoStream"
FORWARD_METHOD = "/lutb.v1.ExpertService/ForwardStream"


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of ``pid`` (``name:tid``), from /proc."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        out[f"{name}:{tid}"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _child_server(config: dict[str, Any], canned: bool, record: Path) -> None:
    """The real server with ForwardStream wrapped to take timestamps; writes them to ``record`` when stopped."""
    from lutb_server import event_loop
    from lutb_server import servicer as sv
    from lutb_server.app import serve
    from lutb_server.settings import ServerSettings

    stamps: dict[int, dict[str, float]] = {}
    forward = sv.ExpertServicer._forward
    first: list[Any] = []

    async def timed_forward(self: Any, request: Any, deadline: float | None, received: float) -> Any:
        if canned and first:
            response = sv.pb.ForwardResponse()
            response.CopyFrom(first[0])
            response.request_id = request.request_id
        else:
            response = await forward(self, request, deadline, received)
            first[:] = [response]
        stamps.setdefault(request.request_id, {}).update(handler=received, handler_end=time.monotonic())
        return response

    stream = sv.ExpertServicer.ForwardStream

    async def timed_stream(self: Any, request_iterator: Any, context: Any) -> Any:
        async def reads() -> Any:
            async for request in request_iterator:
                stamps.setdefault(request.request_id, {})["read"] = time.monotonic()
                yield request

        async for response in stream(self, reads(), context):
            stamps[response.request_id]["yield"] = time.monotonic()
            yield response
            stamps[response.request_id]["resume"] = time.monotonic()

    sv.ExpertServicer._forward = timed_forward  # type: ignore[method-assign]
    sv.ExpertServicer.ForwardStream = timed_stream  # type: ignore[method-assign]
    settings = ServerSettings(**config)
    event_loop.run(serve(settings), settings.event_loop)
    record.write_text(json.dumps(stamps))


def _child_echo(port: int, response_bytes: int, record: Path) -> None:
    import grpc

    from lutb_server import event_loop

    stamps: list[list[float]] = []
    response = bytes(response_bytes)

    async def echo_stream(requests: Any, context: Any) -> Any:
        async for _ in requests:
            stamps.append([time.monotonic()])
            yield response
            stamps[-1].append(time.monotonic())

    class Handler(grpc.GenericRpcHandler):
        def service(self, details: Any) -> Any:
            return grpc.stream_stream_rpc_method_handler(echo_stream)

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)])
        server.add_generic_rpc_handlers((Handler(),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(0)

    event_loop.run(main(), "uvloop")
    record.write_text(json.dumps(stamps))


def requests(args: argparse.Namespace) -> list[bytes]:
    import torch

    from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
    from lutb_client.codec import encode_tensor

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(args.requests):
        r = pb.ForwardRequest(request_id=i, layer=0)
        encode_tensor(torch.randn(args.tokens, args.hidden, generator=gen).to(torch.bfloat16), out=r.hidden_states)
        ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(args.tokens)]).to(torch.int32)
        encode_tensor(ids, out=r.topk_ids)
        encode_tensor(torch.full((args.tokens, args.top_k), 1.0 / args.top_k), out=r.topk_weights)
        out.append(r.SerializeToString())
    return out


async def closed_loop(port: int, method: str, payloads: list[bytes], on_warm: Any) -> list[tuple[float, float]]:
    """One stream, one request in flight: (write start, read end) per request."""
    import grpc

    options = [("grpc.max_receive_message_length", 1 << 30), ("grpc.max_send_message_length", 1 << 30)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        await asyncio.wait_for(channel.channel_ready(), 120)
        if method == FORWARD_METHOD:  # the port opens before the checkpoint is loaded: wait for SERVING
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 300
            while (await health.Check(health_pb2.HealthCheckRequest())).status != health_pb2.HealthCheckResponse.SERVING:
                if time.monotonic() > deadline:
                    raise TimeoutError("the server did not report SERVING within 300 s")
                await asyncio.sleep(0.1)
        call = channel.stream_stream(method)()
        times = []
        for i, payload in enumerate(payloads):
            if i == len(payloads) // 5:
                on_warm()
            t0 = time.monotonic()
            await call.write(payload)
            await call.read()
            times.append((t0, time.monotonic()))
        await call.done_writing()
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--echo", action="store_true", help="the bare echo instead of the server")
    p.add_argument("--canned", action="store_true", help="the server answers with its first response (no work)")
    p.add_argument("--checkpoint", default=None, help="serve this checkpoint (default: a tiny one, fake backend)")
    p.add_argument("--backend", default="lutb_server.testing:SleepExperts")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sleep-us", default="350,4", help="fake backend: base,per-token microseconds")
    p.add_argument("--compute-worker", default="process", choices=("thread", "process"))
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--requests", type=int, default=3000, help="the first fifth is warm-up")
    p.add_argument("--port", type=int, default=50997)
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="stream-trace-"))
    record = work / "server.json"
    payloads = requests(args)
    here = os.path.abspath(__file__)
    if args.echo:
        from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb

        response_bytes = pb.ForwardResponse(request_id=1)
        response_bytes.output.data = bytes(args.tokens * args.hidden * 2)
        child = [sys.executable, here, "--_echo", json.dumps([args.port, response_bytes.ByteSize(), str(record)])]
        method = ECHO_METHOD
    else:
        ckpt = args.checkpoint
        if ckpt is None:
            from lutb_server.testing import make_tiny_checkpoint

            ckpt = str(make_tiny_checkpoint(work / "ckpt", layers=(0,), num_experts=args.experts, hidden=args.hidden,
                                            intermediate=128))
        config = {"checkpoint": ckpt, "backend": args.backend, "device": args.device, "host": "127.0.0.1", "port": args.port,
                  "metrics_port": 0, "validate_checkpoint": False, "max_wait_us": 0, "compute_worker": args.compute_worker,
                  "intra_op_threads": 1}
        child = [sys.executable, here, "--_server", json.dumps([config, args.canned, str(record)])]
        method = FORWARD_METHOD
    env = dict(os.environ, LUTB_SLEEP_EXPERTS=args.sleep_us)
    proc = subprocess.Popen(child, env=env)
    cpu: dict[str, dict[str, float]] = {}
    try:
        times = asyncio.run(closed_loop(args.port, method, payloads, lambda: cpu.__setitem__("start", thread_cpu_s(proc.pid))))
        cpu["stop"] = thread_cpu_s(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    stamps = json.loads(record.read_text())
    warm = len(times) // 5
    rows = []
    for i, (t0, t1) in enumerate(times[warm:], start=warm):
        if args.echo:
            read, resume = stamps[i]
            rows.append({"in": read - t0, "out": t1 - read, "yield->resume": resume - read, "total": t1 - t0})
        else:
            s = stamps.get(str(i), {})
            if "resume" not in s:
                continue
            rows.append({"in": s["read"] - t0, "read->handler": s["handler"] - s["read"], "handler": s["handler_end"] - s["handler"],
                         "handler->yield": s["yield"] - s["handler_end"], "out": t1 - s["yield"],
                         "yield->resume": s["resume"] - s["yield"], "total": t1 - t0})
    what = "echo" if args.echo else ("server, canned answers" if args.canned else f"server ({args.backend}, {args.compute_worker} worker)")
    print(f"[stream_trace] {what}: {len(rows)} requests of {args.tokens} tokens, medians in us")
    for key in rows[0]:
        print(f"  {key:15s} {statistics.median(r[key] for r in rows) * 1e6:8.1f}")
    answered = len(times) - warm
    per_thread = {k: (cpu["stop"].get(k, v) - v) * 1e6 / answered for k, v in cpu["start"].items()}
    top = sorted(per_thread.items(), key=lambda kv: -kv[1])[:5]
    print("  server CPU us/request by thread (this process only): " + ", ".join(f"{k} {v:.0f}" for k, v in top))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--_server":
        config, canned, record = json.loads(sys.argv[2])
        _child_server(config, canned, Path(record))
    elif len(sys.argv) == 3 and sys.argv[1] == "--_echo":
        port, size, record = json.loads(sys.argv[2])
        _child_echo(port, size, Path(record))
    else:
        sys.exit(main())
