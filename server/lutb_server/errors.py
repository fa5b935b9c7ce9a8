"""The server's errors and THE map from an error to a gRPC status (the only one).

Engine and scheduler raise :class:`ServiceError` subclasses, which name their status
code as a string so that they need no gRPC import; the servicer turns any exception
into ``(grpc.StatusCode, message)`` with :func:`to_status`. Bad input never maps
to INTERNAL: every refusal of a request raises one of the classes below, a
:class:`lutb_client.codec.CodecError` or a ``lutb_kernels`` ``ValueError``.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, ClassVar

from lutb_client.codec import CodecError
from lutb_kernels.errors import LutBError

if TYPE_CHECKING:
    import grpc


class ServiceError(Exception):
    """Base class of the errors a request can end with; :attr:`code` names its gRPC status."""

    code: ClassVar[str] = "INTERNAL"


class InvalidArgument(ServiceError):
    """The request is malformed; the message names the field."""

    code = "INVALID_ARGUMENT"


class LayerNotFound(ServiceError):
    """The request names a layer this server does not hold."""

    code = "NOT_FOUND"


class QueueFull(ServiceError):
    """The scheduler's queue holds ``max_queue_requests`` requests already."""

    code = "RESOURCE_EXHAUSTED"


class TooManyStreams(ServiceError):
    """The serving process holds ``max_streams`` open ``ForwardStream`` calls already; a new one is refused at its start."""

    code = "RESOURCE_EXHAUSTED"


class ResponseTooLarge(ServiceError):
    """The request's output would not fit in one message of the server's ``max_message_bytes``."""

    code = "RESOURCE_EXHAUSTED"


class DeadlineExpired(ServiceError):
    """The request's deadline passed before its batch started; it was not computed."""

    code = "DEADLINE_EXCEEDED"


EXPIRED_IN_WORKER = "deadline expired while the batch waited for the compute worker; not computed"
"""The message of the :class:`DeadlineExpired` a compute worker raises for a batch whose every deadline passed while
it waited there (behind other batches, or other front ends' batches in a compute process)."""


class Unavailable(ServiceError):
    """The server is loading or draining; the client should retry (elsewhere)."""

    code = "UNAVAILABLE"


class ComputeStalled(Unavailable):
    """The compute worker has held batches without answering any for longer than the server's ``compute_stall_s``:
    the server takes itself out of service."""


class ContentHashMismatch(ServiceError):
    """The request's ``expected_content_hash`` is not the content hash of the checkpoint this server serves."""

    code = "FAILED_PRECONDITION"


class BackendUnavailableError(RuntimeError):
    """A backend or device that was asked for cannot run here (startup error, not a request error)."""


# Exception type -> status name, first match wins. Request errors of lutb_kernels and the
# codec are ValueErrors that name the field; they are bad input, never INTERNAL. (Names,
# not grpc.StatusCode members, so that the engine can import this module without gRPC.)
_STATUS_MAP: tuple[tuple[type[BaseException], str], ...] = (
    (CodecError, "INVALID_ARGUMENT"),
    (LutBError, "INVALID_ARGUMENT"),
    (asyncio.TimeoutError, "DEADLINE_EXCEEDED"),
    (asyncio.CancelledError, "CANCELLED"),
)


DEADLINE_SLACK_S = 0.010
"""A handler cancelled this close to its deadline (or later) ended by the deadline, not by its caller. The server's
copy of a deadline starts when the call's headers are read, later than the caller's by their transit and the server's
delay in reading them, so the caller's own expiry (which cancels the call) can reach the server a few milliseconds
before the server's copy runs out: with 1 ms, such calls on a busy 2-CPU machine were counted CANCELLED. Only the
status a cancelled call is counted with depends on it, never whether a request is computed."""


def deadline_reached(deadline: float | None) -> bool:
    """True when ``deadline`` (``time.monotonic()`` seconds; None: no deadline) has passed or is at most
    ``DEADLINE_SLACK_S`` away: a request cancelled then ended by its deadline, not by its caller."""
    return deadline is not None and time.monotonic() >= deadline - DEADLINE_SLACK_S


def cancelled_status(deadline: float | None) -> grpc.StatusCode:
    """How a request that gRPC cancelled ended: DEADLINE_EXCEEDED when its deadline was reached, else CANCELLED."""
    import grpc

    return grpc.StatusCode.DEADLINE_EXCEEDED if deadline_reached(deadline) else grpc.StatusCode.CANCELLED


def to_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and message a request that raised ``exc`` ends with.

    The device running out of memory (``torch.cuda.OutOfMemoryError``, also from a compute process) is
    RESOURCE_EXHAUSTED, not INTERNAL: no bug, a request too large for the memory left (its routes, ``T * k``, set the
    experts' working memory); the scheduler reruns a failed pooled batch's requests alone, so this reaches a request
    that runs out of memory by itself, and the server goes on."""
    import grpc
    import torch

    if isinstance(exc, ServiceError):
        return getattr(grpc.StatusCode, exc.code), str(exc)
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, (
            f"the device ran out of memory computing the batch this request was in; send fewer tokens or routes "
            f"per request, or retry: {' '.join(str(exc).split())[:300]}")
    for exc_type, name in _STATUS_MAP:
        if isinstance(exc, exc_type):
            return getattr(grpc.StatusCode, name), str(exc) or exc_type.__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def status_code_value(code: grpc.StatusCode) -> int:
    """The numeric google.rpc.Code of a status (what ``lutb.v1.Status.code`` carries)."""
    return int(code.value[0])


__all__ = [
    "DEADLINE_SLACK_S",
    "BackendUnavailableError",
    "ContentHashMismatch",
    "DeadlineExpired",
    "InvalidArgument",
    "LayerNotFound",
    "QueueFull",
    "ResponseTooLarge",
    "ServiceError",
    "TooManyStreams",
    "Unavailable",
    "cancelled_status",
    "deadline_reached",
    "status_code_value",
    "to_status",
]
