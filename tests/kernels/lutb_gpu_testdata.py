"""Test data shared by the Triton kernel tests (CPU interpreter and GPU): layers, routing, poison."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
from lutb_kernels.lut_b_gemm import random_tiles


def use_h200_rules(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """Make the launch-config rules those of an H200 (132 SMs, 227 KiB of shared memory per block, not the
    interpreter's fixed configs), so that configs can be evaluated on the CPU. ``set_attr``: ``setattr`` (for good,
    in a script) or a test's ``monkeypatch.setattr``."""
    import lutb_kernels.grouped_gemm as grouped_gemm
    import lutb_kernels.lut_b_gemm as lut_b_gemm
    import lutb_kernels.mxfp8_triton as mxfp8_triton

    for module in (lut_b_gemm, grouped_gemm, mxfp8_triton):
        set_attr(module, "sm_count", lambda device: 132)
        set_attr(module, "interpreting", lambda: False)
    set_attr(grouped_gemm, "shared_memory_per_block", lambda device: 232448)


def make_layer(
    config: CheckpointConfig, expert_ids: list[int], device: torch.device | str = "cpu", seed: int = 0
) -> LayerWeights:
    """Random valid packed weights for the experts ``expert_ids`` of ``config``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    e = len(expert_ids)
    h, i = config.hidden_size, config.intermediate_size
    w13 = random_tiles(config.w13_tiles_shape(e), k=h, device=device, generator=gen)
    w2 = random_tiles(config.w2_tiles_shape(e), k=i, device=device, generator=gen)
    return LayerWeights(w13, w2, torch.tensor(expert_ids, dtype=torch.int32))


def make_batch(tokens: int, top_k: int, num_experts: int, hidden: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x [T, H] standard normal, topk_ids [T, k] distinct per token, topk_weights [T, k] softmax)``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    scores = torch.rand(tokens, num_experts, generator=gen)
    ids = scores.topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1)
    return x.to(device), ids.to(device), weights.to(device)
