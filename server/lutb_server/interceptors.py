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
from typing import Any, AsyncIterator

import grpc

from lutb_server.errors import cancelled_status
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
    # gRPC cancels a handler when its deadline passes, too; a streaming handler blocked writing to a client that went
    # away is closed instead (GeneratorExit)
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining() if hasattr(context, "time_remaining") else None
        return cancelled_status(None if remaining is None else time.monotonic() + remaining)
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


class _Wrapped:
    """Wrapped handlers, built once per method (interceptors run for every call; building is not free)."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def get(self, method: str, handler: grpc.RpcMethodHandler, build: Callable[[], grpc.RpcMethodHandler]) -> grpc.RpcMethodHandler:
        hit = self._cache.get(method)
        if hit is not None and hit[0] is handler:
            return hit[1]
        wrapped = build()
        self._cache[method] = (handler, wrapped)
        return wrapped


class _Observe:
    """``async with``: one call's in-flight gauge, latency and status count (a plain class: cheaper than a generator)."""

    __slots__ = ("_children", "_requests", "_context", "_start")

    def __init__(self, children: tuple[Any, Any, Callable[[str], Any]], context: Any) -> None:
        self._children = children
        self._context = context
        self._start = 0.0

    async def __aenter__(self) -> None:
        self._children[0].inc()
        self._start = time.perf_counter()

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        in_flight, duration, requests = self._children
        in_flight.dec()
        duration.observe(time.perf_counter() - self._start)
        requests(status_of(self._context, exc).name).inc()


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Request count by status, latency and in-flight gauge of every registered method.

    It sees what the handler does, not what gRPC does around it: a call whose request bytes gRPC cannot parse
    never reaches the handler and is not counted, and one whose response gRPC fails to serialize is counted with
    the handler's code (OK). ExpertService parses its requests leniently and checks its responses' size itself, so
    this concerns garbage sent to the health and reflection services.
    """

    def __init__(self, metrics: ServerMetrics) -> None:
        self._metrics = metrics
        self._wrapped = _Wrapped()

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]], handler_call_details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        return self._wrapped.get(handler_call_details.method, handler, lambda: self._wrap(handler_call_details.method, handler))

    def _wrap(self, full_method: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        service, method = split_method(full_method)
        metrics = self._metrics
        by_code: dict[str, Any] = {}

        def requests(code: str) -> Any:
            child = by_code.get(code)
            if child is None:
                child = by_code[code] = metrics.grpc_requests.labels(service, method, code)
            return child

        children = (metrics.grpc_in_flight.labels(service, method), metrics.grpc_duration.labels(service, method), requests)
        return wrap_handler(handler, lambda context: _Observe(children, context))


class Gate:
    """The server's state for gated services: ``loading`` -> ``serving`` -> ``draining``."""

    def __init__(self) -> None:
        self._state = "loading"
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.draining = asyncio.Event()
        """Set once the state is ``draining`` (open streams end then: :class:`~lutb_server.servicer.ExpertServicer`)."""

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        self._state = value
        if value == "draining":
            self.draining.set()

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
        self._wrapped = _Wrapped()

    async def intercept_service(
        self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]], handler_call_details: Any
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        service, _ = split_method(handler_call_details.method)
        if service not in self._gated:
            return handler
        return self._wrapped.get(handler_call_details.method, handler, lambda: wrap_handler(handler, self._admit))

    def _admit(self, context: Any) -> _Admit:
        return _Admit(self._gate, context)


class _Admit:
    """``async with``: UNAVAILABLE unless the gate is open; the call counts as in flight inside."""

    __slots__ = ("_gate", "_context")

    def __init__(self, gate: Gate, context: Any) -> None:
        self._gate = gate
        self._context = context

    async def __aenter__(self) -> None:
        gate = self._gate
        if not gate.open:
            why = "is still loading its checkpoint" if gate.state == "loading" else "is shutting down"
            await self._context.abort(grpc.StatusCode.UNAVAILABLE, f"server {why}; retry (on another replica)")
        gate.enter()

    async def __aexit__(self, *exc: object) -> None:
        self._gate.leave()


__all__ = ["Gate", "GateInterceptor", "MetricsInterceptor", "split_method", "status_of", "wrap_handler"]
