"""Service behaviour against real servers on loopback: pooling, isolation, limits, health and draining."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import torch
from google.protobuf import message_factory
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from lutb_client import ExpertClient, ExpertServiceError
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import encode_tensor
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.experts.reference import ReferenceExperts
from lutb_kernels.reference import rel_l2
from lutb_server.app import ExpertServer, load_engine, plan_engine
from lutb_server.servicer import SERVICE, ExpertServicer, MalformedRequest, add_to_server
from lutb_server.settings import ServerSettings
from lutb_server.testing import SLEEP_EXPERTS_ENV, ServerThread

HIDDEN = 128
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _batch(tokens: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, 8, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    return x, ids, torch.rand(tokens, k, generator=gen)


def _concurrently(fns):
    """Run callables at the same moment on threads; return their results or exceptions, in order."""
    barrier = threading.Barrier(len(fns))

    def call(fn):
        barrier.wait()
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            return exc

    with ThreadPoolExecutor(len(fns)) as pool:
        return list(pool.map(call, fns))


@pytest.fixture(scope="module")
def pooling_server(tiny_checkpoint: Path):
    """A server whose batches wait up to 0.5 s for company, and whose queue holds 4 requests."""
    with ServerThread(checkpoint=tiny_checkpoint, max_wait_us=500_000, max_queue_requests=4,
                      max_tokens_per_request=256) as running:
        yield running


def test_concurrent_requests_are_pooled_and_match_unpooled(pooling_server: ServerThread, tiny_checkpoint: Path) -> None:
    """Pooled results equal each request run alone within spec tolerance.

    Not bit-exact: the reference runs one matmul per expert over the rows routed to it,
    and CPU GEMM kernels pick their blocking (and so the float32 accumulation order)
    by the row count, so a row's h can differ in the last bit with its batch-mates,
    which may flip an MXFP8 rounding downstream (spec section 6).
    """
    ckpt = Checkpoint(tiny_checkpoint)
    local = ReferenceExperts(ckpt.config, ckpt.layer(1), "cpu")
    batches = [_batch(16 + i, 4, seed=i) for i in range(4)]
    with ExpertClient(pooling_server.address) as client:
        results = _concurrently([functools.partial(client.forward_detailed, 1, *b) for b in batches])
    for result, batch in zip(results, batches):
        assert not isinstance(result, Exception), result
        assert result.timing.batch_tokens <= sum(b[0].shape[0] for b in batches)
        alone = local.forward(*batch)
        assert rel_l2(result.output, alone) <= 1e-2
        assert not torch.isnan(result.output).any()
    assert max(r.timing.batch_tokens - b[0].shape[0] for r, b in zip(results, batches)) > 0, "nothing was pooled"
    assert all(r.timing.queue_us > 0 and r.timing.compute_us > 0 and r.timing.handoff_us >= 0 for r in results)
    assert all(0 <= r.timing.wait_us <= r.timing.handoff_us for r in results)  # the hand-off's part before the call
    assert all(r.timing.prepare_us > 0 and r.timing.encode_us >= 0 for r in results)
    # preparing, the scheduler (queue + compute + hand-off) and encoding follow one another: within the server's time
    assert all(r.timing.total_us >= r.timing.prepare_us + r.timing.queue_us + r.timing.compute_us + r.timing.handoff_us
               + r.timing.encode_us for r in results)


def test_bad_requests_do_not_disturb_their_pool(pooling_server: ServerThread, tiny_checkpoint: Path) -> None:
    ckpt = Checkpoint(tiny_checkpoint)
    local = ReferenceExperts(ckpt.config, ckpt.layer(0), "cpu")
    good = [_batch(8, 2, seed=50 + i) for i in range(3)]
    nan_x = good[0][0].clone()
    nan_x[3, 3] = float("nan")
    with ExpertClient(pooling_server.address) as client:
        calls = [functools.partial(client.forward_detailed, 0, *b) for b in good]
        calls.append(functools.partial(client.forward_detailed, 0, nan_x, good[0][1], good[0][2]))
        calls.append(functools.partial(client.forward_detailed, 0, good[1][0], good[1][1] + 8, good[1][2]))
        results = _concurrently(calls)
    for result, batch in zip(results[:3], good):
        assert not isinstance(result, Exception), result
        assert result.timing.batch_tokens <= 24  # only good requests were pooled
        assert rel_l2(result.output, local.forward(*batch)) <= 1e-2
    assert max(r.timing.batch_tokens for r in results[:3]) > 8, "nothing was pooled"
    for bad, field in zip(results[3:], ("hidden_states", "topk_ids")):
        assert isinstance(bad, ExpertServiceError) and bad.code == grpc.StatusCode.INVALID_ARGUMENT
        assert field in bad.message


def test_queue_full_is_resource_exhausted(pooling_server: ServerThread) -> None:
    x, ids, w = _batch(2, 2, seed=1)
    with ExpertClient(pooling_server.address, retries=0) as client:
        waiting = [threading.Thread(target=client.forward, args=(0, x, ids, w)) for _ in range(4)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 5
        while pooling_server.server.scheduler.queue_depth < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pooling_server.server.scheduler.queue_depth == 4
        with pytest.raises(ExpertServiceError) as info:
            client.forward(0, x, ids, w)
        for t in waiting:
            t.join()
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue_requests" in info.value.message


BUSY_CALL_S = 0.4
"""Every experts call of :func:`_busy_server` takes this long (``SleepExperts``)."""


def _busy_server(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch, **settings: object) -> ServerThread:
    """A server (not started) whose every experts call takes ``BUSY_CALL_S``: a request sent while one runs waits in
    the queue (``max_wait_us`` = 0), where a short deadline passes. (A wait for company does not do it: the pooling
    wait ends before the deadline of a request in the batch.)"""
    monkeypatch.setenv(SLEEP_EXPERTS_ENV, f"{BUSY_CALL_S * 1e6:.0f},0")
    return ServerThread(checkpoint=tiny_checkpoint, backend="lutb_server.testing:SleepExperts", max_wait_us=0,
                        validate_checkpoint=False, **settings)


def test_expired_deadline_is_not_computed(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with _busy_server(tiny_checkpoint, monkeypatch) as running:
        registry = running.server.metrics.registry
        backend = running.server.engine.backend.name

        def tokens() -> float:
            return registry.get_sample_value("lutb_tokens_processed_total", {"backend": backend, "layer": "1"}) or 0.0

        def count(name: str, **labels: str) -> float:
            return registry.get_sample_value(name, labels) or 0.0

        with ExpertClient(running.address, retries=0) as busy_client, ExpertClient(running.address, retries=0) as client, \
                ThreadPoolExecutor(1) as pool:
            busy = pool.submit(busy_client.forward, 0, *_batch(2, 2, seed=1))
            started_by = time.monotonic() + 5
            while not running.server.scheduler._running and time.monotonic() < started_by:
                time.sleep(0.005)
            with pytest.raises(ExpertServiceError) as info:
                client.forward(1, *_batch(3, 2, seed=2), timeout=0.15)  # queued behind the 0.4 s call
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            freed_by = time.monotonic() + 0.2  # the server's cancellation lands just after the client's deadline,
            while running.server.scheduler.queue_depth and time.monotonic() < freed_by:
                time.sleep(0.005)
            assert running.server.scheduler.queue_depth == 0  # and frees its place before the worker is free
            busy.result(10)
            time.sleep(0.1)  # the worker is free: the dropped request would have gone to it by now
        assert tokens() == 0
        assert running.server.scheduler.queue_depth == 0
        # the server counts it as a deadline, not as a cancellation by the caller
        assert count("lutb_forward_requests_total", rpc="Forward", code="DEADLINE_EXCEEDED") == 1
        assert count("lutb_deadline_dropped_total", layer="1") == 1
        assert count("lutb_forward_requests_total", rpc="Forward", code="CANCELLED") == 0


def test_expert_load_counts_answered_requests_only(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lutb_expert_tokens_total feeds balanced sharding: a request that was refused (here: its deadline
    passed in the queue) must not count, or a client's retries would count twice."""
    x, ids, w = _batch(6, 2, seed=4)
    with _busy_server(tiny_checkpoint, monkeypatch, expert_metrics=True) as running:
        registry = running.server.metrics.registry

        def routed() -> float:
            return sum(registry.get_sample_value("lutb_expert_tokens_total", {"layer": "0", "expert": str(e)}) or 0.0
                       for e in range(8))

        with ExpertClient(running.address, retries=0) as busy_client, ExpertClient(running.address, retries=0) as client, \
                ThreadPoolExecutor(1) as pool:
            busy = pool.submit(busy_client.forward, 1, *_batch(2, 2, seed=5))  # layer 1: not counted below
            started_by = time.monotonic() + 5
            while not running.server.scheduler._running and time.monotonic() < started_by:
                time.sleep(0.005)
            with pytest.raises(ExpertServiceError) as info:
                client.forward(0, x, ids, w, timeout=0.1)  # waits behind the 0.4 s call past its deadline
            assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
            assert routed() == 0
            busy.result(10)
            client.forward(0, x, ids, w)
        assert routed() == ids.numel()


