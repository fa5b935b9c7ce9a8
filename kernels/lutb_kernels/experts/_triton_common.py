"""What the GPU experts backends share: support predicates and the routed forward skeleton.

The skeleton (spec section 4, for every backend that batches the experts with grouped GEMMs)::

    check_forward_args (host sync: topk id range)
    routing = moe_align_block_size(topk_ids, route_block, E, expert_map, held_out=held)
                                                                  one Triton launch at decode sizes, torch ops above
                                                                  (triton_routing_wins); held: bool [T, k], the
                                                                  route's expert is held here
    y = backend._routed_forward(...)                              [T*k, H], rows of held routes
    flag check (host sync: NaN/Inf met by an MXFP8 quantization)
    combined:    moe_combine(y, held)   (float32 sum over held routes, rounded to d)
    route-major: y with the rows of routes not held zeroed        [T, k, H]

``forward_unchecked`` is the same without the checks and syncs, for CUDA-graph capture. It also takes padding
routes (id -1, what :class:`~lutb_kernels.experts.graphs.CudaGraphExperts` fills a bucket's unused rows with):
not held, so they get no GEMM rows and the activation's NaN/Inf check skips them; a whole layer's route-major rows
for them are left unspecified (only padding tokens have them, and nobody reads those).
Nothing here imports triton; the ops import their kernels when first launched.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from lutb_kernels.checkpoint import DTYPES, CheckpointConfig, LayerWeights
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.experts.base import LayerExperts, Support
from lutb_kernels.mxfp8 import SCALE_MODES
from lutb_kernels.mxfp8_triton import MIN_TRITON, NONFINITE_MESSAGE, triton_available, triton_installed, triton_release
from lutb_kernels.reference import OutputMode
from lutb_kernels.routing import moe_align_block_size
from lutb_kernels.routing_triton import moe_align_block_size_triton, triton_routing_wins
from lutb_kernels.tiles import TILE

# ----------------------------------------------------------------------------- support predicates


def triton_present() -> Support:
    """triton is installed, and not older than :data:`~lutb_kernels.mxfp8_triton.MIN_TRITON` (a version that cannot be
    read is given the benefit of the doubt). Reads the package metadata only: triton is not imported."""
    if not triton_installed():
        return Support(False, "triton is not installed (install the 'cuda' extra)")
    if not triton_available():  # installed, so too old
        need, release = ".".join(map(str, MIN_TRITON)), ".".join(map(str, triton_release() or ()))
        return Support(False, f"triton {release} is older than {need}, which the kernels need "
                              f"(upgrade triton to >= {need}, with a torch built for it)")
    return Support(True, "triton present")


def cuda_device(device: torch.device) -> Support:
    device = torch.device(device)
    if device.type != "cuda":
        return Support(False, f"needs a CUDA device, got {device.type}")
    if not torch.cuda.is_available():
        return Support(False, "CUDA is not available")
    return Support(True, f"CUDA device {torch.cuda.get_device_name(device)}")


def _capability_at_least(device: torch.device, least: tuple[int, int], why: str) -> Support:
    """The CUDA device's compute capability is ``least`` or newer (``why``: what needs it, for the reason)."""
    cap = torch.cuda.get_device_capability(device)
    if cap < least:
        return Support(False, f"needs compute capability {least[0]}.{least[1]} or newer ({why}), got {cap[0]}.{cap[1]}")
    return Support(True, f"compute capability {cap[0]}.{cap[1]}")


def nvidia_sm80(device: torch.device) -> Support:
    """The emulated backend's grouped GEMM multiplies bfloat16 (or float16) on tensor cores: compute capability 8.0+."""
    if torch.version.hip is not None:
        return Support(True, "a ROCm device (not tested)")
    return _capability_at_least(device, (8, 0), "bfloat16 tensor-core dots")


def nvidia_sm89(device: torch.device) -> Support:
    if torch.version.hip is not None:
        return Support(False, "the packed kernel's decoder uses NVIDIA PTX (prmt); ROCm is not supported")
    return _capability_at_least(device, (8, 9), "Triton's float8e4nv conversions")


