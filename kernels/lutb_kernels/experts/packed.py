"""The ``packed`` backend: LUT-B tiles stay packed on the GPU (3.26 bits per weight).

The native flow of the seed's ``LutBSm107Experts`` on any NVIDIA GPU with bf16 tensor cores:
MXFP8-quantize the hidden states (Triton, decoder column order), ``lut_b_moe_gemm`` over
W13 (tiles decoded in registers), the activation fused with the second MXFP8 quantization,
``lut_b_moe_gemm`` over W2 times the router weight, then the float32 sum over routes.

Routing blocks: 16/32/64/128 rows by the batch's average rows per held expert
(:func:`~lutb_kernels.experts._triton_common.choose_route_block`), not the seed's fixed 128:
at decode one route per expert pads to 16 rows instead of 128.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
from lutb_kernels.experts._triton_common import (
    RoutedTritonExperts,
    cuda_device,
    dtype_ok,
    nvidia_sm89,
    quant_scheme_ok,
    shape_ok,
    triton_present,
)
from lutb_kernels.experts.base import Support, all_of


class LutBPackedExperts(RoutedTritonExperts):
    """LUT-B x MXFP8 experts with packed weights and the Triton ``lut_b_moe_gemm``."""

    name: ClassVar[str] = "packed"
    a_k_order: ClassVar[str] = "decoder"
    dequantized_a_from_block: ClassVar[int | None] = 16
    """Routing blocks at least this large feed the GEMMs bf16 MXFP8 values (QDQ'd once, exact)
    instead of e4m3 + scales, sparing every program the conversion of its A tile per K step
    (about 0.5 instruction per weight at decode in the sm90 SASS). None: always e4m3 + scales
    (the native op's contract)."""

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        self.w13 = weights.w13.to(self.device).contiguous()
        self.w2 = weights.w2.to(self.device).contiguous()

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        device = torch.device(device)
        return all_of(
            triton_present,
            lambda: cuda_device(device),
            lambda: nvidia_sm89(device),
            lambda: quant_scheme_ok(config),
            lambda: shape_ok(config),
            lambda: dtype_ok(config),
        )

    @property
    def weight_bytes(self) -> int:
        return self.w13.numel() + self.w2.numel()

    def _gemm(self, a, a_scales, w, out, topk_weights, routing, top_k, route_block):  # noqa: ANN001
        from lutb_kernels.lut_b_gemm import lut_b_moe_gemm

        sorted_ids, expert_ids, ntpp = routing
        lut_b_moe_gemm(a, a_scales, w, out, topk_weights, sorted_ids, expert_ids, ntpp, top_k,
                       block_m=route_block, a_k_order=self.a_k_order)  # type: ignore[arg-type]

    def _routed_forward(self, x, topk_weights, held, routing, top_k, route_block, nonfinite, *,  # noqa: ANN001
                        weight_on_input, weight_on_output):
        from lutb_kernels.mxfp8_triton import act_mxfp8_qdq, act_mxfp8_quantize, interpreting, mxfp8_qdq, mxfp8_quantize

        mode = self.config.mxfp8_scale_mode
        routes = held.numel()
        row_weight = topk_weights[:, 0].contiguous() if weight_on_input else None
        order = self.a_k_order
        dequantized = self.dequantized_a_from_block is not None and route_block >= self.dequantized_a_from_block
        a_dtype = torch.float32 if interpreting() else torch.bfloat16  # the interpreter mishandles bf16
        if dequantized:
            a1, s1 = mxfp8_qdq(x, mode, k_order=order, out_dtype=a_dtype, row_weight=row_weight, nonfinite=nonfinite), None  # type: ignore[arg-type]
        else:
            a1, s1 = mxfp8_quantize(x, mode, k_order=order, row_weight=row_weight, nonfinite=nonfinite)  # type: ignore[arg-type]
        h = torch.empty((routes, self.w13.shape[1] * 128), dtype=x.dtype, device=self.device)
        self._gemm(a1, s1, self.w13, h, None, routing, top_k, route_block)
        row_mask = held.reshape(-1)
        if dequantized:
            a2, s2 = act_mxfp8_qdq(h, self.config.activation, mode, row_mask=row_mask, k_order=order,  # type: ignore[arg-type]
                                   out_dtype=a_dtype, nonfinite=nonfinite), None
        else:
            a2, s2 = act_mxfp8_quantize(h, self.config.activation, mode, row_mask=row_mask,  # type: ignore[arg-type]
                                        k_order=order, nonfinite=nonfinite)
        y = torch.empty((routes, self.config.hidden_size), dtype=x.dtype, device=self.device)
        self._gemm(a2, s2, self.w2, y, topk_weights if weight_on_output else None, routing, 1, route_block)
        return y
