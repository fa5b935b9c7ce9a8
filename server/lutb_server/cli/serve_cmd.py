"""``lutb serve``: run the expert server until SIGTERM/SIGINT.

Every flag is a field of :class:`lutb_server.settings.ServerSettings`; the help
text, environment variable name and default come from the model, so the two
cannot drift apart.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from typing import Any, Literal

EXIT_STARTUP_ERROR = 2


def _field_type(annotation: Any) -> tuple[Any, tuple[str, ...] | None, bool]:
    """(argparse type, choices, is_bool) of a settings field annotation."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _field_type(args[0])
    if origin is Literal:
        return str, tuple(typing.get_args(annotation)), False
    if annotation is bool:
        return None, None, True
    if annotation in (int, float, str):
        return annotation, None, False
    return str, None, False


def register(subparsers: argparse._SubParsersAction) -> None:
    from lutb_server.settings import ServerSettings, env_name, flag_name

    parser = subparsers.add_parser(
        "serve",
        help="serve a LUT-B checkpoint's experts over gRPC (the demo checkpoint when none is given)",
        description=(
            "Serve lutb.v1.ExpertService, grpc.health.v1 and reflection on HOST:PORT and Prometheus metrics "
            "on HOST:METRICS_PORT. Settings come from flags, then LUTB_* environment variables, then the "
            "--config YAML file (keys as the flag names with underscores), then the defaults shown. "
            "SIGTERM/SIGINT drain: health NOT_SERVING, new calls UNAVAILABLE, calls in flight get "
            "--shutdown-grace-s seconds."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for name, field in ServerSettings.model_fields.items():
        kind, choices, is_bool = _field_type(field.annotation)
        default = field.default
        shown = "none" if default is None else str(default)
        help_text = f"{field.description} [env {env_name(name)}; default: {shown}]"
        kwargs: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS, "help": help_text}
        if is_bool:
            parser.add_argument(flag_name(name), action=argparse.BooleanOptionalAction, **kwargs)
            continue
        metavar = name.upper() if name not in ("checkpoint", "demo_dir", "config") else ("FILE" if name == "config" else "DIR")
        if choices:
            metavar = "{" + ",".join(choices) + "}"
        parser.add_argument(flag_name(name), type=kind, choices=choices, metavar=metavar, **kwargs)
    parser.set_defaults(run=run)


def settings_from_args(args: argparse.Namespace) -> Any:
    """ServerSettings from the flags given (env, file and defaults fill the rest)."""
    from lutb_server.settings import ServerSettings, load_settings

    given = {name: getattr(args, name) for name in ServerSettings.model_fields if hasattr(args, name)}
    return load_settings(given)


def run(args: argparse.Namespace) -> int:
    import logging

    from pydantic import ValidationError

    from lutb_kernels.errors import LutBError
    from lutb_server import event_loop
    from lutb_server.app import serve
    from lutb_server.cpu_placement import allowed_cpus, choose_compute_cpu
    from lutb_server.errors import BackendUnavailableError
    from lutb_server.settings import unknown_env

    log = logging.getLogger("lutb_server.serve")
    try:
        settings = settings_from_args(args)
        choose_compute_cpu(settings.compute_cpu, allowed_cpus())  # a CPU this process may not use: refused here
    except (ValidationError, ValueError) as exc:
        print(f"lutb serve: invalid settings: {exc}", file=sys.stderr)
        return EXIT_STARTUP_ERROR
    for message in unknown_env():
        log.warning("%s", message)
    log.info("settings: %s", settings.model_dump_json())

    def ready(server: Any) -> None:
        engine = server.engine
        log.info("serving lutb.v1.ExpertService on %s (checkpoint %s, %s)", server.address, engine.checkpoint.path, engine.content_hash)
        if server.metrics_port:
            log.info("metrics on http://%s:%d/metrics", settings.host, server.metrics_port)
        print(f"lutb serve: listening on {settings.host}:{server.port}", flush=True)

    try:
        return event_loop.run(serve(settings, on_ready=ready), settings.event_loop)
    except (BackendUnavailableError, LutBError, OSError, RuntimeError) as exc:
        print(f"lutb serve: error: {exc}", file=sys.stderr)
        return EXIT_STARTUP_ERROR
