"""The reference MoE forward pass (spec section 4): plain PyTorch, written to be read.

This is the judge every fast backend is tested against, and what a client runs
locally to check a node. It favours clarity over speed: one expert at a time,
float32 where the spec says float32, an explicit rounding to the model dtype
after each step.
"""

from __future__ import annotations

from typing import Literal

import torch

from lutb_kernels.activations import apply_activation, check_activation, w13_rows
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.mxfp8 import ScaleMode, mxfp8_qdq

OutputMode = Literal["combined", "route_major"]
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_forward_args(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    *,
    num_experts: int,
    apply_router_weight_on_input: bool,
    output_mode: OutputMode,
) -> None:
    """Validate the routing inputs of a forward pass; raise ValueError naming the argument.

    Shared by every backend so that all of them refuse the same requests.
    """
    if x.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in MODEL_DTYPES:
        raise ValueError(f"hidden_states dtype must be bfloat16, float16 or float32, got {x.dtype}")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.shape[1] < 1:
        raise ValueError(f"topk_ids must be [T, k] with T = {x.shape[0]} and k >= 1, got shape {tuple(topk_ids.shape)}")
    if topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_ids shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise ValueError(f"topk_ids must lie in [0, {num_experts}), got values in [{int(topk_ids.min())}, {int(topk_ids.max())}]")
    if apply_router_weight_on_input and topk_ids.shape[1] != 1:
        raise ValueError(f"apply_router_weight_on_input needs top-k == 1, got k = {topk_ids.shape[1]}")
    if output_mode not in ("combined", "route_major"):
        raise ValueError(f"output_mode must be 'combined' or 'route_major', got {output_mode!r}")
    if output_mode == "route_major" and apply_router_weight_on_input:
        raise ValueError("route_major output cannot be combined with apply_router_weight_on_input")


def _qdq_finite(v: torch.Tensor, scale_mode: ScaleMode, what: str) -> torch.Tensor:
    """``QDQ(v)`` rounded to ``v.dtype`` (spec steps 2 and 5); NonFiniteInputError when ``v`` or the result is not
    finite (the result: a 32-block that MXFP8 rounding carried past the dtype's largest finite value)."""
    out = mxfp8_qdq(v, scale_mode)
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteInputError(f"MXFP8 quantization of the {what} rounds a 32-block past the largest finite "
                                  f"{str(v.dtype).removeprefix('torch.')} value")
    return out


def reference_moe_forward(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    expert_ids: torch.Tensor,
    *,
    num_experts: int,
    activation: str = "silu",
    apply_router_weight_on_input: bool = False,
    output_mode: OutputMode = "combined",
    scale_mode: ScaleMode = "rceil",
) -> torch.Tensor:
    """Run the experts held on a routed token batch, exactly as spec section 4 says.

    Args:
        x: ``[T, H]`` hidden states in the model dtype ``d`` (bfloat16, float16 or float32).
        topk_ids: int32/int64 ``[T, k]`` global expert ids in ``[0, num_experts)``.
        topk_weights: float32 ``[T, k]`` router weights.
        w13: float32 ``[E_local, 2I or I, H]`` dequantized gate/up weights of the experts held.
        w2: float32 ``[E_local, H, I]`` dequantized down weights.
        expert_ids: integer ``[E_local]`` global ids of the experts held, ascending.
        num_experts: the global expert count.
        activation: one of :data:`lutb_kernels.activations.ACTIVATIONS`.
        apply_router_weight_on_input: multiply ``x`` by the weight before the experts (``k == 1``).
        output_mode: ``"combined"`` sums the routes; ``"route_major"`` returns each route's
            unweighted output.
        scale_mode: MXFP8 scale mode of both activation quantizations.

    Returns:
        ``[T, H]`` (combined) or ``[T, k, H]`` (route-major) in ``d``. Routes to experts
        not held contribute exactly zero.

    Raises:
        ValueError: bad arguments (:func:`check_forward_args`, weights of the wrong shape).
        NonFiniteInputError: ``x`` holds NaN or infinity anywhere, also in a token none of whose experts is held
            (spec section 3: such input is an error, whichever rows a backend quantizes), so does ``x`` times its
            router weight (``apply_router_weight_on_input``: step 1 overflowing), or an activation output does;
            also a QDQ (steps 2 and 5) rounded to ``d`` that is infinite (MXFP8 rounding carried a value within one
            e4m3 step of ``d``'s largest past it, docs/format.md (k)), step 2's in any token, held or not.
    """
    check_activation(activation)
    check_forward_args(
        x, topk_ids, topk_weights, num_experts=num_experts,
        apply_router_weight_on_input=apply_router_weight_on_input, output_mode=output_mode,
    )
    d = x.dtype
    tokens, k = topk_ids.shape
    hidden = x.shape[1]
    intermediate = w2.shape[-1]
    if w13.shape[1:] != (w13_rows(activation, intermediate), hidden) or w2.shape[1:] != (hidden, intermediate):
        raise ValueError(f"weights w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not fit H={hidden}, activation={activation}")
    if not bool(torch.isfinite(x).all()):
        raise NonFiniteInputError("MXFP8 quantization refuses NaN or infinite input (hidden states)")

    weights = topk_weights.float()
    x_in = x
    if apply_router_weight_on_input:  # step 1, every token (k = 1): an overflow is refused wherever its expert is held
        x_in = (x.float() * weights[:, 0:1]).to(d)
        if not bool(torch.isfinite(x_in).all()):
            raise NonFiniteInputError("MXFP8 quantization refuses NaN or infinite input (hidden states times router weights)")
    # Step 2 depends on the token only, so it is done (and checked) once for every token, held or not.
    a1_all = _qdq_finite(x_in, scale_mode, "hidden states")
    route_out = torch.zeros(tokens, k, hidden, dtype=torch.float32, device=x.device)
    for local, global_id in enumerate(expert_ids.tolist()):
        token_idx, route_idx = torch.nonzero(topk_ids == global_id, as_tuple=True)
        if token_idx.numel() == 0:
            continue
        w = weights[token_idx, route_idx]
        a1 = a1_all[token_idx]  # step 2 (in d)
        h = (a1.float() @ w13[local].float().T).to(d)  # step 3
        g = apply_activation(activation, h).to(d)  # step 4
        a2 = _qdq_finite(g, scale_mode, "activation output")  # step 5
        y = a2.float() @ w2[local].float().T  # step 6
        if not apply_router_weight_on_input and output_mode == "combined":
            y = y * w[:, None]
        route_out[token_idx, route_idx] = y.to(d).float()
    if output_mode == "route_major":
        return route_out.to(d)
    return route_out.sum(dim=1).to(d)  # step 7


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """Spec section 6's agreement measure: ``||got - want|| / ||want||`` over all elements, in float64 (NaN when either
    holds a NaN; ``want`` all zeros divides by 1e-30, so any difference is huge)."""
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))
