"""Cross-cutting concerns of every call, as grpc.aio server interceptors.

- :class:`MetricsInterceptor`: counts calls by service, method and status code,
  observes their latency and tracks the calls in flight.
- :class:`GateInterceptor`: while the server is loading or draining, answers calls
  to the gated services with UNAVAILABLE (health and reflection always pass), and
  counts the gated calls in flight so that shutdown knows when they are done.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import grpc

from lutb_server.metrics import ServerMetrics

_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}
Around = Callable[[Any], Any]  # context -> async context manager


def split_method(full: str) -> tuple[str, str]:
    """``/lutb.v1.ExpertService/Forward`` -> ``("lutb.v1.ExpertService", "Forward")``."""
    _, _, rest = full.partition("/")
    service, _, method = rest.partition("/")
    return service, method


def status_of(context: Any, exc: BaseException | None) -> grpc.StatusCode:
    """The status a call ended with, from its context and the exception (if any) its handler raised."""
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code() if hasattr(context, "code") else None
    if isinstance(code, int):
        code = _CODES_BY_VALUE.get(code)
    if isinstance(code, grpc.StatusCode):
        return code
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around) -> grpc.RpcMethodHandler:
    """A handler of the same kind that runs ``handler`` inside ``async with around(context)``."""
    kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary or handler.stream_unary:
        inner = handler.unary_unary or handler.stream_unary

        async def call(request: Any, context: Any) -> Any:
            async with around(context):
                return await inner(request, context)

        make = grpc.unary_unary_rpc_method_handler if handler.unary_unary else grpc.stream_unary_rpc_method_handler
        return make(call, **kw)
    inner = handler.unary_stream or handler.stream_stream
    make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
    if inspect.isasyncgenfunction(inner):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            async with around(context):
                async for response in inner(request, context):
                    yield response

        return make(stream, **kw)

    async def writer(request: Any, context: Any) -> Any:  # handlers that use context.write()
        async with around(context):
            return await inner(request, context)

    return make(writer, **kw)


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Request count by status, latency and in-flight gauge of every registered method."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]], handler_call_details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, method = split_method(handler_call_details.method)
        metrics = self._metrics

        @asynccontextmanager
        async def observe(context: Any) -> AsyncIterator[None]:
            in_flight = metrics.grpc_in_flight.labels(service, method)
            in_flight.inc()
            start = time.perf_counter()
            exc: BaseException | None = None
            try:
                yield
            except BaseException as err:
                exc = err
                raise
            finally:
                in_flight.dec()
                metrics.grpc_duration.labels(service, method).observe(time.perf_counter() - start)
                metrics.grpc_requests.labels(service, method, status_of(context, exc).name).inc()

        return wrap_handler(handler, observe)


class Gate:
    """The server's state for gated services: ``loading`` -> ``serving`` -> ``draining``."""

    def __init__(self) -> None:
        self.state = "loading"
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def open(self) -> bool:
        return self.state == "serving"

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no gated call is in flight (or ``timeout`` s); True when idle."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


class GateInterceptor(grpc.aio.ServerInterceptor):
    """UNAVAILABLE for calls to ``gated_services`` unless the gate is open; counts those in flight."""

    def __init__(self, gate: Gate, gated_services: tuple[str, ...]) -> None:
        self._gate = gate
        self._gated = gated_services

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]], handler_call_details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        service, _ = split_method(handler_call_details.method)
        if handler is None or service not in self._gated:
            return handler
        gate = self._gate

        @asynccontextmanager
        async def admit(context: Any) -> AsyncIterator[None]:
            if not gate.open:
                why = "is still loading its checkpoint" if gate.state == "loading" else "is shutting down"
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"server {why}; retry (on another replica)")
            gate.enter()
            try:
                yield
            finally:
                gate.leave()

        return wrap_handler(handler, admit)


__all__ = ["Gate", "GateInterceptor", "MetricsInterceptor", "split_method", "status_of", "wrap_handler"]
