"""The ``native`` backend: the seed's ``LutBSm107Experts`` bound to a native op.

Same flow as :mod:`lutb_kernels.experts.packed` (MXFP8-quantize, two grouped GEMMs over
routing aligned to 128-row blocks, activation + MXFP8 in between, sum over routes), but the
GEMMs call ``torch.ops.lutb.lut_b_moe_gemm``: the Rubin (SM107) kernel whose tensor cores
decode LUT-B weights. Nobody here has that op; whoever registers it must give it the seed's
signature, with ``a`` in natural column order and 128-row routing blocks::

    lut_b_moe_gemm(Tensor a, Tensor a_scales, Tensor w, Tensor(a!) out, Tensor? topk_weights,
                   Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded,
                   int top_k) -> ()
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts._triton_common import cuda_device, dtype_ok, quant_scheme_ok, shape_ok, triton_present
from lutb_kernels.experts.base import Support, all_of
from lutb_kernels.experts.packed import LutBPackedExperts

NATIVE_NAMESPACE = "lutb"
NATIVE_OP = "lut_b_moe_gemm"
NATIVE_CAPABILITY = (10, 7)
NATIVE_BLOCK_M = 128
NATIVE_OP_SCHEMA = (
    "lut_b_moe_gemm(Tensor a, Tensor a_scales, Tensor w, Tensor(a!) out, Tensor? topk_weights, "
    "Tensor sorted_token_ids, Tensor expert_ids, Tensor num_tokens_post_padded, int top_k) -> ()"
)


def native_op():
    """The registered ``torch.ops.lutb.lut_b_moe_gemm``, or None."""
    try:
        return getattr(getattr(torch.ops, NATIVE_NAMESPACE), NATIVE_OP)
    except (AttributeError, RuntimeError):
        return None


def native_op_registered() -> Support:
    if native_op() is None:
        return Support(False, f"torch.ops.{NATIVE_NAMESPACE}.{NATIVE_OP} is not registered (no native SM107 LUT-B kernel loaded)")
    return Support(True, f"torch.ops.{NATIVE_NAMESPACE}.{NATIVE_OP} registered")


def sm107_device(device: torch.device) -> Support:
    cap = torch.cuda.get_device_capability(device)
    if cap != NATIVE_CAPABILITY:
        return Support(False, f"needs compute capability {NATIVE_CAPABILITY[0]}.{NATIVE_CAPABILITY[1]} (Rubin), got {cap[0]}.{cap[1]}")
    return Support(True, "SM107")


class LutBSm107Experts(LutBPackedExperts):
    """Native Rubin LUT-B x MXFP8 MoE: the packed flow on ``torch.ops.lutb.lut_b_moe_gemm``."""

    name: ClassVar[str] = "native"
    a_k_order: ClassVar[str] = "natural"
    dequantized_a_from_block: ClassVar[int | None] = None
    fixed_route_block: ClassVar[int | None] = NATIVE_BLOCK_M
    kernel_layout: ClassVar[bool] = False  # the native op reads the checkpoint's tile layout
    dense_from_rows_per_expert: int | None = None  # every GEMM goes to the native op, at any batch

    @classmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        device = torch.device(device)
        return all_of(
            triton_present,
            lambda: cuda_device(device),
            lambda: sm107_device(device),
            native_op_registered,
            lambda: quant_scheme_ok(config),
            lambda: shape_ok(config),
            lambda: dtype_ok(config),
        )

    def _gemm(self, a, a_scales, w, out, topk_weights, routing, top_k, route_block):  # noqa: ANN001
        op = native_op()
        if op is None:
            raise RuntimeError(native_op_registered().reason)
        sorted_ids, expert_ids, ntpp = routing
        op(a, a_scales, w, out, topk_weights, sorted_ids, expert_ids, ntpp, top_k)
