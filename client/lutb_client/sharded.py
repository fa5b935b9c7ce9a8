"""Expert-parallel clients: one forward over several expert servers that split a layer's experts.

:class:`ShardedExpertClient` (blocking) and :class:`AsyncShardedExpertClient` (asyncio)
talk to the ``lutb serve`` processes of an expert-parallel deployment (shard checkpoints
made by ``lutb shard``, possibly with some experts, or whole shards, replicated) and
present them as one layer: ``forward`` returns what a single server holding every
expert would return.

How a call is split (the *route assignment*):

1. Each shard's experts per layer come from its ``GetModelInfo``. The shards must agree on
   format, hidden and intermediate size, global expert count, activation, dtype and MXFP8
   scale mode (content hashes differ between shards of one checkpoint, so they are not
   compared).
2. Every ``(token, route)`` pair is assigned to exactly ONE live shard holding its expert,
   so a replicated expert is never counted twice. Per token, the shard that can take the
   most of its routes wins: each route goes to the shard, among those holding its expert,
   that can take the most of the token's (pending) routes (so a token whose experts all live
   on one shard goes to that shard alone, and no other shard is called); ties go to the
   shard with the fewest requests outstanding from this client (round-robin among equals),
   which spreads load over replicas. Without replicas there is nothing to choose: a route
   goes to its expert's one holder.
3. Shard ``s`` gets one request holding only the tokens with a route assigned to it; its
   ``topk_ids``/``topk_weights`` are ``[T_s, k]`` (the call's own top-k, the one every server
   warmed up for) with the token's assigned routes packed left in their original order. A
   token with fewer routes there is padded with an expert id the shard does NOT hold and
   weight 0: the server adds exactly zero for it and computes nothing (spec section 4).
   Only when the shard holds every expert of the layer (so no such id exists: it can only
   happen while retrying part of a token) are its tokens split into one request per route
   count ``c`` instead (``[T_c, c]``), so no route is ever computed twice or wasted. When one
   shard takes a whole call unchanged, the request is the caller's own.
4. Requests go out in parallel. Combined outputs are summed in float32 and rounded to the
   model dtype once (a call answered by one shard returns that shard's output as is);
   route-major rows are placed from the shard that computed them.
5. A shard answering UNAVAILABLE or DEADLINE_EXCEEDED is marked down for ``down_s``
   seconds and its routes are planned again over the remaining shards (replicas); a down
   shard is still used when it is the only holder left. When no shard left holds a
   needed expert, :class:`~lutb_client.errors.ExpertServiceError` names the layer and the
   experts (``UNAVAILABLE`` when their holders failed, ``NOT_FOUND`` when no shard holds
   them). Other errors (bad input) are raised as the shard reported them.
6. Each sub-request carries its shard's ``ModelInfo.content_hash`` as ``expected_content_hash``:
   a shard restarted with another checkpoint (or placement) refuses it with FAILED_PRECONDITION
   instead of adding zero for experts it no longer holds; the call then reads every shard's
   ``ModelInfo`` again (:meth:`refresh`) and is retried once, within its deadline.

Sub-requests travel as messages on one kept-open ``ForwardStream`` per shard
(``transport="stream"``, the default) or as unary ``Forward`` calls (``transport="unary"``);
many calls may run concurrently (threads or tasks). All shards must answer ``GetModelInfo``
when the client connects; :meth:`refresh` asks again.

A call's planning (steps 2-3, and the bookkeeping of step 5) runs on small numpy arrays, not
torch tensors, since it is CPU work paid on every forward (``bench/sharded_client_cpu.py``
measures it).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from concurrent.futures import TimeoutError as FutureTimeoutError
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import grpc
import numpy as np
import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    WIRES,
    AsyncForwardStream,
    ForwardStream,
    _call_timeout,
    _cancelled_by_close,
    _check_timeout,
    build_request,
    channel_opener,
    parse_response,
)
from lutb_client.codec import dtype_name, to_torch_dtype
from lutb_client.errors import ExpertServiceError, status_code
from lutb_client.spread import spread, spread_async

FAILOVER_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
TRANSPORTS = ("stream", "unary")
"""How :class:`AsyncShardedExpertClient` sends sub-requests."""
LANE_MAX_IN_FLIGHT = 1024
"""Sub-requests outstanding on one shard's stream before sending waits."""
"""Status codes after which a shard's routes are retried on replicas."""
CONFIG_FIELDS = (
    "format", "format_version", "hidden_size", "intermediate_size", "num_experts", "activation", "dtype", "mxfp8_scale_mode",
)
"""``ModelInfo`` fields every shard of one deployment must agree on."""
STALE_REFRESH_WAIT_S = 1.0
"""How long the retry of a call that met a stale shard waits, at most, for a shard that is reconnecting to answer
``GetModelInfo`` (half the call's remaining time where that is less); one that has not answered by then is marked down
and keeps its last placement."""
_LATENCY_SAMPLES = 4096


# -- stats ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardStats:
    """One shard's account, since the client was made (or :meth:`reset_stats`).

    ``requests``: sub-requests sent (failed ones included); ``tokens``/``routes``: tokens
    sent and ``(token, route)`` pairs assigned; ``failures``: sub-requests that failed with
    UNAVAILABLE/DEADLINE_EXCEEDED and were retried elsewhere; latencies are of
    successful sub-requests (last 4096), in milliseconds. ``server_*_p50_ms`` are the medians
    of what the shard itself reported in each response's ``timing`` over the same sub-requests
    (queue: waiting for its batch; compute: the batch's experts call; total: receipt to
    response), so ``latency - server_total`` is the transport and the client's own share.
    """

    target: str
    requests: int
    tokens: int
    routes: int
    failures: int
    outstanding: int
    down: bool
    latency_mean_ms: float
    latency_p50_ms: float
    latency_p99_ms: float
    server_queue_p50_ms: float = 0.0
    server_compute_p50_ms: float = 0.0
    server_total_p50_ms: float = 0.0


@dataclass(frozen=True)
class ShardedStats:
    """``calls``: forwards made; ``retries``: failover rounds (routes re-planned after a shard failed)."""

    calls: int
    retries: int
    shards: tuple[ShardStats, ...]

    def by_target(self) -> dict[str, ShardStats]:
        return {s.target: s for s in self.shards}


@dataclass
class _ShardCounters:
    requests: int = 0
    tokens: int = 0
    routes: int = 0
    failures: int = 0
    outstanding: int = 0
    down_until: float = 0.0
    latencies: deque[float] = field(default_factory=lambda: deque(maxlen=_LATENCY_SAMPLES))
    server_us: deque[tuple[int, int, int]] = field(default_factory=lambda: deque(maxlen=_LATENCY_SAMPLES))  # queue, compute, total


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


class ShardedForwardResult(NamedTuple):
    """A forward's output, the shards that computed part of it, and the failover rounds it took."""

    output: torch.Tensor
    shards: tuple[str, ...]
    retries: int


# -- topology ------------------------------------------------------------------------------


@dataclass(frozen=True)
class _LayerMap:
    """One layer's placement, as numpy arrays (planning runs on them, never on torch tensors)."""

    holders: np.ndarray  # bool [E, S]: shard s holds expert e
    null_ids: tuple[int | None, ...]  # per shard: an expert id it does not hold (None if it holds all)
    owner: np.ndarray | None  # int64 [E]: the one shard holding each expert (-1: none); None when an expert has replicas
    complete: bool  # every expert is held by some shard


