"""The sharded clients' per-call planning, without servers: route assignment, sub-requests, combine.

The assignment is checked against :func:`reference_assign`, a plain-Python loop written from
the rule in ``lutb_client.sharded``'s docstring (step 2, with the failover of step 5), on
random placements with and without replicas, shards marked down, shards excluded after a
failure, and partial pending masks. Calls are driven through ``_Call`` with fake shards that
decode the sub-requests with the codec and answer with exactly representable values, so the
combined output can be compared bit for bit with the float32-sum-then-one-rounding rule.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch

from lutb_client import sharded
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.codec import decode_tensor, encode_tensor, to_proto_dtype
from lutb_client.errors import ExpertServiceError
from lutb_client.sharded import (
    _Call,
    _ShardedCore,
    _Sub,
    assign_owned_routes,
    assign_routes,
    build_subrequests,
)

H = 8
INF = float("inf")


# -- the documented rule, by hand ------------------------------------------------------------


def reference_assign(
    holders: np.ndarray, ids: np.ndarray, pending: np.ndarray, up: list[bool], excluded: set[int],
    outstanding: list[int], start: int,
) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]]]:
    """``({(token, route): shard}, [routes no shard can take])`` by the module docstring's rule.

    Step 2: per token, each pending route goes to the shard, among the usable ones holding its
    expert, that can take the most of the token's pending routes; ties to the fewest
    outstanding requests, then round-robin from ``start``. Step 5: shards excluded after a
    failure are never used; a shard marked down is used only for routes no live shard can take.
    """
    shards = holders.shape[1]
    order = sorted(range(shards), key=lambda s: (outstanding[s], (s - start) % shards))
    rank = {s: i for i, s in enumerate(order)}

    def one_pass(routes: list[tuple[int, int]], usable: list[int]) -> dict[tuple[int, int], int]:
        out: dict[tuple[int, int], int] = {}
        for t in sorted({t for t, _ in routes}):
            mine = [j for u, j in routes if u == t]
            count = {s: sum(1 for j in mine if holders[ids[t][j]][s]) for s in usable}
            for j in mine:
                candidates = [s for s in usable if holders[ids[t][j]][s]]
                if candidates:
                    out[(t, j)] = max(candidates, key=lambda s: (count[s], -rank[s]))
        return out

    tokens, k = ids.shape
    routes = [(t, j) for t in range(tokens) for j in range(k) if pending[t][j]]
    live = [s for s in range(shards) if s not in excluded]
    assigned = one_pass(routes, [s for s in live if up[s]])
    assigned.update(one_pass([r for r in routes if r not in assigned], live))
    return assigned, [r for r in routes if r not in assigned]


def test_the_reference_is_the_rule() -> None:
    """A hand-made case, so the reference itself is checked: counts first, then rank, then down/excluded."""
    holders = np.array([[1, 1, 0], [1, 0, 0], [0, 1, 1], [0, 1, 1]], dtype=bool)  # 4 experts, 3 shards
    ids = np.array([[0, 1], [0, 2], [2, 3]])
    pending = np.ones((3, 2), dtype=bool)
    got, stuck = reference_assign(holders, ids, pending, [True] * 3, set(), [0, 0, 0], 0)
    # token 0: shard 0 holds both its experts; token 1: shard 1 both; token 2: shards 1 and 2 tie -> rank: 1 first
    assert got == {(0, 0): 0, (0, 1): 0, (1, 0): 1, (1, 1): 1, (2, 0): 1, (2, 1): 1} and not stuck
    got, _ = reference_assign(holders, ids, pending, [True] * 3, set(), [0, 0, 0], 2)  # round-robin from shard 2
    assert got[(2, 0)] == got[(2, 1)] == 2 and got[(1, 0)] == 1
    one = np.array([[0]])  # expert 0: shards 0 and 1, a tie
    assert reference_assign(holders, one, np.ones((1, 1), bool), [True] * 3, set(), [0, 0, 0], 0)[0] == {(0, 0): 0}
    assert reference_assign(holders, one, np.ones((1, 1), bool), [True] * 3, set(), [0, 0, 0], 1)[0] == {(0, 0): 1}
    assert reference_assign(holders, one, np.ones((1, 1), bool), [True] * 3, set(), [5, 0, 0], 0)[0] == {(0, 0): 1}
    got, stuck = reference_assign(holders, ids, pending, [False, True, True], set(), [0] * 3, 0)  # 0 down
    assert got[(0, 1)] == 0 and got[(0, 0)] == 1 and not stuck  # the down shard only for what no live one holds
    got, stuck = reference_assign(holders, ids, pending, [True] * 3, {0}, [0] * 3, 0)  # 0 failed in this call
    assert stuck == [(0, 1)]


# -- a client core over made-up shards -------------------------------------------------------


def make_core(holders: np.ndarray, dtype: torch.dtype = torch.bfloat16) -> _ShardedCore:
    """A client core whose shards hold layer 0's experts as ``holders`` (bool ``[E, S]``); nothing connected."""
    experts, shards = holders.shape
    infos = []
    for s in range(shards):
        info = pb.ModelInfo(hidden_size=H, num_experts=experts, dtype=to_proto_dtype(dtype), format="lut-b",
                            format_version=1, activation="silu", mxfp8_scale_mode="rceil")
        layer = info.layers.add()
        layer.layer = 0
        layer.expert_ids.extend(np.flatnonzero(holders[:, s]).tolist())
        infos.append(info)
    core = _ShardedCore([f"shard-{s}:0" for s in range(shards)], 10.0, None, 5.0, "native", "stream")
    core._set_infos(infos)
    return core


