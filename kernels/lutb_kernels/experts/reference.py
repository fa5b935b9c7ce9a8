"""The ``reference`` backend: dequantize once, run :func:`lutb_kernels.reference.reference_moe_forward`."""

from __future__ import annotations

from typing import ClassVar

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_kernels.reference import OutputMode, reference_moe_forward
from lutb_kernels.tiles import tiles_to_dense


class ReferenceExperts(LayerExperts):
    """Plain-PyTorch experts on any device: float32 dense weights, the spec's steps one by one.

    Holds the dequantized weights in float32 (9.8x the packed size): meant for the
    CPU demo, for checks, and as the judge, not for memory or speed.
    """

    name: ClassVar[str] = "reference"

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        self.w13 = tiles_to_dense(weights.w13.to(self.device), torch.float32)
        self.w2 = tiles_to_dense(weights.w2.to(self.device), torch.float32)

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        return Support(True, f"plain PyTorch runs on any device ({device.type})")

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
    ) -> torch.Tensor:
        self._check_inputs(x, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        return reference_moe_forward(
            x, topk_ids, topk_weights, self.w13, self.w2, self.expert_ids,
            num_experts=self.config.num_experts,
            activation=self.config.activation,
            apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode,
            scale_mode=self.config.mxfp8_scale_mode,  # type: ignore[arg-type]
        )

    @property
    def weight_bytes(self) -> int:
        return (self.w13.numel() + self.w2.numel()) * self.w13.element_size()
