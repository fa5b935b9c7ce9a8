"""MoE activations of spec section 4, computed in float32.

Gated activations take ``h [..., 2I]`` and return ``[..., I]``; the ``*_no_mul``
ones take ``h [..., I]`` and return the same shape (their ``W13`` has ``I`` rows).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F

Activation = Literal["silu", "gelu", "gelu_tanh", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul"]
ACTIVATIONS: tuple[str, ...] = get_args(Activation)

SWIGLUOAI_ALPHA = 1.702
SWIGLUOAI_LIMIT = 7.0


def is_gated(activation: str) -> bool:
    """True when the activation multiplies a gate half by an up half (``W13`` has ``2I`` rows)."""
    check_activation(activation)
    return not activation.endswith("_no_mul")


def check_activation(activation: str) -> Activation:
    """Return ``activation`` if the spec defines it, else raise ValueError listing those it does."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; expected one of {', '.join(ACTIVATIONS)}")
    return activation  # type: ignore[return-value]


def w13_rows(activation: str, intermediate_size: int) -> int:
    """Rows of ``W13`` for an activation: ``2I`` when gated, else ``I``."""
    return 2 * intermediate_size if is_gated(activation) else intermediate_size


def _split(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    half = h.shape[-1] // 2
    return h[..., :half], h[..., half:]


def _swigluoai(h: torch.Tensor) -> torch.Tensor:
    gate, up = h[..., 0::2], h[..., 1::2]
    gate = gate.clamp(max=SWIGLUOAI_LIMIT)
    up = up.clamp(-SWIGLUOAI_LIMIT, SWIGLUOAI_LIMIT)
    return (up + 1) * gate * torch.sigmoid(SWIGLUOAI_ALPHA * gate)


_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda h: F.silu(_split(h)[0]) * _split(h)[1],
    "gelu": lambda h: F.gelu(_split(h)[0]) * _split(h)[1],
    "gelu_tanh": lambda h: F.gelu(_split(h)[0], approximate="tanh") * _split(h)[1],
    "swigluoai": _swigluoai,
    "silu_no_mul": F.silu,
    "gelu_no_mul": F.gelu,
    "relu2_no_mul": lambda h: torch.square(F.relu(h)),
}


def apply_activation(activation: str, h: torch.Tensor) -> torch.Tensor:
    """Apply ``activation`` to ``h [..., N]`` in float32; returns float32 ``[..., N/2]`` or ``[..., N]``."""
    check_activation(activation)
    h = h.float()
    if is_gated(activation) and h.shape[-1] % 2:
        raise ValueError(f"gated activation {activation} needs an even last dimension, got {h.shape[-1]}")
    return _FUNCTIONS[activation](h)
