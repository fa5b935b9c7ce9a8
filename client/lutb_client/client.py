"""Clients of ``lutb.v1.ExpertService``: :class:`ExpertClient` (blocking) and :class:`AsyncExpertClient` (asyncio).

Both give every call a deadline (``timeout``, default :data:`DEFAULT_TIMEOUT_S`),
retry unary calls that fail with UNAVAILABLE with exponential backoff (jittered,
within the deadline), and raise only :class:`~lutb_client.errors.ExpertServiceError`.
A streaming session (:meth:`ExpertClient.stream`, :meth:`AsyncExpertClient.stream`)
keeps many requests in flight on one ``ForwardStream`` call; it does not retry
(a broken stream fails the requests still pending with the stream's status).

``wire="mxfp8"`` sends hidden states MXFP8-quantized (float8_e4m3fn elements plus one
E8M0 scale byte per 32, about half the bytes of bfloat16), quantized with the server's
scale mode after rounding to its model dtype (both from ``ModelInfo``, fetched once).
The result then equals sending the hidden states themselves, except with
``apply_router_weight_on_input``. Outputs always come back in the model dtype.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import operator
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple, TypeVar

import grpc
import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import PROTO_TO_TORCH, CodecError, decode_tensor, encode_tensor
from lutb_client.errors import ExpertServiceError, status_code
from lutb_client.spread import spread, spread_async

DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
KEEPALIVE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.ping_timeout_ms", 10_000),  # what grpcio 1.85 times its pings by (its default: 60 s)
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
"""Every connection pings the server every 20 s, with calls in flight or none, and is closed when a ping goes 10 s
unanswered: a server that vanished without closing its connections (a node lost, a partition) then fails the calls
on them with UNAVAILABLE, retried on a new connection, within ~30 s, instead of each waiting out its deadline while
the kernel still thinks the connection alive (for up to ~15 minutes). ``lutb serve`` accepts a ping every second.
Give other values through ``channel_options`` (the same keys)."""
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
_OUTPUT_MODES = {"combined": pb.COMBINED, "route_major": pb.ROUTE_MAJOR}
WIRES = ("native", "mxfp8")
"""How hidden states travel: ``native`` (as given) or ``mxfp8`` (quantized by the client)."""
T = TypeVar("T")


class ForwardResult(NamedTuple):
    """A forward's output and the server's account of its time (``lutb.v1.Timing``)."""

    output: torch.Tensor
    timing: pb.Timing
    request_id: int


def build_request(
    layer: int,
    hidden_states: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    apply_router_weight_on_input: bool = False,
    output_mode: str = "combined",
    request_id: int = 0,
    hidden_scales: torch.Tensor | None = None,
) -> pb.ForwardRequest:
    """Encode one forward request (tensors on any device; ``output_mode`` "combined" or "route_major").

    ``hidden_scales``: uint8 ``[T, H/32]`` E8M0 scales when ``hidden_states`` is float8_e4m3fn (MXFP8 input).

    Raises:
        ExpertServiceError: INVALID_ARGUMENT, the message starting with the argument's name: ``layer`` not an
            integer in int32's range, ``request_id`` not one in uint64's, an ``apply_router_weight_on_input``
            protobuf cannot take as a bool, an unknown ``output_mode``, or a tensor the codec refuses.
    """
    if output_mode not in _OUTPUT_MODES:
        raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"output_mode: {output_mode!r} is not combined or route_major")
    request_id = _check_integer("request_id", request_id, 0, 2**64 - 1)  # the message's field types: uint64
    layer = _check_integer("layer", layer, -(2**31), 2**31 - 1)  # int32
    try:
        request = pb.ForwardRequest(
            request_id=request_id, layer=layer, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=_OUTPUT_MODES[output_mode],
        )
    except (TypeError, ValueError) as exc:  # the one field left unchecked: protobuf's own rule for a bool
        raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"apply_router_weight_on_input: {exc}", request_id) from None
    try:
        encode_tensor(hidden_states, out=request.hidden_states)
        encode_tensor(topk_ids, out=request.topk_ids)
        encode_tensor(topk_weights, out=request.topk_weights)
        if hidden_scales is not None:
            encode_tensor(hidden_scales, out=request.hidden_scales)
    except CodecError as exc:
        raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc), request_id) from None
    return request


def _check_integer(name: str, value: Any, low: int, high: int) -> int:
    """``value`` as an int if it is an integer (``operator.index``; not a bool) in ``[low, high]``.

    Raises:
        ExpertServiceError: INVALID_ARGUMENT naming ``name`` otherwise (protobuf would raise its own ValueError or
            TypeError, or take None for 0).
    """
    if not isinstance(value, bool):
        try:
            number = operator.index(value)
        except TypeError:
            pass
        else:
            if low <= number <= high:
                return number
    raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: {value!r} is not an integer in [{low}, {high}]")


def parse_response(response: pb.ForwardResponse) -> ForwardResult:
    """Decode a response; raise :class:`ExpertServiceError` when its status is not OK."""
    if response.status.code != 0:
        raise ExpertServiceError(status_code(response.status.code), response.status.message, response.request_id)
    try:
        output = decode_tensor(response.output, name="output")
    except CodecError as exc:
        raise ExpertServiceError(grpc.StatusCode.INTERNAL, f"malformed response: {exc}", response.request_id) from None
    return ForwardResult(output, response.timing, response.request_id)


def open_channel(
    target: str,
    *,
    aio: bool,
    credentials: grpc.ChannelCredentials | None,
    max_message_bytes: int,
    channel_options: Sequence[tuple[str, Any]],
) -> Any:
    """A ``grpc`` (or ``grpc.aio`` when ``aio``) channel to ``target``: TLS when ``credentials``
    are given, plaintext otherwise, messages up to ``max_message_bytes`` both ways, :data:`KEEPALIVE_OPTIONS` unless
    ``channel_options`` sets those keys."""
    given = {key for key, _ in channel_options}
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *(option for option in KEEPALIVE_OPTIONS if option[0] not in given),
        *channel_options,
    ]
    module = grpc.aio if aio else grpc
    return module.secure_channel(target, credentials, options) if credentials else module.insecure_channel(target, options)


def channel_opener(target: str, connections: int, *, aio: bool, credentials: grpc.ChannelCredentials | None,
                   max_message_bytes: int, channel_options: Sequence[tuple[str, Any]]) -> Callable[[], Any]:
    """What opens each of a client's ``connections`` channels to ``target``: with more than one, each on its own
    subchannel pool (gRPC otherwise lets channels with equal arguments share one TCP connection)."""
    if connections < 1:
        raise ValueError(f"connections must be >= 1, got {connections}")
    if connections > 1:
        channel_options = [*channel_options, ("grpc.use_local_subchannel_pool", 1)]
    return functools.partial(open_channel, target, aio=aio, credentials=credentials, max_message_bytes=max_message_bytes,
                             channel_options=channel_options)


class _HiddenWire:
    """Encodes hidden states for the wire: as given (``native``) or MXFP8-quantized (``mxfp8``)."""

    def __init__(self, wire: str) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
        self.wire = wire
        self.dtype: torch.dtype | None = None
        self.scale_mode = ""

    @property
    def ready(self) -> bool:
        """Nothing left to learn from the server."""
        return self.wire == "native" or self.dtype is not None

    def learn(self, info: pb.ModelInfo) -> None:
        """Take the model dtype and MXFP8 scale mode from the server's ``ModelInfo``."""
        self.scale_mode = info.mxfp8_scale_mode or "rceil"  # first: another thread takes dtype as ``ready``
        self.dtype = PROTO_TO_TORCH.get(info.dtype, torch.bfloat16)

    def encode(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(hidden_states to send, hidden_scales or None)``."""
        if self.wire == "native":
            return hidden_states, None
        from lutb_kernels.mxfp8 import mxfp8_quantize

        assert self.dtype is not None, "learn() the model info first"
        try:
            return mxfp8_quantize(hidden_states.to(self.dtype), self.scale_mode)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"hidden_states: {exc}") from None


class _Backoff:
    """Exponential backoff with full jitter: attempt ``n`` sleeps up to ``base * 2**n`` (capped)."""

    def __init__(self, retries: int, base_s: float, max_s: float) -> None:
        self.retries, self.base_s, self.max_s = retries, base_s, max_s

    def delay(self, attempt: int) -> float:
        return random.uniform(0.5, 1.0) * min(self.max_s, self.base_s * (2**attempt))


def _check_timeout(timeout: float, name: str = "timeout") -> float:
    """A client's default deadline (or another bound in seconds, ``name`` in the error): a positive finite number of
    seconds; every call has one (a stream may go without: ``stream(timeout=None)``)."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {timeout!r}")
    return float(timeout)


