"""The ``emulated`` backend: the seed's ``LutBEmulationTritonExperts``.

Weights are dequantized to the model dtype once at load (4.9x the packed size in bf16);
activations are MXFP8 quantize-dequantized by one Triton pass before each GEMM (the second
fused with the activation), and a Triton grouped GEMM runs over the block-aligned routing.
It validates accuracy on any CUDA GPU; it does not save memory.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
from lutb_kernels.experts._triton_common import (
    RoutedTritonExperts,
    cuda_device,
    dtype_ok,
    nvidia_sm80,
    quant_scheme_ok,
    shape_ok,
    triton_present,
)
from lutb_kernels.experts.base import Support, all_of
from lutb_kernels.tiles import tiles_to_dense


def dequantize_experts(tiles: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[E, N/128, K/128, 6672]`` tiles -> ``[E, N, K]`` in ``dtype`` on ``device``, one expert at a time."""
    e, nt, kt, _ = tiles.shape
    dense = torch.empty((e, nt * 128, kt * 128), dtype=dtype, device=device)
    for i in range(e):
        dense[i] = tiles_to_dense(tiles[i].to(device), dtype)
    return dense


class LutBEmulationTritonExperts(RoutedTritonExperts):
    """Emulated LUT-B MoE: dequantized weights, MXFP8 QDQ activations, Triton grouped GEMMs."""

    name: ClassVar[str] = "emulated"

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        self.dtype = config.torch_dtype
        self.w13 = dequantize_experts(weights.w13, self.dtype, self.device)
        self.w2 = dequantize_experts(weights.w2, self.dtype, self.device)

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        device = torch.device(device)
        return all_of(
            triton_present,
            lambda: cuda_device(device),
            lambda: nvidia_sm80(device),
            lambda: quant_scheme_ok(config),
            lambda: shape_ok(config),
            lambda: dtype_ok(config),
        )

    @property
    def weight_bytes(self) -> int:
        return (self.w13.numel() + self.w2.numel()) * self.w13.element_size()

    def _gemm_launches(self, num_routes: int, route_block: int) -> tuple:
        from lutb_kernels.grouped_gemm import default_config

        held = self.held_routes(num_routes)
        return tuple(default_config(held, w.shape[1], w.shape[2], w.shape[0], route_block, self.device, self.dtype.itemsize)
                     for w in (self.w13, self.w2))

    def _routed_forward(self, x, topk_weights, held, routing, top_k, route_block, nonfinite, *,  # noqa: ANN001
                        weight_on_input, weight_on_output):
        from lutb_kernels.grouped_gemm import grouped_gemm
        from lutb_kernels.mxfp8_triton import act_mxfp8_qdq, mxfp8_qdq

        mode = self.config.mxfp8_scale_mode
        sorted_ids, expert_ids, ntpp = routing
        routes = topk_weights.numel()
        a1 = mxfp8_qdq(x, mode, row_weight=topk_weights[:, 0].contiguous() if weight_on_input else None,  # type: ignore[arg-type]
                       nonfinite=nonfinite)
        h = torch.empty((routes, self.w13.shape[1]), dtype=x.dtype, device=self.device)
        expected = self.held_routes(routes)
        grouped_gemm(a1, self.w13, h, None, sorted_ids, expert_ids, ntpp, top_k, block_m=route_block, allow_tf32=True,
                     held_routes=expected)
        a2 = act_mxfp8_qdq(h, self.config.activation, mode, row_mask=held.reshape(-1), nonfinite=nonfinite)  # type: ignore[arg-type]
        y = torch.empty((routes, self.config.hidden_size), dtype=x.dtype, device=self.device)
        grouped_gemm(a2, self.w2, y, topk_weights if weight_on_output else None, sorted_ids, expert_ids, ntpp, 1,
                     block_m=route_block, allow_tf32=True, held_routes=expected)
        return y
