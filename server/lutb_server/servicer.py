"""``lutb.v1.ExpertService`` over grpc.aio: decode, validate, hand to the scheduler, encode.

Thin by design: validation lives in the engine, pooling in the scheduler, the
error-to-status map in :mod:`lutb_server.errors`.

:func:`add_to_server` registers the handlers as the generated ``add_ExpertServiceServicer_to_server`` does
(the same methods and kinds, taken from the service descriptor) except for how a request is
parsed: bytes that are not the method's request message become a :class:`MalformedRequest`, which the
handler refuses with INVALID_ARGUMENT like any other bad input (on a stream: that request's response, the
stream going on), instead of a parse error escaping to grpc, which answers UNKNOWN and ends the call. Responses
serialize as the generated code's do, but for a large output from a compute process, which is joined to its
message at serialization (:class:`SplicedResponse`) instead of being copied into it first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NamedTuple

import grpc
import torch
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.codec import WireTensor, encode_tensor, tensor_field_parts, to_proto_dtype
from lutb_kernels.checkpoint import FORMAT, FORMAT_VERSION
from lutb_server import __version__
from lutb_server.byte_budget import BudgetShare, ByteBudget
from lutb_server.engine import FLOAT_DTYPES, ID_DTYPES, ExpertEngine
from lutb_server.errors import (
    ContentHashMismatch, InvalidArgument, ResponseTooLarge, TooManyStreams, Unavailable, cancelled_status, status_code_value, to_status,
)
from lutb_server.metrics import ServerMetrics
from lutb_server.scheduler import BatchScheduler

log = logging.getLogger(__name__)

_OUTPUT_MODES = {pb.OUTPUT_MODE_UNSPECIFIED: "combined", pb.COMBINED: "combined", pb.ROUTE_MAJOR: "route_major"}
STREAM_WINDOW = 256
"""Most requests of one ForwardStream in flight at once (reading pauses beyond it)."""
DEFAULT_STREAM_BUDGET_BYTES = 512 * 1024 * 1024
"""``ServerSettings.stream_budget_bytes``'s default: bytes of stream responses a serving process holds at once."""
DEFAULT_MAX_STREAMS = 1024
"""``ServerSettings.max_streams``'s default: ``ForwardStream`` calls a serving process holds open at once."""
STREAM_SHARE = 8
"""One stream holds at most ``1 / STREAM_SHARE`` of the stream budget (a larger response counts as that much), so that
a client that stops reading pauses its own stream, not every stream of the serving process."""
RESPONSE_ENVELOPE_BYTES = 1024
"""Room left in a response message for everything but the output tensor's bytes (ids, status, timing)."""


def build_model_info(engine: ExpertEngine, *, max_batch_tokens: int, front_end: int = 0, front_ends: int = 1,
                     max_message_bytes: int | None = None, instance_id: str = "") -> pb.ModelInfo:
    """The ``ModelInfo`` an engine serves from front end ``front_end`` of ``front_ends``; ``max_message_bytes``
    the server's message bound (None: unbounded here, sent as 0); ``instance_id`` the server's (every front end's)."""
    config = engine.config
    return pb.ModelInfo(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_experts=config.num_experts,
        layers=[pb.LayerInfo(layer=layer, expert_ids=engine.expert_ids(layer)) for layer in engine.layer_ids],
        activation=config.activation,
        dtype=to_proto_dtype(config.torch_dtype),
        mxfp8_scale_mode=config.mxfp8_scale_mode,
        backend=engine.backend.name,
        backend_reason=engine.backend.reason,
        device=str(engine.device),
        max_tokens_per_request=engine.max_tokens_per_request,
        max_top_k=engine.max_top_k,
        content_hash=engine.content_hash,
        server_version=__version__,
        max_batch_tokens=max_batch_tokens,
        front_end=front_end,
        front_ends=front_ends,
        max_message_bytes=max_message_bytes or 0,
        instance_id=instance_id,
    )


SERVICE: ServiceDescriptor = pb.DESCRIPTOR.services_by_name["ExpertService"]
"""``lutb.v1.ExpertService``'s descriptor: the methods :func:`add_to_server` registers."""


