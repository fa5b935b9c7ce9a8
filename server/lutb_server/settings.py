"""Server configuration: one pydantic-settings model, four layers.

Precedence, highest first: command-line flags (``lutb serve --max-wait-us 200``),
environment variables (``LUTB_MAX_WAIT_US=200``), a YAML file (``--config FILE`` or
``LUTB_CONFIG``; keys are the field names, ``max_wait_us: 200``), the defaults here.
``lutb serve --help`` is generated from the field descriptions below.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from lutb_server.event_loop import EventLoopKind

ENV_PREFIX = "LUTB_"
BUILTIN_BACKENDS = ("auto", "reference", "emulated", "packed", "native")
_BACKEND_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")  # module:Class, a LayerExperts subclass of one's own
_DEVICE = re.compile(r"^(auto|cpu|cuda|cuda:\d+)$")


class ServerSettings(BaseSettings):
    """Everything ``lutb serve`` can be told. Field names are the YAML keys; flags and
    environment variables derive from them (``max_wait_us`` -> ``--max-wait-us``, ``LUTB_MAX_WAIT_US``)."""

    # An empty variable (LUTB_CHECKPOINT=, the usual way to unset one in a manifest) means "not set".
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", case_sensitive=False, env_ignore_empty=True)

    checkpoint: Path | None = Field(
        None, description="LUT-B checkpoint directory to serve; unset serves the built-in demo checkpoint"
    )
    demo_dir: Path = Field(
        Path("~/.cache/lutb-moe/demo"),
        description="where the demo checkpoint is made once and cached (used when no checkpoint is given)",
    )
    host: str = Field("0.0.0.0", description="address the gRPC and metrics servers listen on")
    port: int = Field(50051, ge=0, le=65535, description="gRPC port (0 picks a free one)")
    metrics_port: int = Field(9400, ge=0, le=65535, description="Prometheus metrics HTTP port; 0 disables metrics serving")
    backend: str = Field(
        "auto", description="experts backend: auto (best available), reference, emulated, packed, native, or "
        "package.module:Class for a LayerExperts subclass of your own"
    )
    device: str = Field("auto", description="torch device: auto (cuda if present, else cpu), cpu, cuda or cuda:N")
    max_batch_tokens: int = Field(
        8192, ge=1, description="most tokens pooled into one experts call (a larger single request runs alone)"
    )
    max_wait_us: int = Field(
        0, ge=0, description="how long the oldest request waits for company when the worker has room for a batch, in microseconds "
        "(0: never; under load requests pool while the worker is busy anyway)"
    )
    batches_in_flight: int = Field(
        1, ge=1, le=64, description="most batches a serving process has handed to the compute worker and not had answered; "
        "above 1 the next batch goes over while earlier ones compute (a compute process merging several front ends' "
        "batches then finds it there when its next call starts); each front end's shared arena holds N + 1 full batches",
    )
    max_queue_requests: int = Field(
        1024, ge=1, description="requests waiting in the scheduler before new ones get RESOURCE_EXHAUSTED"
    )
    max_tokens_per_request: int = Field(
        4096, ge=1, description="largest token count T of one request (more is INVALID_ARGUMENT)"
    )
    max_top_k: int = Field(
        32, ge=1, description="most routes per token k of one request (topk_ids [T, k]; more is INVALID_ARGUMENT): a "
        "call's GPU memory and time grow with its routes, tokens x k, and each new k may capture CUDA graphs of its own"
    )
    max_message_bytes: int = Field(
        256 * 1024 * 1024, ge=4 * 1024 * 1024, le=2**31 - 1,  # gRPC's channel arguments are C ints
        description="largest gRPC message received or sent, in bytes (at most 2147483647)",
    )
    stream_budget_bytes: int = Field(
        512 * 1024 * 1024, ge=1024 * 1024,
        description="bytes of ForwardStream responses a serving process holds at once, from a request's read to gRPC "
        "taking its response (computing, or waiting for a client that does not read); beyond it streams pause reading "
        "requests, and HTTP/2 flow control holds their clients back. One stream holds at most an eighth of it (a "
        "larger response counts as an eighth)",
    )
    max_streams: int = Field(
        1024, ge=1, description="ForwardStream calls a serving process holds open at once; one more is refused at its "
        "start with RESOURCE_EXHAUSTED. Each open stream may hold one request outside the stream budget while it waits "
        "for room, so this also bounds those requests (to max_streams messages)",
    )
    shutdown_grace_s: float = Field(
        20.0, ge=0, description="on SIGTERM/SIGINT, seconds in-flight calls get to finish before they are cancelled"
    )
    validate_checkpoint: bool = Field(
        True, description="check every weight tile of the checkpoint at startup (spec section 1 rules)"
    )
    cuda_graph_max_tokens: int = Field(
        512, ge=0, description="largest CUDA-graph bucket (tokens), captured per power of two; batches up to 8 times it "
        "replay the graphs in chunks; 0 disables graphs"
    )
    cuda_graph_top_k: int = Field(
        8, ge=0, description="top-k whose CUDA graphs are captured at startup (others on first use); 0: all on first use; "
        "at most max_top_k (the default 8 becomes max_top_k where that is lower)"
    )
    intra_op_threads: int = Field(
        0, ge=0, description="torch CPU threads of the serving process (torch.set_num_threads); 0: 1 on a CUDA device "
        "(its CPU tensor work is small per-request validation and staging; a thread pool only competes for cores), "
        "torch's default on the CPU",
    )
    gil_switch_interval_us: int = Field(
        0, ge=0, description="the process's Python GIL switch interval (sys.setswitchinterval) in microseconds; 0: 200 "
        "on a CUDA device (the compute worker waits for the GIL between its launches and copies while the event loop "
        "runs; Python's 5000 us default lets each wait last up to 5 ms), Python's default on the CPU",
    )
    compute_worker: Literal["thread", "process"] = Field(
        "thread", description="where the experts run: thread (a worker thread of the serving process) or process (a "
        "child process that loads the weights and owns the device, fed through shared memory; the serving process "
        "keeps gRPC, validation and batching, and its event loop no longer holds up the compute's GIL hand-overs: "
        "faster with several concurrent callers, ~0.3 ms slower for a lone one on an H200)",
    )
    front_ends: int = Field(
        1, ge=1, le=64, description="serving processes (needs compute_worker = process when > 1): each its own event "
        "loop and gRPC server on the same port (SO_REUSEPORT: the kernel spreads client connections over them), all "
        "feeding one compute process that merges their concurrent batches; metrics_port serves all of their metrics "
        "(label front_end; front end k > 0 listens on loopback metrics_port + k, and a small process of its own merges "
        "them at each scrape)",
    )
    compute_stall_s: float = Field(
        120.0, ge=0, description="seconds the compute worker may hold batches without answering any before the server "
        "takes itself out of service (health NOT_SERVING; lutb serve drains and exits 1, so that a supervisor restarts "
        "it): a device or compute process that hangs would otherwise leave every request waiting for its deadline "
        "while the server still reports SERVING; 0: never. Calls take milliseconds on a GPU; a first compile or "
        "CUDA-graph capture, seconds; on a CPU a large layer's call can take minutes: raise it there",
    )
    compute_cpu: str = Field(
        "none", description="with compute_worker = process: a CPU of the compute process's own, which the serving "
        "processes never use (its one thread feeds the GPU for all of them; a front end woken onto its CPU would "
        "preempt it): a CPU number, auto (the highest CPU the server may use that no other server on the machine has "
        "claimed, leaving the serving processes two), or none "
        "(the kernel places every process)",
    )
    compute_spin_us: int = Field(
        0, ge=0, le=1_000_000, description="with compute_worker = process: how long the compute process polls for the "
        "next batch after each call, in microseconds, before it sleeps in the kernel: a batch arriving within it starts "
        "without the process's wake-up (a lone caller's next request), at the price of that CPU time spent polling each "
        "time; 0 (the default): it sleeps at once",
    )
    cpu_wakeup_latency_us: int | None = Field(
        None, ge=0, le=2**31 - 1, description="the longest wake-up an idle CPU of this machine may take while the server "
        "runs, in microseconds (Linux's CPU latency QoS, /dev/cpu_dma_latency: needs root, and in a container the "
        "device): 0 keeps idle CPUs polling, so the wake-ups on a lone request's path do not pay for deep idle states "
        "(faster, at the price of power, for the whole machine); unset: the machine's idle states are left alone",
    )
    event_loop: EventLoopKind = Field(
        "uvloop", description="the serving processes' asyncio event loop: uvloop (where installed, else asyncio's own; "
        "less server CPU per request) or asyncio (asyncio's own loop even where uvloop is installed)",
    )
    expert_metrics: bool = Field(
        False, description="export lutb_expert_tokens_total{layer,expert}: tokens per held expert (E x layers series; for `lutb load`)"
    )
    config: Path | None = Field(None, description="YAML file of settings (keys are these names with underscores)")

    @model_validator(mode="after")
    def _process_settings_need_the_compute_process(self) -> ServerSettings:
        if self.front_ends > 1 and self.compute_worker != "process":
            raise ValueError(f"front_ends = {self.front_ends} needs compute_worker = process (one compute process serves them all)")
        if self.compute_spin_us and self.compute_worker != "process":
            raise ValueError(f"compute_spin_us = {self.compute_spin_us} needs compute_worker = process (it is the compute process's poll)")
        if self.compute_cpu != "none" and self.compute_worker != "process":
            raise ValueError(f"compute_cpu = {self.compute_cpu} needs compute_worker = process (the CPU is the compute process's)")
        if self.metrics_port and self.metrics_port + self.front_ends - 1 > 65535:  # front end k listens on metrics_port + k
            raise ValueError(f"metrics_port = {self.metrics_port} leaves no port for front ends 1..{self.front_ends - 1} "
                             f"(metrics_port + k, at most 65535)")
        if self.cuda_graph_top_k > self.max_top_k:  # its graphs would serve no request
            if "cuda_graph_top_k" in self.model_fields_set:
                raise ValueError(f"cuda_graph_top_k = {self.cuda_graph_top_k} exceeds max_top_k = {self.max_top_k}: its "
                                 "graphs would serve no request")
            self.cuda_graph_top_k = self.max_top_k  # the default, for a server bounded below it
        return self

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        if value not in BUILTIN_BACKENDS and not _BACKEND_PATH.match(value):
            raise ValueError(f"backend must be one of {', '.join(BUILTIN_BACKENDS)} or package.module:Class, got {value!r}")
        return value

    @field_validator("compute_cpu", mode="before")
    @classmethod
    def _check_compute_cpu(cls, value: object) -> str:
        text = str(value).strip().lower()
        if text not in ("none", "auto") and not text.isdigit():
            raise ValueError(f"compute_cpu must be none, auto or a CPU number, got {value!r}")
        return str(int(text)) if text.isdigit() else text

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.match(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("checkpoint", "demo_dir", "config")
    @classmethod
    def _expand(cls, value: Path | None) -> Path | None:
        return value.expanduser() if value is not None else None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags (``init_settings``) over the environment over the YAML file named by ``config``, taken from the
        flags or else from the environment exactly as the ``config`` field itself is read there (prefix, case and
        empty values alike: ``lutb_config`` names the file as ``LUTB_CONFIG`` does)."""
        init_kwargs = getattr(init_settings, "init_kwargs", {}) or {}
        path = init_kwargs.get("config") or env_settings.get_field_value(settings_cls.model_fields["config"], "config")[0]
        return init_settings, env_settings, _YamlFileSource(settings_cls, path or None)