def test_an_output_too_large_for_one_message_is_refused_before_computing(tiny_checkpoint: Path) -> None:
    """A response over max_message_bytes would break the whole stream (and gRPC would refuse it only after the
    compute): the server refuses such a request up front, with RESOURCE_EXHAUSTED, in-stream on a stream."""
    limit = 4 * 1024 * 1024
    tokens = limit // (8 * HIDDEN * 2) + 1  # route-major [T, 8, 128] bfloat16 just over the limit
    x, ids, w = _batch(tokens, 8, seed=5)
    with ServerThread(checkpoint=tiny_checkpoint, max_message_bytes=limit) as running:
        registry = running.server.metrics.registry
        with ExpertClient(running.address, retries=0) as client:
            with client.stream() as stream:
                big = stream.submit(0, x, ids, w, output_mode="route_major")
                small = stream.submit(0, x[:2], ids[:2], w[:2], output_mode="route_major")
                combined = stream.submit(0, x, ids, w)  # [T, 128]: fits
            assert big.exception().code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_message_bytes" in big.exception().message and f"[{tokens}, 8, {HIDDEN}]" in big.exception().message
            assert small.result().shape == (2, 8, HIDDEN)
            assert combined.result().shape == (tokens, HIDDEN)
            with pytest.raises(ExpertServiceError) as info:
                client.forward(0, x, ids, w, output_mode="route_major")
            assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert registry.get_sample_value("lutb_forward_requests_total", {"rpc": "Forward", "code": "RESOURCE_EXHAUSTED"}) == 1
        assert registry.get_sample_value("lutb_forward_requests_total", {"rpc": "ForwardStream", "code": "OK"}) == 2
        # neither refused request was computed: only the small and the combined one
        assert registry.get_sample_value("lutb_tokens_processed_total", {"backend": "reference", "layer": "0"}) == tokens + 2