class MalformedRequest:
    """What a request that does not parse as its method's message becomes (see :func:`lenient_deserializer`).

    The handlers refuse it with :meth:`error` (INVALID_ARGUMENT); ``request_id`` is 0, as the bytes carry none
    that can be read, so a stream answers it with request_id 0 in its place in the order.
    """

    __slots__ = ("type_name", "reason")
    request_id = 0

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason

    def error(self) -> InvalidArgument:
        """``request: not a valid lutb.v1.ForwardRequest (<what protobuf said>)``."""
        return InvalidArgument(f"request: not a valid {self.type_name} ({self.reason})")


def lenient_deserializer(message_class: type[Message]) -> Callable[[bytes], Any]:
    """``message_class.FromString``, except that bytes it cannot parse give a :class:`MalformedRequest`, never an
    exception (grpc would answer UNKNOWN, and end a stream)."""
    parse = message_class.FromString
    type_name = message_class.DESCRIPTOR.full_name

    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:  # "Error parsing message with type '...': Wire format was corrupt": the last part
            return MalformedRequest(type_name, str(exc).rpartition(": ")[2] or "unparsable")

    return deserialize


SPLICE_OUTPUT_BYTES = 32 * 1024
"""Output bytes from which a response carries its output as a :class:`SplicedResponse`. Below it the message is built
whole: for small outputs the splice's own Python work costs more than the copy it saves; the two cost the same near
32 KB (``bench/response_splice.py``; bench/results/2026-12-07-response-splice-cpu.md)."""


class SplicedResponse(NamedTuple):
    """A ``ForwardResponse`` whose output tensor's bytes are joined to its other fields when gRPC serializes it
    (:func:`serialize_response`): they are copied once, instead of into the message and again out of it. The bytes on
    the wire are the same message (protobuf parsers take fields in any order)."""

    message: pb.ForwardResponse
    """Every field but ``output``."""
    output: WireTensor


_OUTPUT_FIELD = pb.ForwardResponse.DESCRIPTOR.fields_by_name["output"].number


def serialize_response(response: Message | SplicedResponse) -> bytes:
    """A handler's response in wire form: a message's ``SerializeToString``, a :class:`SplicedResponse` joined."""
    if isinstance(response, SplicedResponse):
        head, data = tensor_field_parts(_OUTPUT_FIELD, response.output)
        return b"".join((response.message.SerializeToString(), head, data))
    return response.SerializeToString()


_HANDLER_KINDS: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""The handler maker of a method, by (client streaming, server streaming)."""


def method_handlers(servicer: pb_grpc.ExpertServiceServicer) -> dict[str, grpc.RpcMethodHandler]:
    """Every ``lutb.v1.ExpertService`` method's handler, by method name: the kind and behaviour the generated code
    gives it, a :func:`lenient_deserializer` of its request message, and :func:`serialize_response` (which serializes
    a message as the generated code does, and joins a :class:`SplicedResponse`)."""
    handlers = {}
    for method in SERVICE.methods:
        make = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = make(
            getattr(servicer, method.name),
            request_deserializer=lenient_deserializer(message_factory.GetMessageClass(method.input_type)),
            response_serializer=serialize_response,
        )
    return handlers


def add_to_server(servicer: pb_grpc.ExpertServiceServicer, server: grpc.aio.Server) -> None:
    """Register ``servicer`` on ``server`` as ``pb_grpc.add_ExpertServiceServicer_to_server`` does (a generic
    handler and the registered methods, under the same paths), with :func:`method_handlers`."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
    server.add_registered_method_handlers(SERVICE.full_name, handlers)


