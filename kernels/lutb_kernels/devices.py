"""Where the offline tools compute (the quantizer, the HF importer, `lutb check`'s local reference): one reading of a
device name for all of them, checked before any work so that a device this host lacks is a one-line error.

The server resolves its device elsewhere (``lutb_server.backends.resolve_device``): it accepts any torch device and
leaves it to each backend's support checks to say no.
"""

from __future__ import annotations

import torch


def resolve_compute_device(device: torch.device | str | None, *, who: str = "this tool") -> torch.device:
    """The device to compute on.

    Args:
        device: ``cpu``, ``cuda`` or ``cuda:N``; ``None`` or ``"auto"``: CUDA when this host has it, else the CPU.
        who: what runs there, for the message of a device type other than cpu or cuda (e.g. ``"the quantizer"``).

    Returns:
        ``torch.device`` as given (``cuda`` keeps no index), or the automatic choice.

    Raises:
        ValueError: naming ``device``: not a device name torch parses, a device type other than cpu or cuda, CUDA
            asked for on a host without it, or a CUDA index beyond the host's devices.
    """
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device {str(device)!r} is not a device name (expected cpu, cuda or cuda:N)") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(f"device {str(device)!r}: {who} runs on cpu or cuda (cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r}: CUDA is not available on this host")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(f"device {str(device)!r}: this host has {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return dev


__all__ = ["resolve_compute_device"]
