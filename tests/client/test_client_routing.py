"""lutb_client.routing against straightforward per-token implementations of vLLM's semantics."""

from __future__ import annotations

import math

import pytest
import torch

from lutb_client.routing import grouped_topk, sigmoid_topk, softmax_topk, topk_routing


def _naive_topk(logits: torch.Tensor, k: int, scoring: str, renormalize: bool) -> list[dict[int, float]]:
    """Per token: {expert: weight}, with Python math only."""
    out = []
    for row in logits.tolist():
        if scoring == "softmax":
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        chosen = sorted(range(len(row)), key=lambda e: -scores[e])[:k]
        total = sum(scores[e] for e in chosen) if renormalize else 1.0
        out.append({e: scores[e] / total for e in chosen})
    return out


def _naive_grouped(logits, k, groups, topk_group, scoring, bias, renormalize, scale):
    out = []
    experts = logits.shape[1]
    per = experts // groups
    for row in logits.tolist():
        if scoring == "softmax":
            m = max(row)
            exps = [math.exp(v - m) for v in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-v)) for v in row]
        choice = [scores[e] + (bias[e] if bias is not None else 0.0) for e in range(experts)]
        group_score = []
        for g in range(groups):
            members = sorted((choice[e] for e in range(g * per, (g + 1) * per)), reverse=True)
            group_score.append(sum(members[:2]) if bias is not None else members[0])
        kept = sorted(range(groups), key=lambda g: -group_score[g])[:topk_group]
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = sorted(candidates, key=lambda e: -choice[e])[:k]
        total = sum(scores[e] for e in chosen) if renormalize else 1.0
        out.append({e: scores[e] / total * scale for e in chosen})
    return out


def _as_dicts(weights: torch.Tensor, ids: torch.Tensor) -> list[dict[int, float]]:
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    return [dict(zip(i, w)) for i, w in zip(ids.tolist(), weights.tolist())]


def _assert_close(got: list[dict[int, float]], want: list[dict[int, float]]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for e in g:
            assert g[e] == pytest.approx(w[e], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("tokens", [1, 5, 16])
@pytest.mark.parametrize(("experts", "k"), [(8, 1), (8, 2), (16, 6), (7, 7)])
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_routing(tokens: int, experts: int, k: int, scoring: str, renormalize: bool) -> None:
    logits = torch.randn(tokens, experts) * 3
    weights, ids = topk_routing(logits, k, scoring_func=scoring, renormalize=renormalize)
    assert weights.shape == ids.shape == (tokens, k)
    _assert_close(_as_dicts(weights, ids), _naive_topk(logits, k, scoring, renormalize))


def test_named_variants_match_topk_routing() -> None:
    logits = torch.randn(4, 8)
    assert all(torch.equal(a, b) for a, b in zip(softmax_topk(logits, 2), topk_routing(logits, 2)))
    assert all(torch.equal(a, b) for a, b in zip(sigmoid_topk(logits, 2), topk_routing(logits, 2, scoring_func="sigmoid")))


@pytest.mark.parametrize(
    ("experts", "groups", "topk_group", "k"), [(16, 4, 2, 4), (32, 8, 4, 8), (8, 1, 1, 2), (12, 3, 3, 3)]
)
@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_grouped_topk(experts: int, groups: int, topk_group: int, k: int, scoring: str, with_bias: bool) -> None:
    logits = torch.randn(9, experts) * 2
    bias = torch.randn(experts) * 0.5 if with_bias else None
    weights, ids = grouped_topk(
        logits, k, num_expert_group=groups, topk_group=topk_group, scoring_func=scoring,
        e_score_correction_bias=bias, renormalize=True, routed_scaling_factor=2.5,
    )
    want = _naive_grouped(logits, k, groups, topk_group, scoring, bias.tolist() if bias is not None else None, True, 2.5)
    _assert_close(_as_dicts(weights, ids), want)


def test_deepseek_v3_weights_come_from_unbiased_scores() -> None:
    logits = torch.zeros(1, 8)
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 5.0, 5.0])  # bias alone picks experts 6 and 7
    weights, ids = grouped_topk(logits, 2, num_expert_group=2, topk_group=1, scoring_func="sigmoid",
                                e_score_correction_bias=bias, renormalize=False, routed_scaling_factor=1.0)
    assert sorted(ids[0].tolist()) == [6, 7]
    assert torch.allclose(weights, torch.full((1, 2), 0.5))  # sigmoid(0), not sigmoid(0) + 5


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"top_k": 9}, "top_k"), ({"top_k": 0}, "top_k")],
)
def test_refusals(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        softmax_topk(torch.randn(2, 8), **kwargs)
    with pytest.raises(ValueError, match="num_expert_group"):
        grouped_topk(torch.randn(2, 8), 2, num_expert_group=3, topk_group=1)