def test_health_and_unavailable_over_the_server_life(tiny_checkpoint: Path) -> None:
    """NOT_SERVING (UNAVAILABLE calls) while loading -> SERVING -> NOT_SERVING while draining; in-flight calls finish."""
    settings = ServerSettings(checkpoint=tiny_checkpoint, host="127.0.0.1", port=0, metrics_port=0, max_wait_us=400_000)
    release = threading.Event()

    def slow_loader():
        assert release.wait(30)
        return load_engine(plan_engine(settings), settings)

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(_make(settings, slow_loader), loop).result(10)
    started = asyncio.run_coroutine_threadsafe(server.start(), loop)
    try:
        deadline = time.monotonic() + 10
        while server.port is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with grpc.insecure_channel(server.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str = "lutb.v1.ExpertService") -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5, wait_for_ready=True).status

            assert status() == NOT_SERVING and status("") == NOT_SERVING
            with ExpertClient(server.address, retries=0) as client:
                with pytest.raises(ExpertServiceError) as info:
                    client.model_info(timeout=5)
                assert info.value.code == grpc.StatusCode.UNAVAILABLE and "loading" in info.value.message
                release.set()
                started.result(30)
                assert status() == SERVING and status("") == SERVING

                x, ids, w = _batch(4, 2, seed=9)
                with ThreadPoolExecutor(3) as pool:
                    in_flight = [pool.submit(client.forward, 0, x, ids, w) for _ in range(3)]
                    time.sleep(0.15)  # they wait in the 0.4 s batch window
                    stopping = asyncio.run_coroutine_threadsafe(server.stop(10), loop)
                    time.sleep(0.05)
                    assert status() == NOT_SERVING
                    with pytest.raises(ExpertServiceError) as info:
                        client.forward(0, x, ids, w)
                    assert info.value.code == grpc.StatusCode.UNAVAILABLE
                    outputs = [f.result(10) for f in in_flight]
                stopping.result(15)
        assert all(o.shape == (4, HIDDEN) for o in outputs)
    finally:
        release.set()
        if not started.done():
            started.cancel()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


async def _make(settings: ServerSettings, loader) -> ExpertServer:
    return ExpertServer(settings, engine_loader=loader)


def test_reflection_lists_the_services(server: ServerThread) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in responses for s in r.list_services_response.service}
    assert {"lutb.v1.ExpertService", "grpc.health.v1.Health"} <= names