def _layer_map(holders: np.ndarray) -> _LayerMap:
    """The :class:`_LayerMap` of a bool ``[E, S]`` placement."""
    nulls: list[int | None] = []
    for s in range(holders.shape[1]):
        free = np.flatnonzero(~holders[:, s])
        nulls.append(int(free[0]) if free.size else None)
    held = holders.any(1)
    owner = np.where(held, holders.argmax(1), -1).astype(np.int64) if bool((holders.sum(1) <= 1).all()) else None
    return _LayerMap(holders, tuple(nulls), owner, bool(held.all()))


class _Topology:
    """Which shard holds which experts, checked for one consistent model."""

    def __init__(self, targets: Sequence[str], infos: Sequence[pb.ModelInfo]) -> None:
        first = infos[0]
        for name in CONFIG_FIELDS:
            values = {t: getattr(i, name) for t, i in zip(targets, infos)}
            if len(set(values.values())) > 1:
                shown = ", ".join(f"{t}: {dtype_name(v) if name == 'dtype' else v}" for t, v in values.items())
                raise ExpertServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shards do not serve one model: {name} differs ({shown}); are they shards of different checkpoints?",
                )
        self.hidden_size = int(first.hidden_size)
        self.num_experts = int(first.num_experts)
        self.dtype = to_torch_dtype(first.dtype)
        self.scale_mode = first.mxfp8_scale_mode or "rceil"
        self.shards = len(targets)
        self.hashes = tuple(info.content_hash for info in infos)  # per shard: sent as expected_content_hash
        held: dict[int, np.ndarray] = {}
        for s, info in enumerate(infos):
            for layer in info.layers:
                mask = held.setdefault(layer.layer, np.zeros((self.num_experts, self.shards), dtype=bool))
                ids = [e for e in layer.expert_ids if 0 <= e < self.num_experts]
                mask[ids, s] = True
        self.layers: dict[int, _LayerMap] = {layer: _layer_map(mask) for layer, mask in held.items()}

    def missing_experts(self) -> dict[int, list[int]]:
        return {layer: np.flatnonzero(~m.holders.any(1)).tolist() for layer, m in sorted(self.layers.items())}


# -- planning (numpy code, shared by both clients) -------------------------------------------
#
# A call is planned on small numpy arrays: a torch op on a tiny CPU tensor costs several
# microseconds (and some wake torch's intra-op thread pool), a numpy op about one, and the
# planning takes a few dozen of them per call, so it made the client's CPU the bottleneck of
# expert-parallel serving. Torch tensors are made (``torch.from_numpy``, no copy) only where a
# request is encoded or the outputs are combined.

_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NO_NUMPY = {torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}  # known without a (slow) failed .numpy()
_UNSIGNED = {np.dtype(np.int32): np.uint32, np.dtype(np.int64): np.uint64}


