"""``lutb health TARGET``: one ``grpc.health.v1.Health/Check`` call, for probes and scripts.

Exit codes (what container health checks and shell scripts branch on):

- 0: the service answered SERVING;
- 1: the server answered, but not SERVING (NOT_SERVING, UNKNOWN, or the service name is
  not registered with its health service);
- 2: no answer: unreachable, timed out, or the server has no health service.

Docker reserves exit code 2 in ``HEALTHCHECK``; the Dockerfile maps any failure to 1.
"""

from __future__ import annotations

import argparse

from lutb_server.cli._args import positive_float

EXIT_SERVING = 0
EXIT_NOT_SERVING = 1
EXIT_NO_ANSWER = 2

DEFAULT_TIMEOUT_S = 5.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "health",
        help="check a server's grpc.health.v1 status (exit 0 only when SERVING)",
        description=(
            "Call grpc.health.v1.Health/Check on TARGET and print the status. "
            "Exit 0 when SERVING, 1 when the server answers anything else, "
            "2 when it cannot be reached in time."
        ),
    )
    parser.add_argument("target", metavar="TARGET", help="server address, host:port (e.g. 127.0.0.1:50051)")
    parser.add_argument(
        "--service",
        default="",
        metavar="NAME",
        help='service name to check; "" (default) is the whole server, e.g. lutb.v1.ExpertService',
    )
    parser.add_argument(
        "--timeout",
        type=positive_float,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"seconds to wait for the answer, connecting included (default: {DEFAULT_TIMEOUT_S:g})",
    )
    parser.set_defaults(run=run)


def check(target: str, service: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, str]:
    """Return ``(exit_code, status_text)`` for one health check of ``service`` on ``target``."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            # wait_for_ready: keep trying to connect until the deadline, so a server that is
            # still binding its port counts as "no answer yet" rather than failing instantly.
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s, wait_for_ready=True
            )
        except grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            if code == grpc.StatusCode.NOT_FOUND:
                return EXIT_NOT_SERVING, "SERVICE_UNKNOWN"
            name = code.name if code is not None else "ERROR"
            details = err.details() if callable(getattr(err, "details", None)) else str(err)
            return EXIT_NO_ANSWER, f"{name}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status == health_pb2.HealthCheckResponse.SERVING:
        return EXIT_SERVING, status
    return EXIT_NOT_SERVING, status


def run(args: argparse.Namespace) -> int:
    code, text = check(args.target, args.service, args.timeout)
    service = args.service or '""'
    print(f"{args.target} {service}: {text}", flush=True)
    return code