def _deadline(context: grpc.aio.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class ExpertServicer(pb_grpc.ExpertServiceServicer):
    """The ExpertService handlers.

    The servicer is registered before the checkpoint is loaded (so that health answers
    NOT_SERVING meanwhile); :meth:`bind` hands it the engine and scheduler once they exist.

    Args:
        metrics: counts forward requests by RPC and status.
        accepting: returns False while the server drains; stream requests then get UNAVAILABLE.
        draining: set when the server starts draining: each open ``ForwardStream`` stops reading, answers the requests
            it has read, and ends with UNAVAILABLE (the client opens its next stream elsewhere), instead of holding
            the drain until its client half-closes or the grace runs out.
        max_response_bytes: the largest message the server sends (its ``max_message_bytes``): a
            request whose output would not fit is refused before it is computed.
        stream_budget_bytes: bytes of ``ForwardStream`` responses held at once over all streams (each stream at most
            ``1 / STREAM_SHARE`` of it), from a request's read until gRPC takes its response. A stream reads its next
            request only when its share and the budget have room for another response of its last one's size, then
            sets that request's bytes aside (:meth:`_held_bytes`), so a client that does not read its responses stops
            being read, and its requests wait in HTTP/2 flow control instead of memory.
        max_streams: ``ForwardStream`` calls open at once; one more is refused at its start with RESOURCE_EXHAUSTED
            (:class:`~lutb_server.errors.TooManyStreams`). Each open stream may hold one request outside the stream
            budget while it waits for room, so this bounds those requests too (to ``max_streams`` messages).
    """

    def __init__(
        self,
        engine: ExpertEngine | None = None,
        scheduler: BatchScheduler | None = None,
        *,
        metrics: ServerMetrics | None = None,
        accepting: Callable[[], bool] = lambda: True,
        draining: asyncio.Event | None = None,
        max_response_bytes: int | None = None,
        stream_budget_bytes: int = DEFAULT_STREAM_BUDGET_BYTES,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        self._metrics = metrics
        self._max_streams = max_streams
        self._open_streams = 0
        self._stream_budget = ByteBudget(stream_budget_bytes)
        if metrics is not None:  # read at each scrape: nothing per request
            metrics.stream_held_bytes.set_function(lambda: self._stream_budget.held)
        self._draining = draining
        self._max_response_bytes = max_response_bytes
        self._counters: dict[tuple[str, grpc.StatusCode], Any] = {}
        self._accepting = accepting
        self._engine: ExpertEngine | None = None
        self._scheduler: BatchScheduler | None = None
        self._info: pb.ModelInfo | None = None
        if engine is not None and scheduler is not None:
            self.bind(engine, scheduler)

    def bind(self, engine: ExpertEngine, scheduler: BatchScheduler, *, front_end: int = 0, front_ends: int = 1,
             instance_id: str = "") -> None:
        """Serve ``engine``'s model through ``scheduler`` from now on, as front end ``front_end`` of ``front_ends`` of
        the server ``instance_id``."""
        self._engine = engine
        self._scheduler = scheduler
        self._info = build_model_info(engine, max_batch_tokens=scheduler.max_batch_tokens, front_end=front_end,
                                      front_ends=front_ends, max_message_bytes=self._max_response_bytes,
                                      instance_id=instance_id)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest | MalformedRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(request.error()))
        if self._info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "server is still loading its checkpoint")
        return self._info

    async def Forward(self, request: pb.ForwardRequest | MalformedRequest,
                      context: grpc.aio.ServicerContext) -> pb.ForwardResponse | SplicedResponse:
        received = time.monotonic()
        deadline = _deadline(context)
        try:
            response = await self._forward(request, deadline, received)
        except asyncio.CancelledError:
            self._count("Forward", cancelled_status(deadline))
            raise
        except Exception as exc:
            code, message = to_status(exc)
            self._count("Forward", code)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("Forward request %d failed", request.request_id)
            await context.abort(code, message)
        self._count("Forward", grpc.StatusCode.OK)
        return response

    async def ForwardStream(
        self, request_iterator: AsyncIterator[pb.ForwardRequest | MalformedRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.ForwardResponse | SplicedResponse]:
        if self._open_streams >= self._max_streams:
            await context.abort(*to_status(TooManyStreams(
                f"too many streams: {self._open_streams} ForwardStream calls open on this serving process (max_streams = "
                f"{self._max_streams}); retry later, or send requests of several callers on one stream")))
        deadline = _deadline(context)
        window: asyncio.Queue[tuple[asyncio.Task[pb.ForwardResponse | SplicedResponse], int] | None] = asyncio.Queue()
        slots = asyncio.Semaphore(STREAM_WINDOW)  # requests being computed; reading pauses while none is free
        share = BudgetShare(self._stream_budget, max(1, self._stream_budget.limit // STREAM_SHARE))

        async def read() -> None:
            requests = request_iterator.__aiter__()
            try:
                while True:
                    await slots.acquire()
                    await share.room()  # reading pauses while this stream's share or the budget is full
                    try:
                        request = await requests.__anext__()
                    except StopAsyncIteration:
                        break
                    held = await share.take(self._held_bytes(request))
                    window.put_nowait((asyncio.ensure_future(self._stream_one(request, deadline)), held))
            finally:
                window.put_nowait(None)

        reader = asyncio.create_task(read())

        def ended(_: object) -> None:  # the call is over, however it ended: whatever the stream still holds goes back
            self._open_streams -= 1
            reader.cancel()
            share.close()

        self._open_streams += 1
        context.add_done_callback(ended)
        watch = asyncio.create_task(self._end_on_drain(reader)) if self._draining is not None else None
        try:
            while True:
                item = await window.get()
                if item is None:
                    break
                task, held = item
                try:
                    response = await task
                    slots.release()
                    yield response  # returns once gRPC has taken the response
                finally:
                    share.give_back(held)
            if reader.cancelled() and self._draining is not None and self._draining.is_set():
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "server is draining: the stream ends; open the next one to another replica")
            await reader  # surfaces an error of the request stream itself
        finally:
            if watch is not None:
                watch.cancel()
            reader.cancel()
            while not window.empty():
                leftover = window.get_nowait()
                if leftover is not None:
                    leftover[0].cancel()
                    share.give_back(leftover[1])

    async def _end_on_drain(self, reader: asyncio.Task[None]) -> None:
        """Stop a stream's reading once the server drains (the requests read so far are still answered)."""
        assert self._draining is not None
        await self._draining.wait()
        reader.cancel()

    def _held_bytes(self, request: pb.ForwardRequest | MalformedRequest) -> int:
        """What a stream request holds until its response is taken, from its shapes alone (read before it is decoded):
        its output ``[T, H]`` (route-major ``[T, k, H]``) in the model dtype and the response's envelope; a request that
        is not well formed (it is answered with an error) its envelope only. Its input
        is about its output's size or less (the same ``[T, H]``; ``k`` times less than route-major), so the budget bounds
        the requests' bytes too, to about twice."""
        if isinstance(request, MalformedRequest) or self._engine is None:
            return RESPONSE_ENVELOPE_BYTES
        shape = request.topk_ids.shape
        if len(shape) != 2:
            return RESPONSE_ENVELOPE_BYTES
        tokens, k = max(0, shape[0]), max(0, shape[1])
        config = self._engine.config
        rows = tokens * k if request.output_mode == pb.ROUTE_MAJOR else tokens
        output = rows * config.hidden_size * config.torch_dtype.itemsize
        return RESPONSE_ENVELOPE_BYTES + output

    async def _stream_one(self, request: pb.ForwardRequest | MalformedRequest,
                          deadline: float | None) -> pb.ForwardResponse | SplicedResponse:
        """One stream message: never raises; an error becomes the response's status."""
        received = time.monotonic()
        try:
            if not self._accepting():
                raise Unavailable("server is draining; send this request to another replica")
            response = await self._forward(request, deadline, received)
        except asyncio.CancelledError:
            self._count("ForwardStream", cancelled_status(deadline))
            raise
        except Exception as exc:
            code, message = to_status(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("ForwardStream request %d failed", request.request_id)
            self._count("ForwardStream", code)
            return pb.ForwardResponse(request_id=request.request_id, status=pb.Status(code=status_code_value(code), message=message))
        self._count("ForwardStream", grpc.StatusCode.OK)
        return response

    async def _forward(
        self, request: pb.ForwardRequest | MalformedRequest, deadline: float | None, received: float
    ) -> pb.ForwardResponse | SplicedResponse:
        """Answer one request (an output of :data:`SPLICE_OUTPUT_BYTES` or more as a :class:`SplicedResponse`); a
        :class:`~lutb_server.errors.ServiceError` (or a bug) for one it cannot answer."""
        if isinstance(request, MalformedRequest):
            raise request.error()
        if self._engine is None or self._scheduler is None:
            raise Unavailable("server is still loading its checkpoint")
        expected = request.expected_content_hash
        if expected and expected != self._engine.content_hash:
            raise ContentHashMismatch(
                f"expected_content_hash: the request expects checkpoint {expected} but this server serves "
                f"{self._engine.content_hash} (restarted with another checkpoint or placement?)")
        if request.output_mode not in _OUTPUT_MODES:
            raise InvalidArgument(f"output_mode: unknown value {request.output_mode}")
        for name in ("hidden_states", "topk_ids", "topk_weights"):
            if not request.HasField(name):
                raise InvalidArgument(f"{name}: missing")
        # The tensors stay the message's bytes (WireTensor): the engine checks them through numpy, and a compute
        # process takes them into its shared memory as they are, so a request costs the event loop no torch call.
        scales = None
        if request.HasField("hidden_scales"):  # MXFP8 on the wire: the engine checks it and dequantizes it (on the device on CUDA)
            x = WireTensor.from_message(request.hidden_states, name="hidden_states (with hidden_scales)", dtypes=(torch.float8_e4m3fn,))
            scales = WireTensor.from_message(request.hidden_scales, name="hidden_scales", dtypes=(torch.uint8,))
        elif request.hidden_states.dtype == pb.FLOAT8_E4M3FN:
            raise InvalidArgument("hidden_states: FLOAT8_E4M3FN (MXFP8) needs hidden_scales, UINT8 [T, H/32]")
        else:
            x = WireTensor.from_message(request.hidden_states, name="hidden_states", dtypes=FLOAT_DTYPES)
        ids = WireTensor.from_message(request.topk_ids, name="topk_ids", dtypes=ID_DTYPES)
        weights = WireTensor.from_message(request.topk_weights, name="topk_weights", dtypes=(torch.float32,))
        prepared = self._engine.prepare(
            request.layer, x, ids, weights, hidden_scales=scales,
            apply_router_weight_on_input=request.apply_router_weight_on_input,
            output_mode=_OUTPUT_MODES[request.output_mode],
        )
        if self._max_response_bytes is not None and prepared.output_bytes + RESPONSE_ENVELOPE_BYTES > self._max_response_bytes:
            raise ResponseTooLarge(
                f"the {prepared.output_mode} output {prepared.output_shape} takes {prepared.output_bytes} bytes: more than a message of "
                f"max_message_bytes = {self._max_response_bytes} holds; send fewer tokens per request"
            )
        ready = time.monotonic()  # decoded and validated (prepare_us ends here)
        result = await self._scheduler.submit(prepared, deadline=deadline)
        if self._metrics is not None and self._metrics.expert_load is not None:  # answered requests only
            self._metrics.expert_load.record(self._engine, prepared)
        response = pb.ForwardResponse(request_id=request.request_id, status=pb.Status(code=0))
        encoding = time.monotonic()
        output = result.output
        spliced = isinstance(output, WireTensor) and len(output.data) >= SPLICE_OUTPUT_BYTES
        if not spliced:  # (spliced: the bytes are joined to the message when gRPC serializes it, after timing ends)
            encode_tensor(output, out=response.output)
        done = time.monotonic()
        timing = response.timing
        timing.queue_us = int(result.queue_s * 1e6)
        timing.compute_us = int(result.compute_s * 1e6)
        timing.handoff_us = int(result.handoff_s * 1e6)
        timing.wait_us = int(result.wait_s * 1e6)
        timing.batch_tokens = result.batch_tokens
        timing.prepare_us = int((ready - received) * 1e6)
        timing.encode_us = int((done - encoding) * 1e6)
        timing.total_us = int((done - received) * 1e6)
        return SplicedResponse(response, output) if spliced else response

    def _count(self, rpc: str, code: grpc.StatusCode) -> None:
        if self._metrics is not None:
            child = self._counters.get((rpc, code))
            if child is None:  # labels() takes a lock and builds a key: once per (rpc, code), not per request
                child = self._counters[(rpc, code)] = self._metrics.forward_requests.labels(rpc, code.name)
            child.inc()


__all__ = [
    "DEFAULT_MAX_STREAMS",
    "RESPONSE_ENVELOPE_BYTES",
    "SERVICE",
    "SPLICE_OUTPUT_BYTES",
    "STREAM_SHARE",
    "STREAM_WINDOW",
    "ExpertServicer",
    "MalformedRequest",
    "SplicedResponse",
    "add_to_server",
    "build_model_info",
    "lenient_deserializer",
    "method_handlers",
    "serialize_response",
]
