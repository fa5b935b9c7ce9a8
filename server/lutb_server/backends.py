"""The experts backend registry: which ``LayerExperts`` classes exist and which one runs here.

A backend is one entry of :data:`BACKENDS` (name -> module and class), or a class named by its
import path (``package.module:Class``, a ``LayerExperts`` subclass of one's own), imported only
when asked for, so a module that is missing or cannot import on this machine makes that backend
unavailable with a reason instead of crashing the server.
``auto`` tries :data:`AUTO_ORDER` (fastest first) and takes the first whose
``supports(config, device)`` says yes; the reason names what it skipped and why.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

import torch

from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_server.errors import BackendUnavailableError


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend's ``LayerExperts`` subclass lives."""

    name: str
    module: str
    class_name: str


BACKENDS: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry("native", "lutb_kernels.experts.sm107", "LutBSm107Experts"),
        BackendEntry("packed", "lutb_kernels.experts.packed", "LutBPackedExperts"),
        BackendEntry("emulated", "lutb_kernels.experts.emulated", "LutBEmulationTritonExperts"),
        BackendEntry("reference", "lutb_kernels.experts.reference", "ReferenceExperts"),
    )
}
AUTO_ORDER: tuple[str, ...] = ("native", "packed", "emulated", "reference")
"""What ``auto`` tries, best first."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend that will run the layers, on which device, and why."""

    name: str
    cls: type[LayerExperts]
    device: torch.device
    reason: str


def resolve_device(spec: str) -> torch.device:
    """``auto`` -> ``cuda`` when a GPU is present, else ``cpu``; ``cuda[:N]`` must exist.

    Raises:
        BackendUnavailableError: a CUDA device was asked for that this machine lacks.
    """
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise BackendUnavailableError(f"device {spec!r} asked for, but torch sees no CUDA device on this machine")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise BackendUnavailableError(f"device {spec!r} asked for, but only {torch.cuda.device_count()} CUDA device(s) exist")
        device = torch.device("cuda", index)
    return device


def load_class(name: str) -> tuple[type[LayerExperts] | None, str]:
    """Import a backend's class: ``(cls, "")`` or ``(None, why not)``.

    ``name`` is a key of :data:`BACKENDS` or ``package.module:Class``: a ``LayerExperts`` subclass of one's own,
    imported from wherever the process (and a compute process it spawns) can import it.
    """
    entry = BACKENDS.get(name)
    if entry is None and ":" in name:
        module_name, _, class_name = name.partition(":")
        entry = BackendEntry(name, module_name, class_name)
    if entry is None:
        return None, f"unknown backend {name!r}; known: {', '.join(BACKENDS)}, or package.module:Class"
    try:
        module = importlib.import_module(entry.module)
    except ImportError as exc:
        return None, f"module {entry.module} cannot be imported ({type(exc).__name__}: {exc})"
    except Exception as exc:  # a backend module that breaks on import must not take the server down
        return None, f"module {entry.module} failed to import ({type(exc).__name__}: {exc})"
    cls = getattr(module, entry.class_name, None)
    if cls is None or not (isinstance(cls, type) and issubclass(cls, LayerExperts)):
        return None, f"{entry.module} has no LayerExperts subclass {entry.class_name}"
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(getattr(cls, "__abstractmethods__", ())))
        return None, f"{entry.module}:{entry.class_name} is abstract (it does not implement {missing})"
    return cls, ""


def probe(name: str, config: CheckpointConfig, device: torch.device) -> tuple[type[LayerExperts] | None, Support]:
    """Can backend ``name`` run ``config`` on ``device``? Returns the class (if importable) and the verdict."""
    cls, why_not = load_class(name)
    if cls is None:
        return None, Support(False, why_not)
    try:
        support = cls.supports(config, device)
    except Exception as exc:
        support = Support(False, f"supports() raised {type(exc).__name__}: {exc}")
    if not isinstance(support, Support):
        support = Support(False, f"supports() returned {type(support).__name__}, not a Support")
    return cls, support


def choose_backend(requested: str, config: CheckpointConfig, device: torch.device) -> BackendChoice:
    """Pick the backend: the one asked for, or with ``auto`` the first of :data:`AUTO_ORDER` that supports ``config`` here.

    Raises:
        BackendUnavailableError: the backend asked for cannot run here (the message says why),
            or with ``auto`` none can.
    """
    if requested != "auto":
        cls, support = probe(requested, config, device)
        if cls is None or not support.ok:
            raise BackendUnavailableError(f"backend {requested!r} cannot run on {device}: {support.reason}")
        return BackendChoice(requested, cls, device, f"asked for ({support.reason})")
    skipped = []
    for name in AUTO_ORDER:
        cls, support = probe(name, config, device)
        if cls is not None and support.ok:
            reason = f"auto: best available on {device} ({support.reason})"
            if skipped:
                reason += "; skipped " + "; ".join(skipped)
            return BackendChoice(name, cls, device, reason)
        skipped.append(f"{name}: {support.reason}")
    raise BackendUnavailableError(f"no backend can run on {device}: " + "; ".join(skipped))


def compute_capability(device: torch.device) -> str:
    """``"sm_90"``-style compute capability of a CUDA device, ``""`` elsewhere."""
    if device.type != "cuda":
        return ""
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}"


__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "BackendChoice",
    "BackendEntry",
    "choose_backend",
    "compute_capability",
    "load_class",
    "probe",
    "resolve_device",
]
