"""Input suites and error statistics of `lutb_client.check`: deterministic, covering, finite, exact."""

from __future__ import annotations

from dataclasses import replace

import math

import pytest
import torch

from lutb_client.check.compare import ErrorStats, route_rows_by_expert
from lutb_client.check.suites import SUITES, NodeShape, headroom_probe, make_batches, resolve_suites, tiny_exponents


def _shape(dtype: torch.dtype = torch.bfloat16, held: tuple[int, ...] = (0, 1, 2, 4, 5, 7)) -> NodeShape:
    return NodeShape(hidden_size=128, num_experts=8, dtype=dtype, experts={0: list(held), 3: list(held)}, max_tokens=16, topk=4)


def _same(a, b) -> bool:
    return all(torch.equal(getattr(x, f), getattr(y, f)) for x, y in zip(a, b)
               for f in ("hidden_states", "topk_ids", "topk_weights")) and len(a) == len(b)


def test_resolve_suites() -> None:
    assert resolve_suites(None) == list(SUITES) == resolve_suites(["all"])
    assert resolve_suites(["route_major,normal"]) == ["normal", "route_major"]
    with pytest.raises(ValueError, match="unknown suite.*nope"):
        resolve_suites(["nope"])


def test_batches_are_deterministic_and_independent_of_the_selection() -> None:
    shape = _shape()
    every = make_batches(list(SUITES), shape, [0, 3], cap=16, seed=5, headroom=lambda layer: 2.0**20)
    again = make_batches(list(SUITES), shape, [0, 3], cap=16, seed=5, headroom=lambda layer: 2.0**20)
    assert _same(every, again)
    alone = make_batches(["coverage"], shape, [3], cap=16, seed=5)
    assert _same(alone, [b for b in every if b.part == "coverage" and b.layer == 3])
    other_seed = make_batches(["normal"], shape, [0], cap=16, seed=6)
    assert not torch.equal(other_seed[0].hidden_states, [b for b in every if b.part == "normal"][0].hidden_states)
    assert [b.index for b in every] == list(range(len(every)))


def test_batch_kinds() -> None:
    shape = _shape()
    every = make_batches(list(SUITES), shape, [0], cap=16, seed=0, headroom=lambda layer: 2.0**30)
    assert all(b.tokens <= 16 for b in every)  # requests of at most the cap
    tokens: dict[str, int] = {}
    for b in every:
        tokens[b.part] = tokens.get(b.part, 0) + b.tokens
    batches = {}
    for b in every:
        batches.setdefault(b.part, b)  # each part's first request
    # a standard batch holds 64 tokens whatever the cap (judged strictly), sent as 4 requests of 16; single_token
    # is 64 requests of one token, small_batches requests of 2..16 tokens, at least 64 together
    assert tokens["single_token"] == 64 and tokens["max_tokens"] == 16 and tokens["normal"] == 64
    assert {b.tokens for b in every if b.part == "single_token"} == {1}
    assert tokens["small_batches"] >= 64 and {b.tokens for b in every if b.part == "small_batches"} == {2, 3, 4, 8, 9, 16}
    woi = batches["weights_on_input"]
    assert woi.apply_router_weight_on_input and woi.topk_ids.shape[1] == 1 and woi.output_mode == "combined"
    assert batches["route_major"].output_mode == "route_major" and batches["normal"].output_mode == "combined"
    for b in batches.values():
        assert b.hidden_states.dtype == torch.bfloat16 and torch.isfinite(b.hidden_states.float()).all()
        assert b.topk_ids.dtype == torch.int32 and b.topk_weights.dtype == torch.float32
        # distinct experts per token, but in duplicates: there the first two routes name one expert
        rows = b.topk_ids.tolist()
        if b.part == "duplicates":
            assert all(row[0] == row[1] and len(set(row)) == len(row) - 1 for row in rows)
        else:
            assert all(len(set(row)) == len(row) for row in rows)
    heavy = batches["heavy_tailed"].hidden_states.float()
    assert heavy.abs().amax(0).max() > 20 * heavy.abs().amax(0).median()  # outlier channels
    huge = batches["magnitudes/huge"].hidden_states.float()
    assert huge.abs().max() <= 2.0**30 and huge.abs().max() >= 2.0**29
    tiny = batches["magnitudes/tiny"].hidden_states.float()
    blocks = tiny.reshape(tiny.shape[0], -1, 32).abs().amax(-1)
    assert (blocks[:2] < 2.0**-100).all() and (blocks < torch.finfo(torch.bfloat16).tiny).any()  # tiny rows, subnormal blocks
    assert (blocks > 0).all()


