"""Router helpers with vLLM's semantics: turn router logits into ``(topk_weights, topk_ids)``.

All scores are computed in float32. Weights come back float32 ``[T, k]`` and ids
int32 ``[T, k]``, each token's routes in descending order of the score that chose
them (vLLM leaves the order unspecified where it passes ``sorted=False``; the
sets of routes and their weights are the same).
"""

from __future__ import annotations

from typing import Literal

import torch

ScoringFunc = Literal["softmax", "sigmoid"]


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"router logits must be [T, E], got shape {tuple(logits.shape)}")
    x = logits.float()
    if scoring_func == "softmax":
        return torch.softmax(x, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(x)
    raise ValueError(f"scoring_func must be 'softmax' or 'sigmoid', got {scoring_func!r}")


def _check_k(top_k: int, experts: int) -> None:
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must lie in [1, {experts}], got {top_k}")


def _finish(weights: torch.Tensor, ids: torch.Tensor, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if scale != 1.0:
        weights = weights * scale
    return weights.to(torch.float32), ids.to(torch.int32)


def topk_routing(
    logits: torch.Tensor, top_k: int, *, scoring_func: ScoringFunc = "softmax", renormalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``fused_topk``: scores = softmax or sigmoid of ``logits [T, E]``; the top-k scores are the weights.

    Returns:
        ``(topk_weights float32 [T, k], topk_ids int32 [T, k])``; with ``renormalize``
        each token's weights are divided by their sum.
    """
    scores = _scores(logits, scoring_func)
    _check_k(top_k, scores.shape[-1])
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return _finish(weights, ids, renormalize, 1.0)


def softmax_topk(logits: torch.Tensor, top_k: int, *, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_routing` with softmax scores (Mixtral, Qwen-MoE)."""
    return topk_routing(logits, top_k, scoring_func="softmax", renormalize=renormalize)


def sigmoid_topk(logits: torch.Tensor, top_k: int, *, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`topk_routing` with sigmoid scores (Llama-4 style)."""
    return topk_routing(logits, top_k, scoring_func="sigmoid", renormalize=renormalize)


def grouped_topk(
    logits: torch.Tensor,
    top_k: int,
    *,
    num_expert_group: int,
    topk_group: int,
    scoring_func: ScoringFunc = "softmax",
    e_score_correction_bias: torch.Tensor | None = None,
    renormalize: bool = True,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM ``grouped_topk`` (DeepSeek-V2/V3 routing).

    ``scores = scoring_func(logits)``. Without a bias a group scores its best expert;
    with ``e_score_correction_bias`` (DeepSeek-V3: sigmoid scoring) experts are chosen
    by ``scores + bias`` and a group scores the sum of its top-2 biased scores. The
    ``topk_group`` best groups are kept, the ``top_k`` best (biased) scores among their
    experts chosen, and the weights taken from the unbiased scores, renormalized if asked,
    then multiplied by ``routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` router logits, ``E % num_expert_group == 0``.
        e_score_correction_bias: ``[E]`` or None.
    """
    scores = _scores(logits, scoring_func)
    tokens, experts = scores.shape
    _check_k(top_k, experts)
    if num_expert_group < 1 or experts % num_expert_group:
        raise ValueError(f"num_expert_group must divide the expert count {experts}, got {num_expert_group}")
    if not 1 <= topk_group <= num_expert_group:
        raise ValueError(f"topk_group must lie in [1, {num_expert_group}], got {topk_group}")
    per_group = experts // num_expert_group
    if top_k > topk_group * per_group:
        raise ValueError(f"top_k {top_k} exceeds the {topk_group * per_group} experts of the kept groups")
    if e_score_correction_bias is not None:
        choice = scores + e_score_correction_bias.float().reshape(1, experts)
        group_scores = choice.view(tokens, num_expert_group, per_group).topk(min(2, per_group), dim=-1).values.sum(dim=-1)
    else:
        choice = scores
        group_scores = choice.view(tokens, num_expert_group, per_group).amax(dim=-1)
    kept_groups = torch.topk(group_scores, topk_group, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept_groups, True)
    expert_mask = group_mask.unsqueeze(-1).expand(tokens, num_expert_group, per_group).reshape(tokens, experts)
    masked = choice.masked_fill(~expert_mask, float("-inf"))
    ids = torch.topk(masked, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return _finish(weights, ids, renormalize, routed_scaling_factor)


__all__ = ["ScoringFunc", "grouped_topk", "sigmoid_topk", "softmax_topk", "topk_routing"]