def test_the_handlers_are_the_generated_ones_but_for_parsing() -> None:
    """add_to_server registers what the generated add_ExpertServiceServicer_to_server does (the same service,
    paths, kinds and behaviours, as a generic handler and as registered methods). The request deserializers parse as
    the generated ones do, and give a MalformedRequest where those raise; the response serializer gives the generated
    one's bytes for every message, and also takes a SplicedResponse."""
    class Recorder:
        def __init__(self) -> None:
            self.generic: list = []
            self.registered: dict = {}

        def add_generic_rpc_handlers(self, handlers) -> None:
            self.generic.extend(handlers)

        def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
            self.registered[service] = handlers

    servicer = ExpertServicer()
    generated, ours = Recorder(), Recorder()
    pb_grpc.add_ExpertServiceServicer_to_server(servicer, generated)
    add_to_server(servicer, ours)
    assert ours.registered.keys() == generated.registered.keys() == {"lutb.v1.ExpertService"}
    want, got = generated.registered["lutb.v1.ExpertService"], ours.registered["lutb.v1.ExpertService"]
    assert got.keys() == want.keys()
    request = pb.ForwardRequest(request_id=9, layer=1)
    for name, handler in want.items():
        mine = got[name]
        assert (mine.request_streaming, mine.response_streaming) == (handler.request_streaming, handler.response_streaming)
        assert (mine.unary_unary, mine.unary_stream, mine.stream_unary, mine.stream_stream) == (
            handler.unary_unary, handler.unary_stream, handler.stream_unary, handler.stream_stream)
        sample = message_factory.GetMessageClass(SERVICE.methods_by_name[name].output_type)()
        if isinstance(sample, pb.ForwardResponse):
            sample.request_id, sample.status.code, sample.timing.compute_us = 3, 0, 40
            encode_tensor(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), out=sample.output)
        assert mine.response_serializer(sample) == handler.response_serializer(sample)
        wire = b"" if name == "GetModelInfo" else request.SerializeToString()
        assert mine.request_deserializer(wire) == handler.request_deserializer(wire)
        with pytest.raises(DecodeError):
            handler.request_deserializer(b"\xff\xff\xff\xff")
        bad = mine.request_deserializer(b"\xff\xff\xff\xff")
        assert isinstance(bad, MalformedRequest) and bad.request_id == 0
    assert len(ours.generic) == len(generated.generic) == 1
    for method in [*want, "Nonexistent"]:
        details = SimpleNamespace(method=f"/lutb.v1.ExpertService/{method}", invocation_metadata=())
        assert (ours.generic[0].service(details) is None) == (generated.generic[0].service(details) is None) == (method == "Nonexistent")


def test_a_stalled_compute_worker_takes_the_server_out_of_service(tiny_checkpoint: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """compute_stall_s: a call that does not return (a hung device) makes the server report NOT_SERVING and set
    ``failed`` (``lutb serve`` then drains and exits 1 for its supervisor), instead of serving on with every request
    waiting for its deadline."""
    hang = threading.Event()
    forward = ReferenceExperts.forward

    def hanging(self, *args, **kwargs):
        assert hang.wait(30)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(ReferenceExperts, "forward", hanging)
    with ServerThread(checkpoint=tiny_checkpoint, compute_stall_s=1.0) as running, \
            grpc.insecure_channel(running.address) as channel, ExpertClient(running.address) as client:
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        stuck = threading.Thread(target=_swallow, args=(client.forward, 0, *_batch(4, 2, seed=1)), daemon=True)
        stuck.start()
        time.sleep(0.3)
        assert not running.server.failed.is_set()  # silent for less than compute_stall_s
        deadline = time.monotonic() + 10
        while not running.server.failed.is_set():
            assert time.monotonic() < deadline, "the stalled worker went unnoticed"
            time.sleep(0.05)
        for service in ("", "lutb.v1.ExpertService"):
            status = health.Check(health_pb2.HealthCheckRequest(service=service)).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING, service
        hang.set()
        stuck.join(30)


def test_a_busy_compute_worker_is_not_a_stalled_one(tiny_checkpoint: Path) -> None:
    """Calls that keep answering, however many are queued behind them, never trip compute_stall_s."""
    with ServerThread(checkpoint=tiny_checkpoint, compute_stall_s=1.0) as running, \
            ExpertClient(running.address) as client:
        end = time.monotonic() + 2.5
        while time.monotonic() < end:
            client.forward(0, *_batch(16, 2, seed=2))
        assert not running.server.failed.is_set()


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - whatever the stalled call ends with
        pass