def shape_ok(config: CheckpointConfig) -> Support:
    if config.hidden_size % TILE or config.intermediate_size % TILE:
        return Support(False, f"hidden_size and intermediate_size must be multiples of {TILE}, got {config.hidden_size} and {config.intermediate_size}")
    return Support(True, "")


def quant_scheme_ok(config: CheckpointConfig) -> Support:
    if not isinstance(config, CheckpointConfig):
        return Support(False, f"needs a LUT-B v1 checkpoint config, got {type(config).__name__}")
    if config.mxfp8_scale_mode not in SCALE_MODES:
        return Support(False, f"unknown MXFP8 scale mode {config.mxfp8_scale_mode!r}")
    return Support(True, "")


def dtype_ok(config: CheckpointConfig) -> Support:
    if config.dtype not in DTYPES:
        return Support(False, f"model dtype must be one of {', '.join(DTYPES)}, got {config.dtype!r}")
    return Support(True, "")


def choose_route_block(num_routes: int, num_local_experts: int) -> int:
    """Rows per routing block: 16/32/64/128/256 by the average rows per held expert.

    Smaller blocks waste fewer padded rows at small batches (decode: one route per expert pads
    to 16, not 128); 128 keeps the tensor cores busy at large ones. Depends on shapes only, so
    a captured CUDA graph stays valid for its batch size.
    """
    avg = num_routes / max(1, min(num_local_experts, num_routes))
    if avg <= 16:
        return 16
    if avg <= 32:
        return 32
    if avg <= 96:
        return 64
    if avg <= 512:
        return 128
    return 256


# ----------------------------------------------------------------------------- the skeleton