class _YamlFileSource(PydanticBaseSettingsSource):
    """Settings from a YAML mapping of field names to values (the ``--config`` file); a key whose value is the empty
    string counts as absent, as an empty ``LUTB_*`` variable does (``checkpoint: ''`` is no checkpoint)."""

    def __init__(self, settings_cls: type[BaseSettings], path: str | Path | None) -> None:
        super().__init__(settings_cls)
        self.path = Path(path).expanduser() if path else None

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:  # pragma: no cover - unused
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        if self.path is None:
            return {}
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except OSError as exc:
            raise ValueError(f"config file {self.path}: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ValueError(f"config file {self.path}: not valid YAML: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"config file {self.path}: must hold a mapping of setting names to values")
        # Accept "max-wait-us" as well as "max_wait_us".
        return {str(k).replace("-", "_"): v for k, v in data.items() if not _empty(v)}


def flag_name(field: str) -> str:
    """``max_wait_us`` -> ``--max-wait-us``."""
    return "--" + field.replace("_", "-")


def env_name(field: str) -> str:
    """``max_wait_us`` -> ``LUTB_MAX_WAIT_US``."""
    return ENV_PREFIX + field.upper()


OTHER_ENV = frozenset({"LUTB_SLEEP_EXPERTS", "LUTB_DEPLOY_TOOLS"})
"""``LUTB_*`` variables that are not settings but are read elsewhere (the fake backend, the deploy tests)."""


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """One message per ``LUTB_*`` variable of ``environ`` (default: this process's) that no setting reads, with the
    nearest setting's name: pydantic-settings ignores such variables, so a misspelt one would pass unnoticed.
    (A YAML file's unknown keys are refused outright.)"""
    environ = os.environ if environ is None else environ
    known = {env_name(name) for name in ServerSettings.model_fields} | OTHER_ENV
    messages = []
    for key in sorted(environ):
        upper = key.upper()
        if upper.startswith(ENV_PREFIX) and upper not in known:
            near = difflib.get_close_matches(upper, sorted(known - OTHER_ENV), n=1)
            messages.append(f"{key} is not a setting; ignored" + (f" (did you mean {near[0]}?)" if near else ""))
    return messages


def _empty(value: object) -> bool:
    """Whether a flag's or file key's ``value`` counts as not given: the empty string, as for an environment variable
    (``env_ignore_empty``)."""
    return isinstance(value, str) and value == ""


def load_settings(cli: dict[str, Any] | None = None) -> ServerSettings:
    """Build the settings: ``cli`` (only flags actually given) over ``LUTB_*`` env over the YAML file over defaults.

    A flag given the empty string (``--checkpoint ""``) counts as not given, like an empty variable
    (``LUTB_CHECKPOINT=``): the setting comes from the layers below it.
    """
    return ServerSettings(**{name: value for name, value in (cli or {}).items() if not _empty(value)})


__all__ = ["BUILTIN_BACKENDS", "OTHER_ENV", "ServerSettings", "env_name", "flag_name", "load_settings", "unknown_env"]