def _cpu(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when it is a CPU tensor outside autograd, else a detached CPU copy."""
    return tensor if tensor.is_cpu and not tensor.requires_grad else tensor.detach().to("cpu")


def _numpy_of(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (no copy); a dtype numpy lacks (bfloat16, float8) as signed ints of its bits."""
    if tensor.dtype not in _NO_NUMPY:
        try:
            return tensor.numpy()
        except TypeError:
            pass
    return tensor.view(_BITS[tensor.element_size()]).numpy()


def _torch_of(array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The ``dtype`` tensor over ``array`` (from :func:`_numpy_of`, or a gather of one), no copy."""
    tensor = torch.from_numpy(array)
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


@dataclass
class _Sub:
    """One request to one shard: its tokens, and where its routes came from (numpy arrays)."""

    shard: int
    rows: np.ndarray  # int64 [T_s]: token indices, ascending
    counts: np.ndarray  # int64 [T_s]: routes of each token computed here: its first counts[i] columns, the rest padding
    ids: np.ndarray  # int [T_s, k_s]: expert ids (the null id on padding), the dtype of the call's ids
    weights: np.ndarray  # [T_s, k_s]: the call's weights (0 on padding), their dtype
    whole: bool  # the caller's request unchanged
    flat: np.ndarray  # int64 [R_s]: ``token * k + route`` of each computed route, row by row, in column order

    @property
    def valid(self) -> np.ndarray:
        """bool ``[T_s, k_s]``: False on padding."""
        return np.arange(self.ids.shape[1]) < self.counts[:, None]

    @property
    def routes(self) -> int:
        """``(token, route)`` pairs this request computes (``R_s``)."""
        return int(self.flat.size)


def assign_routes(
    holders: np.ndarray | torch.Tensor,
    ids: np.ndarray | torch.Tensor,
    pending: np.ndarray | torch.Tensor | None,
    usable: np.ndarray | torch.Tensor | Sequence[bool],
    rank: np.ndarray | torch.Tensor | Sequence[int],
) -> np.ndarray:
    """Assign every pending ``(token, route)`` to one usable shard holding its expert.

    Per token, each pending route goes to the usable shard holding its expert that can take
    the most of the token's pending routes (counted once, before assigning); among equals
    the lowest ``rank``.

    Args:
        holders: bool ``[E, S]``.
        ids: int ``[T, k]`` expert ids in ``[0, E)``.
        pending: bool ``[T, k]``: routes to assign (None: all of them).
        usable: bool ``[S]``: shards that may be used.
        rank: int ``[S]``: preference among equals (lower first), a permutation of ``0..S-1``.

    Returns:
        int64 ``[T, k]`` (numpy): the shard of each pending route, -1 where not pending or
        where no usable shard holds the expert. CPU tensors are accepted for every argument.
    """
    holders, ids = np.asarray(holders, dtype=bool), np.asarray(ids)
    if holders.shape[1] == 0 or ids.size == 0:
        return np.full(ids.shape, -1, dtype=np.int64)
    return _best_shards((holders & np.asarray(usable, dtype=bool)).T, ids, pending, rank)


def _best_shards(
    usable_holders: np.ndarray,
    ids: np.ndarray,
    pending: np.ndarray | torch.Tensor | None,
    rank: np.ndarray | torch.Tensor | Sequence[int],
) -> np.ndarray:
    """:func:`assign_routes` on ``usable_holders`` (bool ``[S, E]``: usable shard s holds expert e)."""
    shards = usable_holders.shape[0]
    # laid out [S, k, T]: the reductions below run over outer axes, vectorized along the tokens
    can = usable_holders[:, ids.T]
    if pending is not None:
        pending = np.asarray(pending, dtype=bool)
        can &= pending.T
    key = can.sum(1) * shards + (shards - np.asarray(rank, dtype=np.int64))[:, None]  # [S, T] >= 1: most routes, then preferred
    assign = (can * key[:, None, :]).argmax(0).T  # [T, k]: the best shard that can take the route (score 0: cannot)
    has = usable_holders.any(0)[ids]  # [T, k]: some usable shard holds the route's expert
    if pending is not None:
        has &= pending
    return np.where(has, assign, -1)


def assign_owned_routes(
    owner: np.ndarray, ids: np.ndarray, pending: np.ndarray | None = None, usable: np.ndarray | None = None
) -> np.ndarray:
    """:func:`assign_routes` for a placement without replicas (every expert on at most one shard): a gather.

    With one candidate per route, the per-token rule has nothing to choose: a route goes to
    its expert's holder if that shard is usable.

    Args:
        owner: int64 ``[E]``: the shard holding each expert, -1 where none does.
        ids: int ``[T, k]`` expert ids in ``[0, E)``.
        pending: bool ``[T, k]``: routes to assign (all when None).
        usable: bool ``[S]``: shards that may be used (all when None).

    Returns:
        int64 ``[T, k]``: the shard of each pending route, -1 where not pending or where its
        expert's holder is not usable or does not exist.
    """
    assign = owner[ids]
    if usable is not None and not bool(np.all(usable)):
        usable_or_none = np.append(np.asarray(usable, dtype=bool), False)  # index -1 (no holder): False
        assign = np.where(usable_or_none[assign], assign, -1)
    if pending is not None:
        assign = np.where(pending, assign, -1)
    return assign


def build_subrequests(
    assign: np.ndarray | torch.Tensor,
    ids: np.ndarray | torch.Tensor,
    weights: np.ndarray | torch.Tensor,
    null_ids: Sequence[int | None],
) -> list[_Sub]:
    """The requests that compute every assigned route once (see the module docstring, step 3).

    Args:
        assign: int ``[T, k]``: the shard of each route, -1 for routes not to compute now.
        ids: int ``[T, k]`` expert ids (the sub-requests keep their dtype).
        weights: ``[T, k]`` router weights, any dtype (padding gets zero bits: 0.0).
        null_ids: per shard (``S`` of them), an expert id it does not hold, None if it holds all.

    Returns:
        One :class:`_Sub` per request, shards ascending. A shard with a null id gets one
        request, each token's routes there packed left in their original order and padded to
        ``k`` columns with the null id and weight 0; a shard holding every expert gets one
        request per route count ``c`` (``k_s = c``, no padding). When one shard takes every
        route, its request is ``whole``: the caller's own ``ids`` and ``weights``.
    """
    assign, ids, weights = np.asarray(assign), np.asarray(ids), np.asarray(weights)
    tokens, k = assign.shape
    shards = len(null_ids)
    if assign.size == 0 or shards == 0:
        return []
    # Group the routes by (shard s, token t) -- group g = s * T + t, unassigned routes (-1) in the
    # groups past the last shard's -- each group's routes in their original order: one stable sort.
    group = ((assign % (shards + 1)) * tokens + np.arange(tokens)[:, None]).ravel()  # [T * k]
    counts = np.bincount(group, minlength=(shards + 1) * tokens)  # routes per group
    ends = np.cumsum(counts)
    shard_ends = ends[tokens - 1:shards * tokens:tokens].tolist()  # after each shard's routes, in sorted order
    routes = shard_ends[-1]
    if routes == tokens * k and shard_ends.count(routes) + shard_ends.count(0) == shards:  # one shard takes all
        return [_Sub(shard_ends.index(routes), np.arange(tokens), np.full(tokens, k), ids, weights, True, np.arange(routes))]
    order = np.argsort(group, kind="stable")[:routes]  # flat route index (t * k + route), by group
    in_group = group[order]
    # each route's place in an [S, T, k] layout: its group's row, packed left
    place = in_group * k + (np.arange(routes) - (ends - counts)[in_group])
    sub_ids = np.repeat(np.array([null or 0 for null in null_ids], dtype=ids.dtype), tokens * k)
    sub_ids[place] = ids.ravel()[order]
    sub_w = np.zeros(shards * tokens * k, dtype=weights.dtype)
    sub_w[place] = weights.ravel()[order]
    counts = counts[:shards * tokens].reshape(shards, tokens)
    sub_ids, sub_w = sub_ids.reshape(shards, tokens, k), sub_w.reshape(shards, tokens, k)
    subs: list[_Sub] = []
    start = 0
    for s, end in enumerate(shard_ends):
        if end == start:
            continue
        rows = counts[s].nonzero()[0]
        row_counts = counts[s, rows]
        if null_ids[s] is not None:
            # padded to the call's own k where a null id exists: the server then always sees one
            # top-k per deployment, the one its CUDA graphs and compiled kernels were made for at
            # start-up (a top-k first met under load costs a graph capture and, since top-k is a
            # kernel constant, Triton compiles of about a second each, per server process)
            subs.append(_Sub(s, rows, row_counts, sub_ids[s].take(rows, 0), sub_w[s].take(rows, 0), False, order[start:end]))
        else:  # the shard holds every expert: nothing to pad with, one request per route count
            mine = order[start:end]
            route_counts = np.repeat(row_counts, row_counts)  # each route's token's count
            for c in np.unique(row_counts).tolist():
                g = rows[row_counts == c]
                subs.append(_Sub(s, g, np.full(g.size, c), sub_ids[s, g, :c], sub_w[s, g, :c], False,
                                 mine[route_counts == c]))
        start = end
    return subs


def _stuck(assign: np.ndarray, pending: np.ndarray | None) -> np.ndarray | None:
    """bool ``[T, k]``: the pending routes ``assign`` left without a shard (-1), or None when there are none."""
    if int(assign.min()) >= 0:  # the common case: one reduction
        return None
    stuck = assign < 0 if pending is None else pending & (assign < 0)
    return stuck if bool(stuck.any()) else None


class _StaleShard(ExpertServiceError):
    """A shard refused a sub-request with FAILED_PRECONDITION (its checkpoint is not the one whose content hash the
    client read when it connected): the placement may be stale; the call refreshes it once and is retried."""


class _Call:
    """The state of one sharded forward: what is left to compute and what has come back.

    ``ids`` (int32 ``[T, k]``) and ``weights_np`` (``[T, k]``, the caller's dtype, as bits
    where numpy lacks it) are numpy views (or converted copies) of the caller's tensors.
    """

    def __init__(self, core: _ShardedCore, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 apply_router_weight_on_input: bool, output_mode: str) -> None:
        topo = core._topology
        if layer not in topo.layers:
            raise ExpertServiceError(
                grpc.StatusCode.NOT_FOUND, f"layer {layer} is not held by any shard; the shards hold layers {sorted(topo.layers)}")
        if output_mode not in ("combined", "route_major"):
            raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"output_mode: {output_mode!r} is not combined or route_major")
        x_shape, ids_shape = x.shape, ids.shape
        if len(x_shape) != 2 or x_shape[1] != topo.hidden_size:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"hidden_states: shape {list(x_shape)} does not match [T, {topo.hidden_size}]")
        if ids.dtype not in (torch.int32, torch.int64) or len(ids_shape) != 2 or ids_shape[0] != x_shape[0] or ids_shape[1] < 1:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"topk_ids: {ids.dtype} shape {list(ids_shape)} is not int32/int64 [T, k] with T = {x_shape[0]} and k >= 1")
        if weights.shape != ids_shape:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"topk_weights: shape {list(weights.shape)} does not match topk_ids shape {list(ids_shape)}")
        ids_np = _cpu(ids).numpy()
        # one reduction: a negative id, seen unsigned, is out of range too
        if ids_np.size and int(ids_np.view(_UNSIGNED[ids_np.dtype]).max()) >= topo.num_experts:
            low, high = int(ids_np.min()), int(ids_np.max())
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"topk_ids: expert id {low if low < 0 else high} outside the global range [0, {topo.num_experts})")
        self.core = core
        self.layer = layer
        self.map = topo.layers[layer]
        self.hashes = topo.hashes
        self.dtype = topo.dtype
        self.x = _cpu(x)
        if self.x.dtype in (torch.bfloat16, torch.float16, torch.float32) and self.x.dtype != self.dtype:
            self.x = self.x.to(self.dtype)  # what the server does first; less to send
        self.mxfp8: tuple[torch.Tensor, torch.Tensor] | None = None  # (e4m3 codes as uint8, E8M0 scales)
        if core.wire == "mxfp8":  # quantized once; each shard gets the rows of its tokens
            from lutb_kernels.mxfp8 import mxfp8_quantize

            try:
                q, scales = mxfp8_quantize(self.x.to(self.dtype), topo.scale_mode)  # type: ignore[arg-type]
            except ValueError as exc:
                raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"hidden_states: {exc}") from None
            self.mxfp8 = (q.view(torch.uint8), scales)
        self.ids = ids_np.astype(np.int32, copy=False)  # in [0, E): the wire's dtype
        self.weights = _cpu(weights)  # sent as given when one shard takes the whole call
        self.weights_np = _numpy_of(self.weights)
        self.kw = {"apply_router_weight_on_input": apply_router_weight_on_input, "output_mode": output_mode}
        self.route_major = output_mode == "route_major"
        self.remaining = int(ids_np.size)  # routes not computed yet
        self.excluded: set[int] = set()
        self.failed: dict[int, str] = {}
        self.parts: list[tuple[_Sub, torch.Tensor]] = []
        self.rounds = 0
        self.used: set[int] = set()

    @property
    def done(self) -> bool:
        return self.remaining == 0

    @property
    def pending(self) -> np.ndarray:
        """bool ``[T, k]``: the routes not computed yet."""
        pending = np.ones(self.ids.shape, dtype=bool)
        flat = pending.ravel()
        for sub, _ in self.parts:
            flat[sub.flat] = False
        return pending

    def _assign(self) -> np.ndarray:
        """The shard of every pending route (int64 ``[T, k]``, -1 elsewhere); raises when one has no shard left."""
        m = self.map
        pending = self.pending if self.parts else None  # None: every route (the first round, or all failed)
        if m.owner is not None and m.complete and pending is None and not self.excluded:
            return m.owner[self.ids]  # the common case: no replicas, first round
        not_excluded = [s not in self.excluded for s in range(m.holders.shape[1])]
        if m.owner is not None:
            # one holder per expert: nothing to choose, and a down holder would be used anyway (it is the only one)
            assign = assign_owned_routes(m.owner, self.ids, pending, np.array(not_excluded))
        else:
            rank = self.core._rank()
            up = [u and n for u, n in zip(self.core._up_mask(), not_excluded)]
            assign = assign_routes(m.holders, self.ids, pending, up, rank)
            stuck = _stuck(assign, pending)
            if stuck is not None:  # holders marked down may have recovered: better than failing
                assign = np.where(stuck, assign_routes(m.holders, self.ids, stuck, not_excluded, rank), assign)
        stuck = _stuck(assign, pending)
        if stuck is not None:
            raise self._missing(sorted(set(self.ids[stuck].tolist())))
        return assign

    def plan(self) -> list[tuple[_Sub, pb.ForwardRequest]]:
        """The next round of sub-requests (raises when a pending expert has no shard left)."""
        subs = build_subrequests(self._assign(), self.ids, self.weights_np, self.map.null_ids)
        tokens = self.ids.shape[0]
        out = []
        for sub in subs:
            scales = None
            if sub.whole:
                ids, weights = torch.from_numpy(self.ids), self.weights
            else:
                ids, weights = torch.from_numpy(sub.ids), _torch_of(sub.weights, self.weights.dtype)
            every = sub.rows.size == tokens  # rows are ascending and distinct: every token, in order
            if self.mxfp8 is not None:
                q, scales = self.mxfp8
                if not every:
                    rows = torch.from_numpy(sub.rows)
                    q, scales = q.index_select(0, rows), scales.index_select(0, rows)
                x = q.view(torch.float8_e4m3fn)
            else:
                x = self.x if every else self.x.index_select(0, torch.from_numpy(sub.rows))
            request = build_request(
                self.layer, x, ids, weights, request_id=next(self.core._ids), hidden_scales=scales, **self.kw)
            request.expected_content_hash = self.hashes[sub.shard]  # a restarted shard serving another checkpoint refuses it
            out.append((sub, request))
        return out

    def _missing(self, experts: list[int]) -> ExpertServiceError:
        targets = self.core.targets
        holders = self.map.holders[experts]
        if not bool(holders.any()):
            return ExpertServiceError(
                grpc.StatusCode.NOT_FOUND, f"layer {self.layer}: no shard holds expert(s) {experts} (shards: {', '.join(targets)})")
        failed = "; ".join(f"{targets[s]}: {why}" for s, why in sorted(self.failed.items())) or "none answered"
        return ExpertServiceError(
            grpc.StatusCode.UNAVAILABLE, f"layer {self.layer}: no live shard holds expert(s) {experts} (failed: {failed})")

    def absorb(self, sub: _Sub, result: Any, deadline: float) -> None:
        """Take a sub-request's outcome: a response, or an ``ExpertServiceError``."""
        if isinstance(result, ExpertServiceError):
            if result.code == grpc.StatusCode.FAILED_PRECONDITION and self.hashes[sub.shard]:
                raise _StaleShard(result.code, f"layer {self.layer}: shard {self.core.targets[sub.shard]}: {result.message}",
                                  result.request_id)
            if result.code not in FAILOVER_CODES:
                raise result
            if result.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= deadline:
                # the call's own deadline, not a slow shard: nothing to retry, nobody to blame
                raise ExpertServiceError(result.code, f"layer {self.layer}: deadline passed waiting for shard "
                                         f"{self.core.targets[sub.shard]}: {result.message}")
            self.core._mark_down(sub.shard)
            self.excluded.add(sub.shard)
            self.failed[sub.shard] = f"{result.code.name}: {result.message}"
            return
        output = parse_response(result).output
        rows, width = sub.ids.shape
        hidden = self.x.shape[1]
        if output.shape != ((rows, width, hidden) if self.route_major else (rows, hidden)):
            raise ExpertServiceError(
                grpc.StatusCode.INTERNAL, f"layer {self.layer}: shard {self.core.targets[sub.shard]} answered an output of "
                f"shape {list(output.shape)} to a request of {rows} tokens and top-{width}", result.request_id)
        self.parts.append((sub, output))
        self.used.add(sub.shard)
        self.remaining -= sub.routes

    def end_round(self, deadline: float) -> None:
        if not self.done:
            self.rounds += 1
            self.core._count_retry()
            if time.monotonic() >= deadline:
                raise ExpertServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"layer {self.layer}: deadline passed while retrying on replicas "
                    f"(failed: {'; '.join(f'{self.core.targets[s]}: {w}' for s, w in sorted(self.failed.items()))})")

    def result(self) -> ShardedForwardResult:
        """The combined ``[T, H]`` or route-major ``[T, k, H]`` output, in the model dtype."""
        tokens, k = self.ids.shape
        hidden = self.x.shape[1]
        shards = tuple(self.core.targets[s] for s in sorted(self.used))
        if len(self.parts) == 1 and self.parts[0][0].whole:  # one shard's answer, as is
            y = self.parts[0][1]
            return ShardedForwardResult(y.to(self.dtype) if self.route_major else y, shards, self.rounds)
        if self.route_major:  # each computed row placed once: no sum, no rounding
            out = torch.zeros(tokens, k, hidden, dtype=self.dtype)
            placed = out.view(tokens * k, hidden)
            for sub, y in self.parts:
                src = y.reshape(-1, hidden)
                if sub.routes != src.shape[0]:  # drop the padding columns' rows
                    src = src.index_select(0, torch.from_numpy(np.flatnonzero(sub.valid)))
                placed.index_copy_(0, torch.from_numpy(sub.flat), src.to(self.dtype))
            return ShardedForwardResult(out, shards, self.rounds)
        acc = torch.zeros(tokens, hidden, dtype=torch.float32)
        for sub, y in self.parts:
            if sub.rows.size == tokens:  # every token, in order
                acc.add_(y)  # in float32 (type promotion), without a float32 copy of y
            else:
                acc.index_add_(0, torch.from_numpy(sub.rows), y.to(torch.float32))
        return ShardedForwardResult(acc.to(self.dtype), shards, self.rounds)


# -- shared core ---------------------------------------------------------------------------


class _ShardedCore:
    _stream_class: ClassVar[type]
    """The stream type of a lane (``ForwardStream`` or ``AsyncForwardStream``)."""

    def __init__(self, targets: Sequence[str], timeout: float, attempt_timeout: float | None, down_s: float,
                 wire: str, transport: str, connections: int = 1, connect_timeout: float = 30.0) -> None:
        if wire not in WIRES:
            raise ValueError(f"wire must be one of {', '.join(WIRES)}, got {wire!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")
        self.wire = wire
        self.transport = transport
        targets = list(targets)
        if not targets:
            raise ValueError("ShardedExpertClient needs at least one target")
        if len(set(targets)) != len(targets):
            raise ValueError(f"duplicate targets in {targets}")
        self.targets = targets
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.connections = connections
        self._lanes: list[list[Any]] = [[None] * connections for _ in targets]
        """Per shard, per connection: its open stream (transport "stream")."""
        self._turns = [itertools.count() for _ in targets]  # per shard: which connection the next sub-request takes
        self._lanes_lock = threading.Lock()
        self._channels: list[list[Any]] = []  # per shard, per connection (made by the subclass)
        self._stubs: list[list[pb_grpc.ExpertServiceStub]] = []
        self.timeout = _check_timeout(timeout)  # the plain clients' rule: a positive finite number of seconds
        self.attempt_timeout = None if attempt_timeout is None else _check_timeout(attempt_timeout, "attempt_timeout")
        self.connect_timeout = _check_timeout(connect_timeout, "connect_timeout")
        self.down_s = down_s
        self._lock = threading.Lock()
        self._counters = [_ShardCounters() for _ in targets]
        self._calls = 0
        self._retries = 0
        self._rr = itertools.count()
        self._ids = itertools.count(1)
        self._topology: _Topology | None = None
        self.infos: tuple[pb.ModelInfo, ...] = ()
        self._closed = False

    def _check_open(self) -> None:
        """Raises FAILED_PRECONDITION (:class:`ExpertServiceError`) once :meth:`close` was called."""
        if self._closed:
            raise ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, "the client is closed")

    # topology -----------------------------------------------------------------------------

    def _set_infos(self, infos: Sequence[pb.ModelInfo]) -> None:
        self._topology = _Topology(self.targets, infos)
        self.infos = tuple(infos)

    def _set_all_infos(self, answers: Sequence[pb.ModelInfo | ExpertServiceError]) -> None:
        """The placement from every shard's ``ModelInfo`` (:meth:`refresh`).

        Raises:
            ExpertServiceError: a shard did not answer (the first such shard's error, its target named).
        """
        for answer in answers:
            if isinstance(answer, ExpertServiceError):
                raise answer
        self._set_infos(answers)  # type: ignore[arg-type]

    def _set_answered_infos(self, answers: Sequence[pb.ModelInfo | ExpertServiceError]) -> None:
        """The placement from the shards that answered ``GetModelInfo`` (a stale shard's retry): a shard that did not
        keeps its last ``ModelInfo`` and is marked down, so that the retry goes to replicas instead of failing the
        call on a shard unrelated to the stale one (a rolling restart takes them down one after another).

        Raises:
            ExpertServiceError: no shard answered (the first one's error).
        """
        if all(isinstance(a, ExpertServiceError) for a in answers):
            raise next(a for a in answers if isinstance(a, ExpertServiceError))
        infos = [info if isinstance(a, ExpertServiceError) else a for a, info in zip(answers, self.infos)]
        self._set_infos(infos)
        for shard, answer in enumerate(answers):
            if isinstance(answer, ExpertServiceError):
                self._mark_down(shard)

    @property
    def hidden_size(self) -> int:
        return self._topo().hidden_size

    @property
    def num_experts(self) -> int:
        return self._topo().num_experts

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype (outputs come back in it)."""
        return self._topo().dtype

    @property
    def layers(self) -> list[int]:
        """Layers held by at least one shard."""
        return sorted(self._topo().layers)

    def placement(self) -> dict[int, dict[int, list[str]]]:
        """``{layer: {expert: [targets holding it]}}`` for every expert held somewhere."""
        out: dict[int, dict[int, list[str]]] = {}
        for layer, m in sorted(self._topo().layers.items()):
            out[layer] = {
                e: [self.targets[s] for s in np.flatnonzero(m.holders[e]).tolist()]
                for e in range(m.holders.shape[0]) if bool(m.holders[e].any())
            }
        return out

    def missing_experts(self) -> dict[int, list[int]]:
        """``{layer: [experts no shard holds]}`` (empty lists when the deployment is complete)."""
        return self._topo().missing_experts()

    def _topo(self) -> _Topology:
        if self._topology is None:
            raise ExpertServiceError(grpc.StatusCode.FAILED_PRECONDITION, "not connected: call connect() first")
        return self._topology

    # bookkeeping --------------------------------------------------------------------------

    def _up_mask(self) -> list[bool]:
        """Per shard: not marked down."""
        now = time.monotonic()
        with self._lock:
            return [c.down_until <= now for c in self._counters]

    def _rank(self) -> list[int]:
        """Shards by outstanding requests, ties broken round-robin: ``rank[s]`` (0 = preferred)."""
        n = len(self.targets)
        start = next(self._rr) % n
        with self._lock:
            outstanding = [c.outstanding for c in self._counters]
        rank = [0] * n
        for i, s in enumerate(sorted(range(n), key=lambda s: (outstanding[s], (s - start) % n))):
            rank[s] = i
        return rank

    def _mark_down(self, shard: int) -> None:
        with self._lock:
            c = self._counters[shard]
            c.failures += 1
            c.down_until = time.monotonic() + self.down_s

    def _count_retry(self) -> None:
        with self._lock:
            self._retries += 1

    def _count_call(self) -> None:
        with self._lock:
            self._calls += 1

    def _sent(self, sub: _Sub) -> float:
        with self._lock:
            c = self._counters[sub.shard]
            c.requests += 1
            c.outstanding += 1
            c.tokens += int(sub.rows.size)
            c.routes += sub.routes
        return time.perf_counter()

    def _answered(self, shard: int, started: float, response: Any) -> None:
        """Book a finished sub-request; ``response`` is the ForwardResponse, or None when it failed."""
        with self._lock:
            c = self._counters[shard]
            c.outstanding -= 1
            if response is not None:
                c.latencies.append(time.perf_counter() - started)
                t = response.timing
                c.server_us.append((t.queue_us, t.compute_us, t.total_us))
                c.down_until = 0.0

    # -- lanes (transport "stream") ----------------------------------------------------------

    def _open_stubs(self) -> None:
        """Stubs of the channels as they are now (after spreading them)."""
        self._stubs = [[pb_grpc.ExpertServiceStub(c) for c in channels] for channels in self._channels]

    def _turn(self, shard: int) -> int:
        """The connection to ``shard`` that the next sub-request takes (they take them in turn)."""
        return next(self._turns[shard]) % self.connections

    def _unary_stub(self, shard: int) -> pb_grpc.ExpertServiceStub:
        self._check_open()
        return self._stubs[shard][self._turn(shard)]

    def _lane(self, shard: int) -> Any:
        """The next of the shard's open streams, (re)opened when missing or broken (any thread, or the event loop)."""
        with self._lanes_lock:
            self._check_open()
            k = self._turn(shard)
            lane = self._lanes[shard][k]
            if lane is None or lane.broken:
                if lane is not None:
                    lane.cancel()
                try:
                    lane = self._lanes[shard][k] = self._stream_class(
                        self._stubs[shard][k], timeout=None, max_in_flight=LANE_MAX_IN_FLIGHT, ids=self._ids)
                except (ValueError, grpc.aio.UsageError):  # grpc's closed channel: closed by another thread meanwhile
                    self._check_open()
                    raise
            return lane

    def _drop_lane(self, shard: int, lane: Any) -> None:
        """Cancel ``lane`` if it is still one of the shard's: a shard that let an attempt time out gets a fresh stream
        next time, so unanswered messages cannot pile up on a stuck one (their slots are bounded)."""
        with self._lanes_lock:
            lanes = self._lanes[shard]
            for k, open_lane in enumerate(lanes):
                if open_lane is lane:
                    lanes[k] = None
                    lane.cancel()

    def _cancel_lanes(self) -> None:
        with self._lanes_lock:
            for lanes in self._lanes:
                for lane in lanes:
                    if lane is not None:
                        lane.cancel()
            self._lanes = [[None] * self.connections for _ in self._lanes]

    def _lane_broke(self, shard: int, err: ExpertServiceError) -> ExpertServiceError:
        """A broken stream's error as a sub-request outcome: the shard is unreachable as far as this call goes."""
        code = err.code if err.code in FAILOVER_CODES else grpc.StatusCode.UNAVAILABLE
        return ExpertServiceError(code, f"stream to {self.targets[shard]} broke: {err.code.name}: {err.message}")

    def _attempt_timeout(self, deadline: float) -> float:
        remaining = max(deadline - time.monotonic(), 0.0)
        return remaining if self.attempt_timeout is None else min(remaining, self.attempt_timeout)

    def stats(self) -> ShardedStats:
        """Per-shard requests, tokens, failures (retried elsewhere), outstanding, latency; calls and retry rounds."""
        now = time.monotonic()
        with self._lock:
            shards = tuple(
                ShardStats(
                    target=t, requests=c.requests, tokens=c.tokens, routes=c.routes, failures=c.failures,
                    outstanding=c.outstanding, down=c.down_until > now,
                    latency_mean_ms=1e3 * sum(c.latencies) / len(c.latencies) if c.latencies else 0.0,
                    latency_p50_ms=1e3 * _percentile(list(c.latencies), 0.5),
                    latency_p99_ms=1e3 * _percentile(list(c.latencies), 0.99),
                    server_queue_p50_ms=1e-3 * _percentile([q for q, _, _ in c.server_us], 0.5),
                    server_compute_p50_ms=1e-3 * _percentile([m for _, m, _ in c.server_us], 0.5),
                    server_total_p50_ms=1e-3 * _percentile([t for _, _, t in c.server_us], 0.5),
                )
                for t, c in zip(self.targets, self._counters)
            )
            return ShardedStats(self._calls, self._retries, shards)

    def reset_stats(self) -> None:
        """Zero the counters (outstanding requests and down marks are kept)."""
        with self._lock:
            self._calls = self._retries = 0
            for c in self._counters:
                c.requests = c.tokens = c.routes = c.failures = 0
                c.latencies.clear()
                c.server_us.clear()