def _call_timeout(timeout: Any) -> float | None:
    """A per-call ``timeout`` by the constructor's rule (:func:`_check_timeout`); None stays None (the client's
    default deadline, or no deadline for a stream).

    Raises:
        ExpertServiceError: INVALID_ARGUMENT naming ``timeout``: not a positive finite number of seconds.
    """
    if timeout is None:
        return None
    try:
        return _check_timeout(timeout)
    except ValueError as exc:
        raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _closed_error() -> ExpertServiceError:
    return ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")


def _cancelled_by_close(closed: bool) -> bool:
    """Whether a ``CancelledError`` out of a ``grpc.aio`` call came from the client's ``close()`` (grpc cancels the calls
    of a channel it closes), not from a cancellation of the calling task. Python 3.10 cannot tell them apart
    (``Task.cancelling`` is 3.11's): there it counts as the task's, so that a real cancellation is never swallowed."""
    if not closed:
        return False
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)
    return cancelling is not None and cancelling() == 0


class _Connections:
    """What both clients keep: the target, the default deadline, the retry backoff, the channels (one per
    connection, their stubs taken in turn), the request ids and the hidden-state wire. Arguments: see
    :class:`ExpertClient`."""

    _AIO: bool = False

    def __init__(
        self,
        target: str,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        retries: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
        wire: str = "native",
        connections: int = 1,
    ) -> None:
        self.target = target
        self.timeout = _check_timeout(timeout)
        self._closed = False
        self._backoff = _Backoff(retries, backoff_s, max_backoff_s)
        self._wire = _HiddenWire(wire)  # checked before any channel opens: a bad value leaks none
        self._open_channel = channel_opener(target, connections, aio=self._AIO, credentials=credentials,
                                            max_message_bytes=max_message_bytes, channel_options=channel_options)
        self._channels = [self._open_channel() for _ in range(connections)]
        self._take_stubs()
        self._ids = itertools.count(1)

    def _take_stubs(self) -> None:
        """Calls and streams take the channels' stubs in turn from now on."""
        self._stubs = itertools.cycle([pb_grpc.ExpertServiceStub(c) for c in self._channels])

    @property
    def _stub(self) -> pb_grpc.ExpertServiceStub:
        """The next connection's stub (each call and stream takes the next)."""
        if self._closed:
            raise _closed_error()
        return next(self._stubs)