class RoutedTritonExperts(LayerExperts):
    """Base of the grouped-GEMM backends; subclasses implement :meth:`_routed_forward`."""

    name: ClassVar[str]
    fixed_route_block: ClassVar[int | None] = None
    capture_safe: ClassVar[bool] = True
    """``forward_unchecked`` does no host sync, launches by shapes only, only flags NaN/Inf, and
    computes each token from its own row and routes (see ``LayerExperts.capture_safe``)."""

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        super().__init__(config, weights, device)
        self._emap = self.expert_map()
        self.whole_layer = self.num_local_experts == config.num_experts
        """Every expert of the layer is held: every route but padding is, so route-major output skips the masking."""

    def launch_key(self, num_tokens: int, top_k: int) -> tuple:
        """What picks the compiled kernels of a forward over ``num_tokens`` tokens of ``top_k`` routes each.

        Two batch sizes with equal keys launch the same kernel variants, since no kernel
        specialises on a batch-size argument (docs/kernels.md, "One compile per config"):
        ``ComputeWorker.warm_up`` runs one batch per key so that no batch compiles under load.
        Sizes only (no device work); the configs come from the same functions the launches call:
        the routing block, the routing kernel's chunks, the two MXFP8 launches' blocks, and the two
        GEMMs' configs (:meth:`_gemm_launches`).
        """
        from lutb_kernels.mxfp8_triton import launch_blocks
        from lutb_kernels.routing import max_padded_routes
        from lutb_kernels.routing_triton import routing_launch

        routes = num_tokens * top_k
        route_block = self.route_block(routes)
        routing: tuple = ()  # torch ops above triton_routing_wins' limit: nothing to compile
        if triton_routing_wins(routes, self.config.num_experts):
            padded = max_padded_routes(routes, route_block, self.config.num_experts)
            launch = routing_launch(routes, self.config.num_experts, padded, -(-padded // route_block))
            routing = tuple(getattr(launch, name) for name in launch.__slots__)
        quantize = (launch_blocks(num_tokens, self.config.hidden_size, self.device),  # x: [T, H]
                    launch_blocks(routes, self.config.intermediate_size, self.device))  # act(h): [T*k, I]
        return (route_block, routing, quantize, *self._gemm_launches(routes, route_block))

    def _gemm_launches(self, num_routes: int, route_block: int) -> tuple:
        """The launch configs of the two GEMMs of a ``num_routes`` batch, as :meth:`_routed_forward` picks them."""
        return ()

    def route_block(self, num_routes: int) -> int:
        """Rows per routing block for a batch of ``num_routes`` routes (``tokens * top_k``).

        Sized by the routes expected at the held experts under uniform routing: a shard holding
        a quarter of the experts receives about a quarter of the routes (the others are only
        masked out), so its blocks are sized as for that many. Sizes only: graphs stay valid.
        """
        if self.fixed_route_block is not None:
            return self.fixed_route_block
        return choose_route_block(self.held_routes(num_routes), self.num_local_experts)

    def held_routes(self, num_routes: int) -> int:
        """Routes of a ``num_routes`` batch expected at the held experts (uniform routing; rounded up).

        All of them for a whole layer; ``num_routes * held / num_experts`` for a shard. Sizes
        routing blocks and GEMM launches (``held_routes=`` of the GEMMs), never results.
        """
        return -(-num_routes * self.num_local_experts // self.config.num_experts)

    def _routed_forward(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        held: torch.Tensor,
        routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        top_k: int,
        route_block: int,
        nonfinite: torch.Tensor,
        *,
        weight_on_input: bool,
        weight_on_output: bool,
    ) -> torch.Tensor:
        """Spec steps 1-6 for the held routes: ``[T*k, H]`` in ``x.dtype`` (other rows unspecified).

        ``held``: bool ``[T, k]``, the routes whose expert is held here (not padding, and for a shard its own).
        """
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
    ) -> torch.Tensor:
        """Validate, run :meth:`forward_unchecked`, refuse NaN/Inf (two host syncs in all)."""
        self._check_inputs(x, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        nonfinite = torch.zeros(1, dtype=torch.int32, device=self.device)
        out = self.forward_unchecked(
            x, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, nonfinite=nonfinite,
        )
        if x.shape[0] and bool(nonfinite.item()):
            raise NonFiniteInputError(NONFINITE_MESSAGE)
        return out

    def forward_unchecked(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
        nonfinite: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` without validation and without host syncs (CUDA-graph capturable).

        The caller vouches for the arguments (as :meth:`forward` checks them, except that an id may be -1: a padding
        route, which costs no GEMM rows and adds nothing) and, when it
        passes an int32 ``[1]`` ``nonfinite`` flag, reads it afterwards: 1 means an MXFP8
        quantization met NaN/Inf and the output must not be used. ``out``: optional ``[T, H]``
        in the model dtype that receives a ``combined`` output (ignored for ``route_major``).
        """
        from lutb_kernels.grouped_gemm import moe_combine

        tokens, top_k = topk_ids.shape
        hidden = self.config.hidden_size
        if tokens == 0:
            if out is not None and output_mode == "combined":
                return out
            shape = (0, top_k, hidden) if output_mode == "route_major" else (0, hidden)
            return torch.empty(shape, dtype=x.dtype, device=self.device)
        if nonfinite is None:
            nonfinite = torch.zeros(1, dtype=torch.int32, device=self.device)
        x = x.contiguous()
        weights = topk_weights.float().contiguous()
        # [T, k]: which routes go to experts held here, written by the routing op; a whole layer needs it for padding
        # routes (id -1), whose activation rows are never computed and must not reach the NaN/Inf check
        held = torch.empty((tokens, top_k), dtype=torch.bool, device=self.device)
        route_block = self.route_block(tokens * top_k)
        align = moe_align_block_size_triton if triton_routing_wins(topk_ids.numel(), self.config.num_experts) else moe_align_block_size
        routing = align(topk_ids, route_block, self.config.num_experts, expert_map=self._emap, held_out=held)
        y = self._routed_forward(
            x, weights, held, routing, top_k, route_block, nonfinite,
            weight_on_input=apply_router_weight_on_input,
            weight_on_output=output_mode == "combined" and not apply_router_weight_on_input,
        )
        if output_mode == "route_major":
            y = y.view(tokens, top_k, hidden)
            return y if self.whole_layer else y.masked_fill(~held.unsqueeze(-1), 0)
        return moe_combine(y, held, top_k, out=out)