def test_coverage_routes_every_held_expert_enough() -> None:
    shape = _shape()
    batches = make_batches(["coverage"], shape, [0], cap=5, seed=0)
    assert all(b.tokens <= 5 for b in batches) and len(batches) > 1
    ids = torch.cat([b.topk_ids for b in batches])
    counts = torch.bincount(ids.reshape(-1).long(), minlength=8)
    assert [e for e in range(8) if counts[e] > 0] == [0, 1, 2, 4, 5, 7]
    assert int(counts[[0, 1, 2, 4, 5, 7]].min()) >= 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_tiny_exponents_reach_the_subnormals(dtype: torch.dtype) -> None:
    lo, hi = tiny_exponents(dtype)
    assert 2.0**-hi < torch.finfo(dtype).tiny < 2.0**-lo
    assert torch.tensor(2.0**-hi, dtype=dtype) > 0


def test_headroom_probe_finds_the_overflow_edge() -> None:
    """A fake judge whose output overflows beyond input amax 2^40 gives 2^38 (two binades below the edge)."""
    shape = _shape()

    def judge(batch):
        if batch.hidden_states.float().abs().max() > 2.0**40:
            return torch.full((batch.tokens, 128), math.inf)
        return torch.zeros(batch.tokens, 128)

    assert headroom_probe(judge, 0, shape, too_big=lambda exc: False) == 2.0**38


def test_error_stats() -> None:
    ref = torch.tensor([[1.0, 2.0, 0.0, 4.0]])
    got = torch.tensor([[1.0, 2.5, math.nan, 4.0]])
    s = ErrorStats()
    s.add(got, ref)
    assert s.nonfinite_mismatch == 1 and s.nan_got == 1 and s.nan_ref == 0
    assert s.exact == 2 and s.exact_share == 0.5
    assert math.isclose(s.rel_l2, 0.5 / math.sqrt(21)) and math.isclose(s.max_abs, 0.5)
    zero = ErrorStats()
    zero.add(torch.zeros(2, 4), torch.zeros(2, 4))
    assert zero.rel_l2 == 0 and zero.cosine == 1 and zero.exact_share == 1
    off = ErrorStats()
    off.add(torch.ones(1, 4), torch.zeros(1, 4))
    assert off.rel_l2 == math.inf and off.to_dict()["rel_l2"] == "inf"
    pooled = ErrorStats()
    pooled.merge(s)
    pooled.merge(zero)
    assert pooled.rows == 3 and pooled.elements == 12 and pooled.rel_l2 == s.rel_l2


def test_route_rows_by_expert() -> None:
    ids = torch.tensor([[0, 3], [3, 1]], dtype=torch.int32)
    got = torch.arange(16.0).reshape(2, 2, 4)
    rows = route_rows_by_expert(got, got.clone(), ids)
    assert sorted(rows) == [0, 1, 3]
    assert torch.equal(rows[3][0], torch.stack([got[0, 1], got[1, 0]]))


def test_a_small_cap_still_judges_standard_rows_strictly() -> None:
    """With requests of at most 8 tokens, a standard part still holds 64 tokens, so its row is judged at the strict
    tolerance: a node 5x beyond it used to pass with --tokens 8 (every row then judged at 10x the tolerance)."""
    parts: dict[str, int] = {}
    for b in make_batches(["normal"], _shape(), [0], cap=8, seed=0):
        assert b.tokens <= 8
        parts[b.part] = parts.get(b.part, 0) + b.tokens
    assert parts == {"normal": 64}


def test_rows_where_the_judge_answers_nan_fail() -> None:
    """Two nodes answering the same NaN used to pass: nothing finite was compared, so rel L2 was 0."""
    from lutb_client.check.report import Row

    nan = torch.full((64, 8), float("nan"))
    both = ErrorStats()
    both.add(nan, nan)
    row = Row("normal", 0, both, tokens=64)
    row.judge(1e-2)
    assert not row.ok and "judge's output holds 512 NaN/Inf" in row.reasons[0]
    fine = ErrorStats()
    fine.add(torch.ones(64, 8), torch.ones(64, 8))
    row = Row("normal", 0, fine, tokens=64)
    row.judge(1e-2)
    assert row.ok


def test_duplicates_name_an_expert_twice_even_at_top_1() -> None:
    """With ``--topk 1`` the part once sent plain top-1 batches, which duplicate nothing, and passed."""
    shape = _shape()
    batches = make_batches(["duplicates"], replace(shape, topk=1), [0], cap=16, seed=0)
    assert batches and all(b.topk_ids.shape[1] == 2 and (b.topk_ids[:, 0] == b.topk_ids[:, 1]).all() for b in batches)