class ExpertClient(_Connections):
    """Blocking client of one expert server.

    Args:
        target: ``host:port`` of the server.
        timeout: default deadline of a call in seconds (retries included).
        retries: how many times a call failing with UNAVAILABLE is retried.
        backoff_s: first retry delay; it doubles per retry, up to ``max_backoff_s`` (jittered).
        credentials: TLS channel credentials; plaintext if None.
        max_message_bytes: largest message sent or received.
        channel_options: extra gRPC channel options.
        wire: ``"native"`` sends hidden states as given; ``"mxfp8"`` quantizes them to MXFP8
            first (half the request bytes; see the module docstring).
        connections: TCP connections to open, each its own channel; calls and streams take
            them in turn (a retry takes the next). A server with several front ends on one port
            (``lutb serve --front-ends N``) spreads connections, not calls, over them: open at
            least N, and call :meth:`spread_connections` once before the first call, to use them all
            evenly from one client.
    """

    def close(self) -> None:
        """Close the connections; calls made afterwards (or still running) fail with FAILED_PRECONDITION."""
        self._closed = True
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> ExpertClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, fn: Callable[[float], T], timeout: float | None) -> T:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                return fn(max(remaining, 0.0))
            except grpc.RpcError as err:
                if self._closed:  # closed by another thread while the call ran (grpc says CANCELLED: Channel closed!)
                    raise _closed_error() from None
                error = ExpertServiceError.from_rpc_error(err)
            except ValueError:  # grpc's "Cannot invoke RPC on closed channel!" (closed by another thread meanwhile)
                if self._closed:
                    raise _closed_error() from None
                raise
            if error.code not in RETRYABLE or attempt >= self._backoff.retries:
                raise error
            pause = self._backoff.delay(attempt)
            if time.monotonic() + pause >= deadline:
                raise error
            time.sleep(pause)
            attempt += 1

    def spread_connections(self, *, timeout: float | None = None) -> list[int]:
        """Spread this client's connections evenly over the server's front ends (:mod:`lutb_client.spread`):
        a connection on a front end holding two more of them than another is replaced by a new one. Call it
        before making calls (a replaced connection is closed, and calls on it with it). Returns the front end
        each connection reached (all 0 where the server has one).

        Raises:
            ExpertServiceError: the server did not answer within ``timeout`` (default: the client's); a
                ``timeout`` not a positive finite number of seconds (INVALID_ARGUMENT).
        """
        timeout = _call_timeout(timeout)
        if self._closed:
            raise _closed_error()
        try:
            fronts = spread(self._channels, self._open_channel, timeout=self.timeout if timeout is None else timeout)
        except (grpc.RpcError, ValueError) as err:  # ValueError: grpc's "Channel closed!" (close() in another thread)
            if self._closed:
                raise _closed_error() from None
            if isinstance(err, ValueError):
                raise
            raise ExpertServiceError.from_rpc_error(err) from None
        if self._closed:  # close() ran meanwhile: the connections spread swapped in are closed too
            for channel in self._channels:
                channel.close()
            raise _closed_error()
        self._take_stubs()
        return fronts

    def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        """The server's ``ModelInfo`` (sizes, layers and experts held, dtype, backend, content hash)."""
        timeout = _call_timeout(timeout)
        info = self._call(lambda t: self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t, wait_for_ready=True), timeout)
        self._wire.learn(info)
        return info

    def _hidden(self, hidden_states: torch.Tensor, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``hidden_states`` in the wire's encoding (the MXFP8 wire learns the model's scale rule first, within ``timeout``)."""
        if not self._wire.ready:
            self.model_info(timeout=timeout)
        return self._wire.encode(hidden_states)

    def forward_detailed(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> ForwardResult:
        """:meth:`forward`, also returning the server's timing."""
        timeout = _call_timeout(timeout)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)  # the wire's first model info too
        hidden_states, scales = self._hidden(hidden_states, timeout)
        request = build_request(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, request_id=next(self._ids), hidden_scales=scales,
        )
        response = self._call(lambda t: self._stub.Forward(request, timeout=t), max(deadline - time.monotonic(), 0.0))
        return parse_response(response)

    def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Run ``layer``'s experts held by the server on a routed batch.

        Args:
            hidden_states: ``[T, H]`` in the model dtype (another float dtype is rounded to it).
            topk_ids: int32/int64 ``[T, k]`` global expert ids.
            topk_weights: float32 ``[T, k]``.
            output_mode: ``"combined"`` -> ``[T, H]``; ``"route_major"`` -> ``[T, k, H]``.
            timeout: this call's deadline in seconds (None: the client's), by the constructor's rule.

        Returns:
            The output in the model dtype, on the CPU.

        Raises:
            ExpertServiceError: the call failed (``.code``, ``.message``); bad arguments (``layer`` outside int32,
                a ``timeout`` not a positive finite number, a refused tensor) fail with INVALID_ARGUMENT, naming
                the argument, before the request is sent.
        """
        return self.forward_detailed(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, timeout=timeout,
        ).output

    def stream(self, *, timeout: float | None = None, max_in_flight: int = 64) -> ForwardStream:
        """Open a :class:`ForwardStream` session (``timeout`` bounds the whole stream; None: no deadline).

        Raises:
            ExpertServiceError: INVALID_ARGUMENT: a ``timeout`` neither None nor a positive finite number of seconds.
        """
        timeout = _call_timeout(timeout)
        try:
            return ForwardStream(self._stub, timeout=timeout, max_in_flight=max_in_flight, ids=self._ids, hidden=self._hidden)
        except ValueError:  # grpc's "Channel closed!": close() in another thread between the check and the call
            if self._closed:
                raise _closed_error() from None
            raise


_CLOSE = object()


def _settle(future: Any, request_id: int, response: pb.ForwardResponse, detailed: bool | None) -> None:
    """Complete a stream request's future (``concurrent.futures`` or ``asyncio``) from its response.

    ``detailed``: True gives the :class:`ForwardResult`, False its output, None (``send``) the
    response itself with its status unread. A response for another request fails the future.
    """
    if response.request_id != request_id:
        future.set_exception(ExpertServiceError(
            grpc.StatusCode.INTERNAL, f"stream out of order: got response {response.request_id}", request_id))
    elif detailed is None:
        future.set_result(response)
    else:
        try:
            result = parse_response(response)
        except ExpertServiceError as exc:
            future.set_exception(exc)
        else:
            future.set_result(result if detailed else result.output)


def _reader_error(exc: Exception) -> ExpertServiceError:
    """The error a stream's requests fail with when its reader met ``exc``, which it never should (a client bug,
    or a server answering more requests than it was sent)."""
    return ExpertServiceError(grpc.StatusCode.INTERNAL, f"stream reader failed: {type(exc).__name__}: {exc}")


class ForwardStream:
    """Many requests in flight on one ``ForwardStream`` call (blocking API).

    ``submit`` returns a ``concurrent.futures.Future`` of the output tensor (or
    :class:`ForwardResult` with ``detailed=True``); responses arrive in request order.
    An error on one request fails only its future. Use as a context manager, or call
    :meth:`close` to half-close the stream and wait for the outstanding responses.
    """

    def __init__(self, stub: pb_grpc.ExpertServiceStub, *, timeout: float | None, max_in_flight: int,
                 ids: Iterator[int], hidden: Callable[[torch.Tensor], Any] | None = None) -> None:
        self._hidden = hidden  # the client's hidden-state wire encoding (async for AsyncForwardStream)
        self._requests: queue.Queue[Any] = queue.Queue()
        self._pending: deque[tuple[int, Future[Any], bool | None]] = deque()  # detailed; None: raw
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._max_in_flight = max_in_flight  # for the message of a send that found no room
        self._ids = ids
        self._closed = False
        self._error: ExpertServiceError | None = None
        self._call = stub.ForwardStream(self._request_iter(), timeout=timeout)
        self._reader = threading.Thread(target=self._read, name="lutb-stream-reader", daemon=True)
        self._reader.start()

    def _request_iter(self) -> Iterator[pb.ForwardRequest]:
        while True:
            item = self._requests.get()
            if item is _CLOSE:
                return
            yield item

    def _read(self) -> None:
        """The reader thread: settle each response's future in turn (one its owner cancelled is skipped). When the
        call ends, or settling a response raises what it never should (a bug: the call is cancelled then), the
        future being settled and every pending one fail with :class:`ExpertServiceError`: none is left waiting."""
        settling: tuple[int, Future[Any]] | None = None
        try:
            for response in self._call:
                with self._lock:
                    request_id, future, detailed = self._pending.popleft()
                self._slots.release()
                settling = (request_id, future)
                if future.set_running_or_notify_cancel():  # False: cancelled by its owner, nothing to settle
                    _settle(future, request_id, response, detailed)
                settling = None
            error = ExpertServiceError(grpc.StatusCode.INTERNAL, "stream ended before every request was answered")
        except grpc.RpcError as err:
            error = ExpertServiceError.from_rpc_error(err)
        except Exception as exc:  # noqa: BLE001 - a dead reader would leave every future of the stream pending
            error = _reader_error(exc)
            self._call.cancel()
        with self._lock:
            self._error = error
            pending, self._pending = self._pending, deque()
            if not self._closed:  # end the requests too: grpc's thread taking them would wait for the next for ever
                self._closed = True
                self._requests.put(_CLOSE)
        if settling is not None and not settling[1].done():
            settling[1].set_exception(ExpertServiceError(error.code, error.message, settling[0]))
        for request_id, future, _ in pending:
            if future.set_running_or_notify_cancel():
                future.set_exception(ExpertServiceError(error.code, error.message, request_id))
            self._slots.release()

    def submit(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        detailed: bool = False,
    ) -> Future[Any]:
        """Send one request; blocks while ``max_in_flight`` requests are outstanding."""
        request_id = next(self._ids)
        hidden_states, scales = self._hidden(hidden_states) if self._hidden is not None else (hidden_states, None)
        request = build_request(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, request_id=request_id, hidden_scales=scales,
        )
        return self._write(request, detailed)

    def send(self, request: pb.ForwardRequest, *, timeout: float | None = None) -> Future[pb.ForwardResponse]:
        """Send an already built request (its ``request_id`` unique on this stream).

        Returns the future of the raw :class:`ForwardResponse`, whose ``status`` the caller
        reads (a per-request error does not fail the future; a broken stream does, with
        :class:`ExpertServiceError`). Blocks while ``max_in_flight`` are outstanding: at most
        ``timeout`` seconds (None: until one is answered), then DEADLINE_EXCEEDED, nothing sent.
        """
        return self._write(request, None, timeout)

    @property
    def broken(self) -> bool:
        """The stream ended or failed: nothing more can be sent on it."""
        return self._closed or self._error is not None

    def _write(self, request: pb.ForwardRequest, detailed: bool | None, timeout: float | None = None) -> Future[Any]:
        request_id = request.request_id
        future: Future[Any] = Future()
        if not self._slots.acquire(timeout=timeout):
            raise ExpertServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                     f"no room on the stream within {timeout:.3f} s ({self._max_in_flight} requests unanswered)",
                                     request_id)
        with self._lock:
            if self._closed or self._error is not None:
                self._slots.release()
                error = self._error or ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, "stream is closed")
                raise ExpertServiceError(error.code, error.message, request_id)
            self._pending.append((request_id, future, detailed))
            self._requests.put(request)
        return future

    def close(self, timeout: float | None = None) -> None:
        """Half-close the stream and wait for the remaining responses."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._requests.put(_CLOSE)
        self._reader.join(timeout)

    def cancel(self) -> None:
        """Abort the stream; pending requests fail with CANCELLED."""
        self._call.cancel()
        self.close()

    def __enter__(self) -> ForwardStream:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.cancel()