def _message_outcome(answer: pb.ForwardResponse) -> Any:
    """A stream message's answer as a sub-request outcome: the response, or its status as an error."""
    if answer.status.code != 0:
        return ExpertServiceError(status_code(answer.status.code), answer.status.message, answer.request_id)
    return answer


def _remaining(deadline: float) -> float:
    """Seconds left until ``deadline``; DEADLINE_EXCEEDED when none are."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise ExpertServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before the shards' placement was read again")
    return remaining


def _info_error(target: str, err: grpc.RpcError) -> ExpertServiceError:
    error = ExpertServiceError.from_rpc_error(err)
    return ExpertServiceError(error.code, f"shard {target}: GetModelInfo failed: {error.message}")


# -- blocking client -----------------------------------------------------------------------


class ShardedExpertClient(_ShardedCore):
    """Blocking client of an expert-parallel deployment: several servers, one layer.

    Args:
        targets: ``host:port`` of every shard server (replicas included), distinct.
        timeout: default deadline of a forward in seconds, failovers included.
        attempt_timeout: deadline of one request to one shard (default: what is left of ``timeout``);
            a shard exceeding it is treated as failed and its routes go to a replica.
        down_s: how long a failed shard is avoided (it is still used when it is the only holder left).
        connect_timeout: how long to wait for every shard's ``GetModelInfo``.
        credentials, max_message_bytes, channel_options: as for :class:`~lutb_client.ExpertClient`.
        wire: ``"native"`` (hidden states in the model dtype) or ``"mxfp8"``: quantized once per
            forward with the deployment's scale mode, each shard sent the e4m3 codes and E8M0
            scales of its tokens (about half the bytes; the same result as sending the
            dequantized values, as for :class:`~lutb_client.ExpertClient`).
        transport: ``"stream"`` (default): one ``ForwardStream`` per shard, kept open, each
            sub-request a message on it (reopened after it breaks; a per-message error status
            fails only that sub-request, UNAVAILABLE ones over to replicas as usual; a shard
            that lets an attempt time out gets a fresh stream next time, and the late answer is
            dropped). ``"unary"``: one ``Forward`` call
            per sub-request. A message on an open stream costs the server and gRPC less than a
            unary call (bench/results/2026-12-02-serving-3-h200.md); but a stream answers in
            order, so a small call waits for a large one sent before it on the same shard: a
            process mixing prefill-sized and decode-sized forwards should use one client each,
            or ``"unary"``.
        connections: TCP connections to each shard, evened out over its front ends (``lutb serve
            --front-ends N``: :mod:`lutb_client.spread`) when connecting; sub-requests to a shard take
            them in turn, each connection its own stream. Give each shard at least as many as its
            server has front ends, or one client uses one front end per shard.

    Raises:
        ExpertServiceError: a shard did not answer ``GetModelInfo`` (its target named), or the
            shards do not serve one model (``FAILED_PRECONDITION``, naming the field).
        ValueError: ``timeout``, ``attempt_timeout`` (when given) or ``connect_timeout`` not a positive finite
            number of seconds (as for :class:`~lutb_client.ExpertClient`; the error names which), or another bad
            argument, before any channel opens.
    """

    _stream_class: ClassVar[type] = ForwardStream

    def __init__(
        self,
        targets: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        attempt_timeout: float | None = None,
        down_s: float = 2.0,
        connect_timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
        wire: str = "native",
        transport: str = "stream",
        connections: int = 1,
    ) -> None:
        super().__init__(targets, timeout, attempt_timeout, down_s, wire, transport, connections, connect_timeout)
        self._openers = [channel_opener(t, connections, aio=False, credentials=credentials, max_message_bytes=max_message_bytes,
                                        channel_options=channel_options) for t in self.targets]
        self._channels = [[opener() for _ in range(connections)] for opener in self._openers]
        self._open_stubs()
        try:
            deadline = time.monotonic() + self.connect_timeout  # one deadline for the ModelInfo round and the spread
            self.refresh(timeout=self.connect_timeout)
            if connections > 1:
                for target, channels, opener in zip(self.targets, self._channels, self._openers):
                    try:
                        spread(channels, opener, timeout=max(deadline - time.monotonic(), 0.0))
                    except grpc.RpcError as err:
                        raise _info_error(target, err) from None
                self._open_stubs()
        except BaseException:
            self.close()
            raise

    def _on_done(self, sub: _Sub, started: float) -> Any:
        def done(future: Any) -> None:
            ok = not future.cancelled() and future.exception() is None
            self._answered(sub.shard, started, future.result() if ok else None)

        return done

    def _stream_send(self, sub: _Sub, request: pb.ForwardRequest, attempt_end: float) -> tuple[float, Any, Any]:
        """Send one sub-request on the shard's lane, waiting for room on it until ``attempt_end``: ``(started, lane,
        future or the error)``. A lane with no room by then (its answers stopped coming) is dropped."""
        lane = self._lane(sub.shard)  # before booking the send: raises once the client is closed
        started = self._sent(sub)
        try:
            return started, lane, lane.send(request, timeout=max(attempt_end - time.monotonic(), 0.0))
        except ExpertServiceError as err:
            if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._drop_lane(sub.shard, lane)
            return started, lane, err

    def _stream_result(self, sub: _Sub, started: float, lane: Any, sent: Any, attempt_end: float, deadline: float) -> Any:
        """Wait for a lane's answer until ``attempt_end``: the response or an ``ExpertServiceError`` (booked in stats)."""
        response = None
        try:
            if isinstance(sent, ExpertServiceError):
                raise sent
            outcome = _message_outcome(sent.result(timeout=max(attempt_end - time.monotonic(), 0.0)))
            if not isinstance(outcome, ExpertServiceError):
                response = outcome
            return outcome
        except FutureTimeoutError:
            if time.monotonic() < deadline:  # the shard's attempt timed out, not the call
                self._drop_lane(sub.shard, lane)
            return ExpertServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, "no answer within the attempt's deadline")
        except ExpertServiceError as err:
            self._check_open()  # closed meanwhile: that, not a broken lane (nor a down shard)
            return self._lane_broke(sub.shard, err)
        finally:
            self._answered(sub.shard, started, response)

    def refresh(self, *, timeout: float = 30.0) -> None:
        """Ask every shard for its ``ModelInfo`` again (all in parallel) and rebuild the placement.

        Raises:
            ExpertServiceError: a shard did not answer (its target named); INVALID_ARGUMENT naming ``timeout``
                when it is not a positive finite number of seconds (None: no deadline), before any call.
        """
        self._set_all_infos(self._ask_all(_call_timeout(timeout)))

    def _refresh_answering(self, timeout: float) -> None:
        """:meth:`refresh` from the shards that answer within :data:`STALE_REFRESH_WAIT_S` (at most half of
        ``timeout``): :meth:`_set_answered_infos`."""
        self._set_answered_infos(self._ask_all(min(STALE_REFRESH_WAIT_S, timeout / 2)))

    def _ask_all(self, timeout: float | None) -> list[pb.ModelInfo | ExpertServiceError]:
        """Every shard's ``ModelInfo``, asked in parallel (waiting for a shard that is reconnecting), or the error it
        ended with within ``timeout`` seconds."""
        futures = [stubs[0].GetModelInfo.future(pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)
                   for stubs in self._stubs]
        answers: list[pb.ModelInfo | ExpertServiceError] = []
        for target, future in zip(self.targets, futures):
            try:
                answers.append(future.result())
            except grpc.RpcError as err:
                answers.append(_info_error(target, err))
        return answers

    def close(self) -> None:
        """Close the streams and connections; calls made afterwards fail with FAILED_PRECONDITION."""
        self._closed = True
        self._cancel_lanes()
        for channels in self._channels:
            for channel in channels:
                channel.close()

    def __enter__(self) -> ShardedExpertClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def forward_detailed(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> ShardedForwardResult:
        """:meth:`forward`, also returning the shards that computed it and the failover rounds."""
        timeout = _call_timeout(timeout)  # before anything is sent: INVALID_ARGUMENT naming timeout
        self._check_open()
        args = (layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        call = _Call(self, *args)
        self._count_call()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        try:
            return self._run(call, deadline)
        except _StaleShard:  # a shard restarted with another checkpoint: read the placement again, retry once
            self._refresh_answering(_remaining(deadline))
            self._count_retry()
            return self._run(_Call(self, *args), deadline)

    def _run(self, call: _Call, deadline: float) -> ShardedForwardResult:
        """Compute ``call`` by ``deadline``, failing over to replicas."""
        while not call.done:
            round_ = call.plan()
            attempt = self._attempt_timeout(deadline)
            if self.transport == "stream":
                attempt_end = time.monotonic() + attempt
                lanes: deque[tuple[_Sub, float, Any, Any]] = deque()
                try:
                    for sub, request in round_:
                        lanes.append((sub, *self._stream_send(sub, request, attempt_end)))
                    while lanes:
                        sub, started, lane, sent_on = lanes.popleft()
                        call.absorb(sub, self._stream_result(sub, started, lane, sent_on, attempt_end, deadline), deadline)
                except BaseException:  # the call failed: book the answers not read, or their shards stay "outstanding"
                    for sub, started, _, _ in lanes:
                        self._answered(sub.shard, started, None)
                    raise
                call.end_round(deadline)
                continue
            sent = []
            try:
                for sub, request in round_:
                    try:
                        future = self._unary_stub(sub.shard).Forward.future(request, timeout=attempt)
                    except ValueError:  # grpc's closed channel: closed by another thread meanwhile
                        self._check_open()
                        raise
                    future.add_done_callback(self._on_done(sub, self._sent(sub)))
                    sent.append((sub, future))
                for sub, future in sent:
                    try:
                        response: Any = future.result()
                    except grpc.RpcError as err:
                        self._check_open()  # cancelled by close(): report the close
                        response = ExpertServiceError.from_rpc_error(err)
                    except grpc.FutureCancelledError:
                        self._check_open()
                        raise
                    call.absorb(sub, response, deadline)
            except BaseException:
                for _, future in sent:
                    future.cancel()
                raise
            call.end_round(deadline)
        return call.result()

    def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Run ``layer``'s experts, spread over the shards, on a routed batch.

        Arguments and result as for :meth:`lutb_client.ExpertClient.forward`: ``[T, H]``
        (combined) or ``[T, k, H]`` (route-major) in the model dtype, equal to what one
        server holding every expert returns (within spec section 6; a call one shard
        answers alone is bit-identical).

        Raises:
            ExpertServiceError: bad input (``INVALID_ARGUMENT``; a ``timeout`` not None nor a positive
                finite number of seconds, before any shard is called), a layer or expert no shard
                holds (``NOT_FOUND``), every holder of a needed expert failed (``UNAVAILABLE``),
                the deadline passed, a shard still refused the call's content hash after the placement was
                read again (``FAILED_PRECONDITION``), or a shard's own error.
        """
        return self.forward_detailed(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, timeout=timeout,
        ).output


# -- asyncio client ------------------------------------------------------------------------


class AsyncShardedExpertClient(_ShardedCore):
    """asyncio twin of :class:`ShardedExpertClient` (same arguments).

    ``async with AsyncShardedExpertClient(targets) as client: await client.forward(...)``;
    entering connects (asks every shard for its ``ModelInfo``); so does the first forward.
    """

    _stream_class: ClassVar[type] = AsyncForwardStream

    def __init__(
        self,
        targets: Sequence[str],
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        attempt_timeout: float | None = None,
        down_s: float = 2.0,
        connect_timeout: float = 30.0,
        credentials: grpc.ChannelCredentials | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        channel_options: Sequence[tuple[str, Any]] = (),
        wire: str = "native",
        transport: str = "stream",
        connections: int = 1,
    ) -> None:
        super().__init__(targets, timeout, attempt_timeout, down_s, wire, transport, connections, connect_timeout)
        self._openers = [channel_opener(t, connections, aio=True, credentials=credentials, max_message_bytes=max_message_bytes,
                                        channel_options=channel_options) for t in self.targets]
        self._channels = [[opener() for _ in range(connections)] for opener in self._openers]
        self._open_stubs()
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Ask the shards for their ``ModelInfo`` and spread the connections to each over its front ends, unless
        already done. A failed attempt leaves the client unconnected (the next one starts over)."""
        await self._connect(self.connect_timeout)

    async def _connect(self, timeout: float) -> None:
        """:meth:`connect` within ``timeout`` seconds (at most ``connect_timeout``)."""
        async with self._connect_lock:
            if self._topology is None:
                deadline = time.monotonic() + timeout
                try:
                    await self.refresh(timeout=timeout)
                    if self.connections > 1:
                        for target, channels, opener in zip(self.targets, self._channels, self._openers):
                            try:
                                await spread_async(channels, opener, timeout=max(deadline - time.monotonic(), 0.0))
                            except grpc.RpcError as err:
                                raise _info_error(target, err) from None
                except BaseException:
                    self._topology = None  # not connected: the next connect() asks and spreads again
                    raise
                finally:
                    self._open_stubs()  # the channels as they are now: a spread closes those it replaced

    async def refresh(self, *, timeout: float = 30.0) -> None:
        """Ask every shard for its ``ModelInfo`` again and rebuild the placement (``timeout`` as for
        :meth:`ShardedExpertClient.refresh`)."""
        self._set_all_infos(await self._ask_all(_call_timeout(timeout)))

    async def _refresh_answering(self, timeout: float) -> None:
        """:meth:`ShardedExpertClient._refresh_answering`."""
        self._set_answered_infos(await self._ask_all(min(STALE_REFRESH_WAIT_S, timeout / 2)))

    async def _ask_all(self, timeout: float | None) -> list[pb.ModelInfo | ExpertServiceError]:
        """:meth:`ShardedExpertClient._ask_all`."""

        async def one(target: str, stub: pb_grpc.ExpertServiceStub) -> pb.ModelInfo | ExpertServiceError:
            try:
                return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)
            except grpc.RpcError as err:
                return _info_error(target, err)
            except asyncio.CancelledError:  # the channel closed under it (close()), or this task cancelled
                if _cancelled_by_close(self._closed):
                    self._check_open()
                raise

        return list(await asyncio.gather(*(one(t, stubs[0]) for t, stubs in zip(self.targets, self._stubs))))

    async def close(self) -> None:
        """Close the streams and connections; calls made afterwards fail with FAILED_PRECONDITION."""
        self._closed = True
        self._cancel_lanes()
        for channels in self._channels:
            for channel in channels:
                await channel.close()

    async def __aenter__(self) -> AsyncShardedExpertClient:
        try:
            await self.connect()
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _send(self, sub: _Sub, request: pb.ForwardRequest, timeout: float, deadline: float) -> Any:
        started = self._sent(sub)
        attempt_end = time.monotonic() + timeout  # one deadline for the send (room on the lane) and the answer
        response = None
        lane = None
        try:
            if self.transport == "unary":
                try:
                    response = await self._unary_stub(sub.shard).Forward(request, timeout=timeout)
                except grpc.aio.UsageError:  # grpc's closed channel: closed by another task meanwhile
                    self._check_open()
                    raise
                except asyncio.CancelledError:  # the channel closed under it (close()), or this task cancelled
                    if _cancelled_by_close(self._closed):
                        self._check_open()
                    raise
                return response
            lane = self._lane(sub.shard)
            future = await asyncio.wait_for(lane.send(request), timeout)
            outcome = _message_outcome(await asyncio.wait_for(asyncio.shield(future),  # a late answer is dropped
                                                              max(attempt_end - time.monotonic(), 0.0)))
            if not isinstance(outcome, ExpertServiceError):
                response = outcome
            return outcome
        except grpc.RpcError as err:
            return ExpertServiceError.from_rpc_error(err)
        except asyncio.TimeoutError:
            if lane is not None and time.monotonic() < deadline:  # the shard's attempt timed out, not the call
                self._drop_lane(sub.shard, lane)
            return ExpertServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout:.3f} s")
        except ExpertServiceError as err:
            self._check_open()  # closed meanwhile: that, not a broken lane
            return self._lane_broke(sub.shard, err)
        finally:
            self._answered(sub.shard, started, response)

    async def forward_detailed(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> ShardedForwardResult:
        """As :meth:`ShardedExpertClient.forward_detailed`."""
        timeout = _call_timeout(timeout)  # before connecting or sending: INVALID_ARGUMENT naming timeout
        self._check_open()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)  # the lazy connect included
        if self._topology is None:
            remaining = deadline - time.monotonic()
            try:
                await asyncio.wait_for(self._connect(max(min(self.connect_timeout, remaining), 1e-3)), max(remaining, 0.0))
            except asyncio.TimeoutError:
                raise ExpertServiceError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                         "deadline passed while connecting to the shards") from None
        args = (layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        call = _Call(self, *args)
        self._count_call()
        try:
            return await self._run(call, deadline)
        except _StaleShard:  # a shard restarted with another checkpoint: read the placement again, retry once
            await self._refresh_answering(_remaining(deadline))
            self._count_retry()
            return await self._run(_Call(self, *args), deadline)

    async def _run(self, call: _Call, deadline: float) -> ShardedForwardResult:
        """Compute ``call`` by ``deadline``, failing over to replicas."""
        while not call.done:
            round_ = call.plan()
            attempt = self._attempt_timeout(deadline)
            tasks = [asyncio.ensure_future(self._send(sub, request, attempt, deadline)) for sub, request in round_]
            try:
                for (sub, _), task in zip(round_, tasks):
                    call.absorb(sub, await task, deadline)
            except BaseException:
                for task in tasks:
                    task.cancel()
                raise
            call.end_round(deadline)
        return call.result()

    async def forward(
        self,
        layer: int,
        hidden_states: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        apply_router_weight_on_input: bool = False,
        output_mode: str = "combined",
        timeout: float | None = None,
    ) -> torch.Tensor:
        """As :meth:`ShardedExpertClient.forward`."""
        result = await self.forward_detailed(
            layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input=apply_router_weight_on_input,
            output_mode=output_mode, timeout=timeout,
        )
        return result.output


__all__ = [
    "CONFIG_FIELDS",
    "FAILOVER_CODES",
    "AsyncShardedExpertClient",
    "ShardStats",
    "ShardedExpertClient",
    "ShardedForwardResult",
    "ShardedStats",
    "assign_routes",
    "build_subrequests",
]
