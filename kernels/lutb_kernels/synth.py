"""Synthetic LUT-B checkpoints: random dense experts put through the real quantizer.

Used for the server's built-in demo checkpoint, tests and benchmarks. The dense
weights are drawn ``N(0, weight_std)`` from a generator seeded with ``seed``,
so the same arguments always give the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lutb_kernels.activations import is_gated
from lutb_kernels.checkpoint import CheckpointConfig, CheckpointWriter
from lutb_kernels.quantizer import quantize_layer


def make_synthetic_checkpoint(
    out_dir: str | Path,
    *,
    layers: int = 2,
    experts: int = 8,
    hidden: int = 256,
    intermediate: int = 256,
    activation: str = "silu",
    dtype: str = "bfloat16",
    scale_mode: str = "rceil",
    seed: int = 0,
    weight_std: float = 0.02,
) -> Path:
    """Write a checkpoint of ``layers`` MoE layers (indices ``0..layers-1``) of ``experts`` experts each.

    Args:
        out_dir: directory to create (or an empty existing one).
        layers, experts: counts (positive).
        hidden, intermediate: ``H`` and ``I``, multiples of 128.
        activation, dtype, scale_mode: recorded in the metadata (spec section 5).
        seed: seeds the dense weights and the quantizer.
        weight_std: standard deviation of the dense weights.

    Returns:
        The checkpoint directory.

    Raises:
        LutBFormatError: sizes, activation, dtype or scale mode the format does not allow.
        FileExistsError: ``out_dir`` already holds safetensors files.
    """
    if layers <= 0:
        raise ValueError(f"layers must be positive, got {layers}")
    config = CheckpointConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_experts=experts,
        activation=activation,
        dtype=dtype,
        mxfp8_scale_mode=scale_mode,
    )
    gen = torch.Generator().manual_seed(seed)
    with CheckpointWriter(out_dir, config) as writer:
        for layer in range(layers):
            gate = torch.randn(experts, intermediate, hidden, generator=gen) * weight_std
            up = torch.randn(experts, intermediate, hidden, generator=gen) * weight_std if is_gated(activation) else None
            down = torch.randn(experts, hidden, intermediate, generator=gen) * weight_std
            q = quantize_layer(gate, up, down, seed=seed)
            writer.write_layer(layer, q.weights)
    return Path(out_dir)


__all__ = ["make_synthetic_checkpoint"]
