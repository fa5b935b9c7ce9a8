"""The one exception type the clients raise."""

from __future__ import annotations

import grpc


class ExpertServiceError(Exception):
    """A call to the expert service failed.

    Attributes:
        code: the gRPC status code (``grpc.StatusCode``), e.g. ``INVALID_ARGUMENT``.
        message: the server's (or gRPC's) explanation; names the field for bad input.
        request_id: the request it concerns, where known (stream requests).
    """

    def __init__(self, code: grpc.StatusCode, message: str, request_id: int | None = None) -> None:
        self.code = code
        self.message = message
        self.request_id = request_id
        where = f" (request {request_id})" if request_id is not None else ""
        super().__init__(f"{code.name}: {message}{where}")

    @classmethod
    def from_rpc_error(cls, err: grpc.RpcError, request_id: int | None = None) -> ExpertServiceError:
        code = err.code() if callable(getattr(err, "code", None)) else grpc.StatusCode.UNKNOWN
        details = err.details() if callable(getattr(err, "details", None)) else str(err)
        return cls(code or grpc.StatusCode.UNKNOWN, details or "", request_id)


_CODES_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """``grpc.StatusCode`` of a numeric google.rpc.Code (``lutb.v1.Status.code``)."""
    return _CODES_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


__all__ = ["ExpertServiceError", "status_code"]