class AsyncExpertClient(_Connections):
    """asyncio client of one expert server; arguments as for :class:`ExpertClient`.

    Create it inside a running event loop (``async with AsyncExpertClient(target) as client:``).
    """

    _AIO = True

    async def close(self) -> None:
        """Close the connections; calls made afterwards (or still running) fail with FAILED_PRECONDITION."""
        self._closed = True
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncExpertClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, fn: Callable[[float], Any], timeout: float | None) -> Any:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            try:
                return await fn(max(remaining, 0.0))
            except grpc.RpcError as err:
                error = ExpertServiceError.from_rpc_error(err)
            except grpc.aio.UsageError:  # "Channel is closed." (closed by another task meanwhile)
                if self._closed:
                    raise _closed_error() from None
                raise
            except asyncio.CancelledError:  # the call's channel closed under it (close()), or this task cancelled
                if _cancelled_by_close(self._closed):
                    raise _closed_error() from None
                raise
            if error.code not in RETRYABLE or attempt >= self._backoff.retries:
                raise error
            pause = self._backoff.delay(attempt)
            if time.monotonic() + pause >= deadline:
                raise error
            await asyncio.sleep(pause)
            attempt += 1

    async def spread_connections(self, *, timeout: float | None = None) -> list[int]:
        """:meth:`ExpertClient.spread_connections`."""
        timeout = _call_timeout(timeout)
        if self._closed:
            raise _closed_error()
        try:
            fronts = await spread_async(self._channels, self._open_channel, timeout=self.timeout if timeout is None else timeout)
        except (grpc.RpcError, grpc.aio.UsageError) as err:  # UsageError: "Channel is closed" (close() meanwhile)
            if self._closed:
                raise _closed_error() from None
            if isinstance(err, grpc.aio.UsageError):
                raise
            raise ExpertServiceError.from_rpc_error(err) from None
        if self._closed:  # close() ran meanwhile: the connections spread swapped in are closed too
            for channel in self._channels:
                await channel.close()
            raise _closed_error()
        self._take_stubs()
        return fronts

    async def model_info(self, *, timeout: float | None = None) -> pb.ModelInfo:
        """The server's ``ModelInfo``."""
        timeout = _call_timeout(timeout)
        info = await self._call(lambda t: self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=t, wait_for_ready=True), timeout)
        self._wire.learn(info)
        return info

    async def _hidden(self, hidden_states: torch.Tensor, timeout: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """As :meth:`ExpertClient._hidden`."""
        if not self._wire.ready:
            await self.model_info(timeout=timeout)
        return self._wire.encode(hidden_states)

    async def forward_detailed(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> ForwardResult:
        """:meth:`forward`, also returning the server's timing."""
        timeout = _call_timeout(timeout)
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)  # the wire's first model info too
        hidden_states, scales = await self._hidden(hidden_states, timeout)
        request = build_request(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, request_id=next(self._ids), hidden_scales=scales,
        )
        response = await self._call(lambda t: self._stub.Forward(request, timeout=t), max(deadline - time.monotonic(), 0.0))
        return parse_response(response)

    async def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """As :meth:`ExpertClient.forward`."""
        result = await self.forward_detailed(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, timeout=timeout,
        )
        return result.output

    def stream(self, *, timeout: float | None = None, max_in_flight: int = 64) -> AsyncForwardStream:
        """Open an :class:`AsyncForwardStream` (``async with client.stream() as s: await s.forward(...)``); ``timeout``
        as for :meth:`ExpertClient.stream`."""
        # (no close() can come between the closed check in _stub and the call: close() sets the flag before it awaits)
        return AsyncForwardStream(self._stub, timeout=_call_timeout(timeout), max_in_flight=max_in_flight, ids=self._ids, hidden=self._hidden)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


class AsyncForwardStream:
    """Many requests in flight on one ``ForwardStream`` call (asyncio API).

    ``await submit(...)`` sends a request and returns an ``asyncio.Future`` of its
    output; ``await forward(...)`` sends and waits. Responses arrive in request order;
    an error on one request fails only its future.

    One task of the stream's own writes the requests, in the order they were submitted: a caller
    cancelled while it waits (its own deadline, ``asyncio.wait_for``) can then never leave a request
    counted as sent but not written, which would pair every later response with the wrong request.
    """

    def __init__(self, stub: pb_grpc.ExpertServiceStub, *, timeout: float | None, max_in_flight: int,
                 ids: Iterator[int], hidden: Callable[[torch.Tensor], Any] | None = None) -> None:
        self._hidden = hidden  # the client's hidden-state wire encoding (async for AsyncForwardStream)
        self._call = stub.ForwardStream(timeout=timeout)
        self._pending: deque[tuple[int, asyncio.Future[Any], bool | None]] = deque()  # detailed; None: raw
        self._slots = asyncio.Semaphore(max_in_flight)
        self._ids = ids
        self._closed = False
        self._error: ExpertServiceError | None = None
        self._requests: asyncio.Queue[pb.ForwardRequest | None] = asyncio.Queue()  # None: half-close
        self._writer = asyncio.ensure_future(self._write_all())
        self._reader = asyncio.ensure_future(self._read())

    async def _write_all(self) -> None:
        """Write the queued requests in order, then half-close; a failed write cancels the call, so the reader
        fails every pending request with the stream's status (or CANCELLED)."""
        try:
            while (request := await self._requests.get()) is not None:
                await self._call.write(request)
            await self._call.done_writing()
        except Exception:  # noqa: BLE001 - any write failure (the call ended, its channel closed): the stream is over
            self._call.cancel()

    async def _read(self) -> None:
        """The reader task: as :meth:`ForwardStream._read`."""
        settling: tuple[int, asyncio.Future[Any]] | None = None
        try:
            while True:
                response = await self._call.read()
                if response is grpc.aio.EOF:
                    break
                request_id, future, detailed = self._pending.popleft()
                self._slots.release()
                settling = (request_id, future)
                if not future.done():
                    _settle(future, request_id, response, detailed)
                settling = None
            error = ExpertServiceError(grpc.StatusCode.INTERNAL, "stream ended before every request was answered")
        except grpc.RpcError as err:
            error = ExpertServiceError.from_rpc_error(err)
        except asyncio.CancelledError:
            error = ExpertServiceError(grpc.StatusCode.CANCELLED, "stream cancelled")
            self._call.cancel()
        except Exception as exc:  # noqa: BLE001 - a dead reader would leave every future of the stream pending
            error = _reader_error(exc)
            self._call.cancel()
        self._error = error
        self._writer.cancel()  # the call is over: nothing more can be written (a stream dropped unclosed leaves no task)
        if settling is not None and not settling[1].done():
            settling[1].set_exception(ExpertServiceError(error.code, error.message, settling[0]))
        pending, self._pending = self._pending, deque()
        for request_id, future, _ in pending:
            if not future.done():
                future.set_exception(ExpertServiceError(error.code, error.message, request_id))
            self._slots.release()

    async def submit(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        detailed: bool = False,
    ) -> asyncio.Future[Any]:
        """Send one request (waits while ``max_in_flight`` are outstanding); returns the future of its output."""
        request_id = next(self._ids)
        hidden_states, scales = await self._hidden(hidden_states) if self._hidden is not None else (hidden_states, None)
        request = build_request(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, request_id=request_id, hidden_scales=scales,
        )
        return await self._write(request, detailed)

    async def send(self, request: pb.ForwardRequest) -> asyncio.Future[pb.ForwardResponse]:
        """Send an already built request (its ``request_id`` must be unique on this stream).

        Returns the future of the raw :class:`ForwardResponse`, whose ``status`` the caller
        reads (a per-request error does not fail the future; a broken stream does, with
        :class:`ExpertServiceError`). Waits while ``max_in_flight`` are outstanding.
        """
        return await self._write(request, None)

    @property
    def broken(self) -> bool:
        """The stream ended or failed: nothing more can be sent on it."""
        return self._closed or self._error is not None

    async def _write(self, request: pb.ForwardRequest, detailed: bool | None) -> asyncio.Future[Any]:
        request_id = request.request_id
        await self._slots.acquire()  # the only wait: a caller cancelled here has sent nothing
        if self._closed or self._error is not None:
            self._slots.release()
            error = self._error or ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, "stream is closed")
            raise ExpertServiceError(error.code, error.message, request_id)
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if detailed is None:  # a sender may stop waiting (its own deadline): no "never retrieved" noise then
            future.add_done_callback(_retrieve)
        self._pending.append((request_id, future, detailed))  # pending order is write order: the writer takes them in turn
        self._requests.put_nowait(request)
        return future

    async def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Send one request and wait for its output (arguments as for :meth:`submit`)."""
        return await (await self.submit(*args, **kwargs))

    def cancel(self) -> None:
        """Cancel the stream now: outstanding futures fail with CANCELLED."""
        self._closed = True
        self._call.cancel()
        self._writer.cancel()

    async def close(self) -> None:
        """Half-close the stream (after the requests sent so far are written) and wait for the remaining responses."""
        if not self._closed:
            self._closed = True
            self._requests.put_nowait(None)
        try:
            await asyncio.gather(self._writer, return_exceptions=True)
            await asyncio.shield(self._reader)  # a cancellation of the caller must reach the caller, not end the reader
        except asyncio.CancelledError:  # the caller was cancelled while it waited: the stream is aborted, not left open
            self.cancel()
            raise

    async def __aenter__(self) -> AsyncForwardStream:
        return self

    async def __aexit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._call.cancel()
        await self.close()


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "KEEPALIVE_OPTIONS",
    "AsyncExpertClient",
    "AsyncForwardStream",
    "ExpertClient",
    "ForwardResult",
    "ForwardStream",
    "WIRES",
    "build_request",
    "parse_response",
]