def random_holders(rng: np.random.Generator, experts: int, shards: int, replicas: bool) -> np.ndarray:
    holders = np.zeros((experts, shards), dtype=bool)
    holders[np.arange(experts), rng.integers(0, shards, experts)] = True
    if replicas:
        holders |= rng.random((experts, shards)) < 0.3
        if rng.random() < 0.2:
            holders[:, rng.integers(shards)] = True  # a shard holding every expert: no null id there
    if rng.random() < 0.15:
        holders[rng.integers(experts)] = False  # an expert nobody holds
    return holders


def random_batch(rng: np.random.Generator, tokens: int, k: int, experts: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Exactly representable values: small integers times powers of two, so sums are exact in float32."""
    x = torch.from_numpy(rng.integers(-4, 5, (tokens, H)).astype(np.float32)).to(dtype)
    ids = torch.from_numpy(np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).reshape(tokens, k).astype(np.int32))
    w = torch.from_numpy(rng.integers(1, 8, (tokens, k)).astype(np.float32) / 4)
    return x, ids, w


def done_sub(flat: np.ndarray) -> _Sub:
    """A sub-request standing for routes already computed (only ``flat`` matters to ``_Call.pending``)."""
    return _Sub(0, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int32),
                np.zeros((0, 1), dtype=np.float32), False, flat)


def assignment_of(call: _Call) -> dict[tuple[int, int], int]:
    """The assignment ``call.plan()`` carries out: ``{(token, route): shard}`` from its sub-requests."""
    k = call.ids.shape[1]
    out: dict[tuple[int, int], int] = {}
    for sub, _ in call.plan():
        for f in sub.flat.tolist():
            assert (f // k, f % k) not in out, "a route computed twice"
            out[(f // k, f % k)] = sub.shard
    return out


# -- assignment ------------------------------------------------------------------------------


@pytest.mark.parametrize("replicas", [False, True])
@pytest.mark.parametrize("seed", range(40))
def test_assignment_equals_the_reference(seed: int, replicas: bool) -> None:
    rng = np.random.default_rng(seed + 1000 * replicas)
    experts, shards = int(rng.integers(2, 12)), int(rng.integers(1, 6))
    tokens, k = int(rng.integers(1, 9)), int(rng.integers(1, min(experts, 5) + 1))
    holders = random_holders(rng, experts, shards, replicas)
    core = make_core(holders)
    x, ids, w = random_batch(rng, tokens, k, experts, torch.bfloat16)
    call = _Call(core, 0, x, ids, w, False, "combined")
    up = [bool(u) for u in rng.random(shards) < 0.75]
    for s in range(shards):
        if not up[s]:
            core._counters[s].down_until = time.monotonic() + 60
    outstanding = rng.integers(0, 3, shards).tolist()
    for s, n in enumerate(outstanding):
        core._counters[s].outstanding = n
    if rng.random() < 0.4:
        call.excluded = {int(s) for s in rng.choice(shards, int(rng.integers(1, shards + 1)), replace=False)}
    pending = np.ones((tokens, k), dtype=bool)
    if rng.random() < 0.5:  # a later round: some routes already computed
        pending = rng.random((tokens, k)) < 0.6
        call.parts.append((done_sub(np.flatnonzero(~pending)), torch.empty(0)))
        call.remaining = int(pending.sum())
    start = int(rng.integers(0, 100))
    core._rr = itertools.count(start)
    expected, stuck = reference_assign(holders, ids.numpy(), pending, up, call.excluded, outstanding, start)
    if stuck:
        with pytest.raises(ExpertServiceError) as err:
            call.plan()
        experts_stuck = sorted({int(ids[t, j]) for t, j in stuck})
        held = holders[experts_stuck].any()
        assert err.value.code == (grpc.StatusCode.UNAVAILABLE if held else grpc.StatusCode.NOT_FOUND)
        assert str(experts_stuck) in err.value.message
        return
    assert assignment_of(call) == expected


def test_no_replicas_take_the_owner_fast_path() -> None:
    """One holder per expert: the assignment is ``owner[ids]``, without ranking shards; a down one is still used."""
    holders = np.zeros((16, 4), dtype=bool)
    holders[np.arange(16), np.arange(16) // 4] = True
    lm = sharded._layer_map(holders)
    assert lm.owner is not None and lm.complete and lm.owner.tolist() == (np.arange(16) // 4).tolist()
    core = make_core(holders)

    def no_rank() -> list[int]:
        raise AssertionError("no replicas: nothing to rank")

    core._rank = no_rank  # type: ignore[method-assign]
    core._counters[2].down_until = time.monotonic() + 60  # down, but the only holder of experts 8..11
    rng = np.random.default_rng(0)
    x, ids, w = random_batch(rng, 32, 4, 16, torch.bfloat16)
    call = _Call(core, 0, x, ids, w, False, "combined")
    assert np.array_equal(call._assign(), ids.numpy() // 4)
    assert assignment_of(call) == {(t, j): int(ids[t, j]) // 4 for t in range(32) for j in range(4)}
    call.excluded = {1}  # failed in this call: its experts have no shard left
    with pytest.raises(ExpertServiceError) as err:
        call.plan()
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_replicas_or_missing_experts_leave_the_fast_path() -> None:
    holders = np.eye(4, dtype=bool)
    assert sharded._layer_map(holders).owner is not None
    holders[0, 1] = True
    assert sharded._layer_map(holders).owner is None
    holders = np.eye(4, 3, dtype=bool)  # expert 3 held nowhere
    lm = sharded._layer_map(holders)
    assert lm.owner is not None and lm.owner[3] == -1 and not lm.complete
    assert lm.null_ids == (1, 0, 0)


@pytest.mark.parametrize("seed", range(30))
def test_owned_routes_equal_the_general_assignment(seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts, shards, tokens, k = int(rng.integers(1, 20)), int(rng.integers(1, 6)), int(rng.integers(1, 10)), 0
    k = int(rng.integers(1, min(experts, 6) + 1))
    holders = random_holders(rng, experts, shards, replicas=False)
    owner = sharded._layer_map(holders).owner
    assert owner is not None
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
    pending = rng.random((tokens, k)) < 0.7
    usable = rng.random(shards) < 0.7
    rank = rng.permutation(shards)
    assert np.array_equal(assign_owned_routes(owner, ids, pending, usable), assign_routes(holders, ids, pending, usable, rank))
    assert np.array_equal(assign_owned_routes(owner, ids), assign_routes(holders, ids, None, np.ones(shards, bool), rank))


# -- sub-requests ----------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_subrequests_pack_each_route_once(seed: int) -> None:
    rng = np.random.default_rng(seed)
    experts, shards, tokens, k = 12, 3, 20, 4
    holders = random_holders(rng, experts, shards, replicas=True)
    holders[:, 2] = seed % 2 == 0  # every other case: a shard holding every expert
    holders[:, 0] |= ~holders.any(1)
    nulls = sharded._layer_map(holders).null_ids
    ids = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int32)
    weights = rng.random((tokens, k)).astype(np.float32)
    pending = rng.random((tokens, k)) < 0.7
    assign = assign_routes(holders, ids, pending, np.ones(shards, bool), rng.permutation(shards))
    seen = np.zeros((tokens, k), dtype=int)
    for sub in build_subrequests(assign, ids, weights, nulls):
        t, j = np.divmod(sub.flat, k)
        seen[t, j] += 1
        assert np.all(assign[t, j] == sub.shard)
        valid = sub.valid
        assert np.array_equal(valid.sum(1), sub.counts) and bool(sub.counts.min() >= 1)
        assert np.array_equal(np.repeat(sub.rows, sub.counts), t)  # row by row ...
        assert np.array_equal(sub.ids[valid], ids[t, j]) and np.array_equal(sub.weights[valid], weights[t, j])
        assert np.all(np.diff(j)[np.diff(t) == 0] > 0)  # ... each token's routes packed left in their order
        assert not holders[sub.ids[~valid], sub.shard].any(), "padding must be an expert the shard does not hold"
        assert np.all(sub.weights[~valid] == 0)
        assert sub.ids.dtype == np.int32 and sub.weights.dtype == np.float32
        if nulls[sub.shard] is not None:
            assert sub.ids.shape[1] == k  # one top-k per deployment
        else:
            assert np.all(sub.counts == sub.ids.shape[1])  # one request per route count, no padding
    assert np.array_equal(seen, pending.astype(int))


def test_one_shard_taking_everything_gets_the_callers_arrays() -> None:
    ids = np.array([[0, 1], [1, 0]], dtype=np.int32)
    weights = np.array([[0.5, 0.5], [0.25, 0.75]], dtype=np.float32)
    (sub,) = build_subrequests(np.full((2, 2), 1), ids, weights, [2, None])
    assert sub.whole and sub.shard == 1 and sub.ids is ids and sub.weights is weights
    assert sub.routes == 4 and sub.rows.tolist() == [0, 1]
    # not every route: not whole; shard 1 holds every expert (no null id): one request per route count
    one, two = build_subrequests(np.array([[1, 1], [1, -1]]), ids, weights, [2, None])
    assert not one.whole and one.rows.tolist() == [1] and one.ids.tolist() == [[1]] and one.flat.tolist() == [2]
    assert not two.whole and two.rows.tolist() == [0] and two.ids.tolist() == [[0, 1]] and two.flat.tolist() == [0, 1]
    assert build_subrequests(np.full((0, 2), 0), ids[:0], weights[:0], [2, None]) == []


# -- whole calls through fake shards --------------------------------------------------------------


def fake_shard(holders: np.ndarray, shard: int, route_major: bool) -> Callable[[pb.ForwardRequest], pb.ForwardResponse]:
    """A shard holding ``holders[:, shard]`` whose expert ``e`` maps ``x`` to ``(e + 1) * x``, computed in float32."""

    def answer(request: pb.ForwardRequest) -> pb.ForwardResponse:
        x = decode_tensor(request.hidden_states).float()
        ids = decode_tensor(request.topk_ids)
        w = decode_tensor(request.topk_weights)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        held = torch.from_numpy(holders[:, shard])[ids.long()]
        assert bool((w[~held] == 0).all()), "an expert the shard does not hold, with a weight"
        per_route = torch.where(held, w * (ids + 1), torch.zeros_like(w))  # [T_s, k_s]
        if route_major:
            out = per_route.unsqueeze(-1) * x.unsqueeze(1)
        else:
            out = torch.zeros_like(x)
            for j in range(ids.shape[1]):  # in column order, in float32
                out += per_route[:, j : j + 1] * x
        response = pb.ForwardResponse(request_id=request.request_id)
        encode_tensor(out.to(torch.bfloat16), out=response.output)
        return response

    return answer


def drive(call: _Call, shards: list[Callable[[pb.ForwardRequest], pb.ForwardResponse]], failing: set[int]) -> sharded.ShardedForwardResult:
    """What the clients' forward loop does, with fake shards; those in ``failing`` answer UNAVAILABLE."""
    while not call.done:
        for sub, request in call.plan():
            if sub.shard in failing:
                call.absorb(sub, ExpertServiceError(grpc.StatusCode.UNAVAILABLE, "gone"), INF)
            else:
                call.absorb(sub, shards[sub.shard](request), INF)
        call.end_round(INF)
    return call.result()


@pytest.mark.parametrize("route_major", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_outputs_are_placed_summed_in_float32_and_rounded_once(seed: int, route_major: bool) -> None:
    rng = np.random.default_rng(seed)
    experts, shards, tokens, k = 10, 4, 12, 3
    holders = random_holders(rng, experts, shards, replicas=bool(seed % 2))
    holders[:, 0] |= ~holders.any(1)
    core = make_core(holders)
    x, ids, w = random_batch(rng, tokens, k, experts, torch.bfloat16)
    failing = {int(rng.integers(shards))} if seed % 3 == 0 and bool((holders.sum(1) >= 2).all()) else set()
    call = _Call(core, 0, x, ids, w, False, "route_major" if route_major else "combined")
    result = drive(call, [fake_shard(holders, s, route_major) for s in range(shards)], failing)
    assert result.retries == call.rounds <= 1 and not failing & {core.targets.index(t) for t in result.shards}
    assert result.output.dtype == torch.bfloat16
    per_route = w * (ids + 1)  # exact in float32
    if route_major:  # every route's row from the shard that computed it: one product, one rounding
        expected = (per_route.unsqueeze(-1) * x.float().unsqueeze(1)).to(torch.bfloat16)
        assert torch.equal(result.output.view(torch.int16), expected.view(torch.int16))
        return
    # the shards' bfloat16 partials, summed in float32 in the order they came, rounded once
    acc = torch.zeros(tokens, H)
    for sub, y in call.parts:
        for i, t in enumerate(sub.rows.tolist()):
            acc[t] += y[i].float()
    assert torch.equal(result.output.view(torch.int16), acc.to(torch.bfloat16).view(torch.int16))
    exact = per_route.sum(1, keepdim=True) * x.float()  # every route counted once, with its weight
    torch.testing.assert_close(result.output.float(), exact, rtol=2**-6, atol=0.0)


def test_a_call_one_shard_answers_is_that_answer() -> None:
    holders = np.ones((6, 2), dtype=bool)
    holders[5, 1] = False
    core = make_core(holders)
    rng = np.random.default_rng(3)
    x, ids, w = random_batch(rng, 5, 2, 5, torch.bfloat16)
    call = _Call(core, 0, x, ids, w, False, "combined")
    (sub, request), = call.plan()
    assert sub.whole and decode_tensor(request.hidden_states).shape == (5, H)
    response = fake_shard(holders, sub.shard, False)(request)
    call.absorb(sub, response, INF)
    assert call.done and call.parts[0][1] is call.result().output


def test_weights_of_a_dtype_numpy_lacks_travel_as_given() -> None:
    """bfloat16 weights (a server refuses them: its error is the caller's) are gathered as bits, padding 0.0."""
    holders = np.zeros((4, 2), dtype=bool)
    holders[:2, 0] = holders[2:, 1] = True
    core = make_core(holders)
    ids = torch.tensor([[0, 2], [1, 0]], dtype=torch.int64)
    w = torch.tensor([[0.5, -1.25], [3.0, 0.125]], dtype=torch.bfloat16)
    call = _Call(core, 0, torch.ones(2, H), ids, w, False, "combined")
    requests = {sub.shard: request for sub, request in call.plan()}
    w0 = decode_tensor(requests[0].topk_weights)
    assert w0.dtype == torch.bfloat16 and w0.tolist() == [[0.5, 0.0], [3.0, 0.125]]
    assert decode_tensor(requests[0].topk_ids).tolist() == [[0, 2], [1, 0]]  # 2: shard 0's null id
    assert decode_tensor(requests[1].topk_weights).tolist() == [[-1.25, 0.0]]


def test_bad_ids_are_refused_before_planning() -> None:
    core = make_core(np.eye(4, 2, dtype=bool) | np.eye(4, 2, -2, dtype=bool))
    x = torch.zeros(2, H)
    for bad, shown in ((torch.tensor([[0, 4], [1, 2]]), 4), (torch.tensor([[0, -1], [1, 2]], dtype=torch.int32), -1)):
        with pytest.raises(ExpertServiceError, match=f"expert id {shown} outside the global range") as err:
            _Call(core, 0, x, bad, torch.ones(2, 2), False, "combined")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_malformed_output_is_an_internal_error() -> None:
    core = make_core(np.eye(2, dtype=bool))
    call = _Call(core, 0, torch.ones(3, H), torch.tensor([[0], [1], [0]]), torch.ones(3, 1), False, "combined")
    (sub, _), *_ = call.plan()
    response = pb.ForwardResponse()
    encode_tensor(torch.zeros(sub.rows.size + 1, H, dtype=torch.bfloat16), out=response.output)
    with pytest.raises(ExpertServiceError, match="answered an output of shape") as err:
        call.absorb(sub, response, INF)
    assert err.value.code == grpc.StatusCode.INTERNAL
