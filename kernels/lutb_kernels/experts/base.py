"""The interface every experts backend implements, and its support predicates."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, NamedTuple

import torch

from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
from lutb_kernels.reference import OutputMode, check_forward_args


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``"cuda"`` -> ``cuda:<current>``), so it compares equal to tensors' devices."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Support(NamedTuple):
    """Whether a backend can run here, and why (or why not)."""

    ok: bool
    reason: str


def all_of(*checks: Callable[[], Support]) -> Support:
    """Run support predicates in order; the first failure wins, else all reasons are joined."""
    reasons = []
    for check in checks:
        result = check()
        if not result.ok:
            return result
        reasons.append(result.reason)
    return Support(True, "; ".join(r for r in reasons if r))


class LayerExperts(ABC):
    """One MoE layer's experts, loaded for one backend on one device.

    Subclasses set :attr:`name` and implement :meth:`supports` and :meth:`forward`.
    ``forward`` computes spec section 4 for a routed batch and must refuse bad
    input with ``ValueError`` (see :func:`lutb_kernels.reference.check_forward_args`).
    """

    name: ClassVar[str]
    capture_safe: ClassVar[bool] = False
    """True when the subclass also has ``forward_unchecked(x, topk_ids, topk_weights, *,
    apply_router_weight_on_input, output_mode, nonfinite, out=None)`` that a CUDA graph can capture:
    no host sync and no host-side branch on tensor values, launch configuration a function
    of the shapes only, allocations only through torch's caching allocator, NaN/Inf only
    flagged (``nonfinite |= 1``, never cleared, never raised), each token's output a
    function of its own row alone for a given batch size (padding rows cannot change real
    rows), a route of id -1 (a padding route, :data:`lutb_kernels.experts.graphs.PAD_ROUTE`) taken as no
    expert's (no GEMM rows, nothing added to the output, outside the NaN/Inf check), and a ``combined`` output
    written into ``out`` (``[T, H]``, model dtype) and returned when ``out`` is given. :class:`lutb_kernels.experts.graphs.CudaGraphExperts` captures only such backends."""

    def __init__(self, config: CheckpointConfig, weights: LayerWeights, device: torch.device | str) -> None:
        self.config = config
        self.device = resolve_device(device)
        self.expert_ids = weights.expert_ids.to(torch.int32)
        self.num_local_experts = int(self.expert_ids.numel())

    def _check_inputs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                      apply_router_weight_on_input: bool, output_mode: OutputMode) -> None:
        """What ``forward`` refuses (ValueError naming the argument): :func:`~lutb_kernels.reference.check_forward_args`,
        ``x`` without ``hidden_size`` columns or not in the model dtype, and any tensor not on :attr:`device`.

        Every backend refuses the same requests: one that converted ``x`` silently would answer what another refuses.
        """
        check_forward_args(
            x, topk_ids, topk_weights, num_experts=self.config.num_experts,
            apply_router_weight_on_input=apply_router_weight_on_input, output_mode=output_mode,
        )
        if x.shape[1] != self.config.hidden_size:
            raise ValueError(f"hidden_states must have {self.config.hidden_size} columns, got {x.shape[1]}")
        if x.dtype != self.config.torch_dtype:
            raise ValueError(f"hidden_states must be {self.config.torch_dtype} (the checkpoint's model dtype), got {x.dtype}")
        for name, t in (("hidden_states", x), ("topk_ids", topk_ids), ("topk_weights", topk_weights)):
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device}, got {t.device}")

    @classmethod
    @abstractmethod
    def supports(cls, config: CheckpointConfig, device: torch.device) -> Support:
        """Can this backend run ``config``'s experts on ``device``? Cheap; loads nothing."""

    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: OutputMode = "combined",
    ) -> torch.Tensor:
        """Run the experts held on a routed batch.

        Args:
            x: ``[T, H]`` in the checkpoint's model dtype, on :attr:`device`.
            topk_ids: int32/int64 ``[T, k]`` global expert ids in ``[0, num_experts)``.
            topk_weights: float32 ``[T, k]``.
            apply_router_weight_on_input: weight the input instead of the output (``k == 1``).
            output_mode: ``"combined"`` -> ``[T, H]``; ``"route_major"`` -> ``[T, k, H]``.

        Returns:
            The output in the model dtype on :attr:`device`; routes to experts not held add zero.
        """

    @property
    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes of weights this layer holds on its device."""

    def expert_map(self) -> torch.Tensor:
        """int32 ``[num_experts]``: local index of each global expert held, -1 elsewhere."""
        emap = torch.full((self.config.num_experts,), -1, dtype=torch.int32)
        emap[self.expert_ids.long()] = torch.arange(self.num_local_experts, dtype=torch.int32)
        return emap.to(self.device)
