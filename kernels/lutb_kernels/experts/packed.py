"""The ``packed`` backend: LUT-B tiles stay packed on the GPU (3.26 bits per weight).

The native flow of the seed's ``LutBSm107Experts`` on any NVIDIA GPU with bf16 tensor cores:
MXFP8-quantize the hidden states (Triton, decoder column order), ``lut_b_moe_gemm`` over
W13 (tiles decoded in registers), the activation fused with the second MXFP8 quantization,
``lut_b_moe_gemm`` over W2 times the router weight, then the float32 sum over routes.

Routing blocks: 16/32/64/128 rows by the batch's average rows per held expert
(:func:`~lutb_kernels.experts._triton_common.choose_route_block`), not the seed's fixed 128:
at decode one route per expert pads to 16 rows instead of 128.

Prefill (``dense_from_rows_per_expert``): when the batch averages that many routes per
expert, each expert's tiles would be decoded again by every one of its 128-row blocks. Then,
if each GEMM's weights fit dequantized in ``dense_scratch_bytes``, the GEMMs decode them once
into a bf16 scratch (:func:`lutb_kernels.lut_b_dequant.lut_b_dequantize`) and run the dense
grouped GEMM of the ``emulated`` backend on it, with the same MXFP8 activations in bf16. The
values are the same (a decoded weight and an MXFP8 activation are exact in bf16, products are
exact, sums are float32); on the H200 the outputs were bit for bit equal. The choice depends on
shapes only, so CUDA graphs stay valid.
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
from lutb_kernels.tiles import TILE, TILE_BYTES, to_kernel_layout


def _dequantized_a_dtype() -> torch.dtype:
    """The dtype of MXFP8 activations handed to the GEMMs as values (QDQ'd, exact): bf16, or float32
    under the Triton interpreter, which mishandles bf16."""
    from lutb_kernels.mxfp8_triton import interpreting

    return torch.float32 if interpreting() else torch.bfloat16


class LutBPackedExperts(RoutedTritonExperts):
    """LUT-B x MXFP8 experts with packed weights and the Triton ``lut_b_moe_gemm``."""

    name: ClassVar[str] = "packed"
    a_k_order: ClassVar[str] = "decoder"
    dequantized_a_from_block: ClassVar[int | None] = 16
    """Routing blocks at least this large feed the GEMMs bf16 MXFP8 values (QDQ'd once, exact)
    instead of e4m3 + scales, sparing every program the conversion of its A tile per K step
    (about 0.5 instruction per weight at decode in the sm90 SASS). None: always e4m3 + scales
    (the native op's contract)."""

    dense_from_rows_per_expert: int | None = 512
    """Average routes per held expert (expected under uniform routing) from which the GEMMs run on dequantized weights (see the
    module docstring); None: never. On the H200 (bench/results/2026-12-02-kernels-prefill-h200.md)
    that path won at 512 (qwen3 T=8192: 2286 vs 2569 us; mixtral T=2048: 4260 vs 4326) and 2048
    (mixtral T=8192: 12324 vs 17066) and lost at 64-256 (deepseek, qwen3 T=2048)."""
    kernel_layout: ClassVar[bool] = True
    """Keep the tiles on the GPU in the kernel layout (:func:`lutb_kernels.tiles.to_kernel_layout`, the
    same bytes): with bit-planes 1 and 2 rotated the decode's selectors take 4 integer instructions
    instead of 6 (every decode GEMM 2.5-7% faster on the H200, bench/results/2026-12-04-rotated-planes-h200.md);
    with each row's plane words chunk-major every 16-byte plane load reads whole sectors (decode
    forwards 6.5-9% faster, bench/results/2026-12-04-chunked-rows-h200.md). The native backend keeps the
    checkpoint's layout (its op's contract)."""
    dense_scratch_bytes: int = 2 << 30
    """Most bytes the dequantized weights of one GEMM may take (transient, from torch's caching
    allocator); larger layers keep decoding in the GEMM. Deepseek-v3's W13 (15 GB in bf16) does:
    there the dense pass cost more than the decode it saves at every batch measured."""

    split_k_counters: ClassVar[int] = 1 << 16
    """Int32 counters kept zeroed on the device for the stream-K GEMMs' split-K (``lut_b_moe_gemm``'s
    ``split_k_counters``: one per unit of the launch's grid; 256 KiB). Stream-K runs at decode, where
    the grid's routing blocks are bounded by ``routes / 16 + experts`` (deepseek-v3 T=1's w2: 241 blocks
    x 56 column blocks = 13,496 units); a launch needing more allocates its own (one memset). The GEMMs
    of one experts object share them, so its forwards run one at a time (one stream), as the server's
    compute worker runs them."""

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        self.w13 = self._to_device(weights.w13)
        self.w2 = self._to_device(weights.w2)
        self._counters = torch.zeros(self.split_k_counters, dtype=torch.int32, device=self.device)

    def _to_device(self, tiles: torch.Tensor) -> torch.Tensor:
        """The tiles on the device, in the kernel layout when :attr:`kernel_layout` (in place, one expert
        at a time, on a copy: the caller's tensor is never changed)."""
        out = tiles.to(self.device).contiguous()
        if self.kernel_layout:
            if out.data_ptr() == tiles.data_ptr():
                out = out.clone()
            for e in range(out.shape[0]):
                out[e] = to_kernel_layout(out[e])
        return out

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

    @property
    def dense_bytes(self) -> int:
        """Bytes of the larger GEMM's weights dequantized to bf16 (the prefill path's scratch)."""
        return max(self.w13.numel(), self.w2.numel()) // TILE_BYTES * TILE * TILE * 2

    def uses_dense_weights(self, num_routes: int) -> bool:
        """True when a batch of ``num_routes`` routes (``tokens * top_k``) takes the prefill path (dequantized weights)."""
        if self.dense_from_rows_per_expert is None or self.dense_bytes > self.dense_scratch_bytes:
            return False
        # Rows per held expert under uniform routing: a shard holding some experts sees the
        # routes to the others too (as padding), so divide by all experts, not the held ones.
        return num_routes / self.config.num_experts >= self.dense_from_rows_per_expert

    def _gemm_launches(self, num_routes: int, route_block: int) -> tuple:
        held = self.held_routes(num_routes)
        if self.uses_dense_weights(num_routes):  # :meth:`_dense_gemm`: the grouped GEMM on dequantized tiles
            from lutb_kernels.grouped_gemm import default_config as grouped_config

            elem = _dequantized_a_dtype().itemsize
            return ("dense", *(grouped_config(held, w.shape[1] * TILE, w.shape[2] * TILE, w.shape[0], route_block, self.device, elem)
                               for w in (self.w13, self.w2)))
        from lutb_kernels.lut_b_gemm import default_config

        return tuple(default_config(held, w.shape[1] * TILE, w.shape[2] * TILE, w.shape[0], route_block, self.device)
                     for w in (self.w13, self.w2))

    def _gemm(self, a, a_scales, w, out, topk_weights, routing, top_k, route_block):  # noqa: ANN001
        """One GEMM on the tiles (``lut_b_moe_gemm``; the native backend overrides it)."""
        from lutb_kernels.lut_b_gemm import lut_b_moe_gemm

        lut_b_moe_gemm(a, a_scales, w, out, topk_weights, *routing, top_k, block_m=route_block, a_k_order=self.a_k_order,  # type: ignore[arg-type]
                       held_routes=self.held_routes(out.shape[0]), kernel_layout=self.kernel_layout,
                       split_k_counters=self._counters)

    def _dense_gemm(self, a, a_scales, w, out, topk_weights, routing, top_k, route_block):  # noqa: ANN001
        """:meth:`_gemm` on the prefill path: the grouped GEMM on the tiles dequantized to ``a.dtype``
        (``a`` holds MXFP8 values in natural column order; ``a_scales`` is None)."""
        from lutb_kernels.grouped_gemm import grouped_gemm
        from lutb_kernels.lut_b_dequant import lut_b_dequantize

        grouped_gemm(a, lut_b_dequantize(w, dtype=a.dtype, kernel_layout=self.kernel_layout), out, topk_weights, *routing, top_k,
                     block_m=route_block, allow_tf32=True, held_routes=self.held_routes(out.shape[0]))

    def _routed_forward(self, x, topk_weights, held, routing, top_k, route_block, nonfinite, *,  # noqa: ANN001
                        weight_on_input, weight_on_output):
        from lutb_kernels.mxfp8_triton import act_mxfp8_qdq, act_mxfp8_quantize, mxfp8_qdq, mxfp8_quantize

        mode = self.config.mxfp8_scale_mode
        routes = topk_weights.numel()
        row_weight = topk_weights[:, 0].contiguous() if weight_on_input else None
        a_dtype = _dequantized_a_dtype()
        dense = self.uses_dense_weights(routes)
        order = "natural" if dense else self.a_k_order  # dequantized weights keep the natural column order
        dequantized = dense or (self.dequantized_a_from_block is not None and route_block >= self.dequantized_a_from_block)
        gemm = self._dense_gemm if dense else self._gemm
        if dequantized:
            a1, s1 = mxfp8_qdq(x, mode, k_order=order, out_dtype=a_dtype, row_weight=row_weight, nonfinite=nonfinite), None  # type: ignore[arg-type]
        else:
            a1, s1 = mxfp8_quantize(x, mode, k_order=order, row_weight=row_weight, nonfinite=nonfinite)  # type: ignore[arg-type]
        h = torch.empty((routes, self.w13.shape[1] * 128), dtype=x.dtype, device=self.device)
        gemm(a1, s1, self.w13, h, None, routing, top_k, route_block)
        row_mask = held.reshape(-1)
        if dequantized:
            a2, s2 = act_mxfp8_qdq(h, self.config.activation, mode, row_mask=row_mask, k_order=order,  # type: ignore[arg-type]
                                   out_dtype=a_dtype, nonfinite=nonfinite), None
        else:
            a2, s2 = act_mxfp8_quantize(h, self.config.activation, mode, row_mask=row_mask,  # type: ignore[arg-type]
                                        k_order=order, nonfinite=nonfinite)
        y = torch.empty((routes, self.config.hidden_size), dtype=x.dtype, device=self.device)
        gemm(a2, s2, self.w2, y, topk_weights if weight_on_output else None, routing, 1, route_block)
        return y
