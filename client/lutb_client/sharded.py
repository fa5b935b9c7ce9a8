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
   most of its routes wins (so a token whose experts all live on one shard goes to that
   shard alone, and no other shard is called); ties go to the shard with the fewest
   requests outstanding from this client (round-robin among equals), which spreads load
   over replicas.
3. Shard ``s`` gets one request holding only the tokens with a route assigned to it; its
   ``topk_ids``/``topk_weights`` are ``[T_s, k_s]`` with the token's assigned routes packed
   left in their original order (``k_s`` = most routes any of those tokens has there). A
   token with fewer routes there is padded with an expert id the shard does NOT hold and
   weight 0: the server adds exactly zero for it and computes nothing (spec section 4).
   Only when the shard holds every expert of the layer (so no such id exists: it can only
   happen while retrying part of a token) are its tokens split into one request per route
   count instead, so no route is ever computed twice or wasted. When one shard takes a
   whole call unchanged, the request is the caller's own.
4. Requests go out in parallel. Combined outputs are summed in float32 and rounded to the
   model dtype once (a call answered by one shard returns that shard's output as is);
   route-major rows are placed from the shard that computed them.
5. A shard answering UNAVAILABLE or DEADLINE_EXCEEDED is marked down for ``down_s``
   seconds and its routes are planned again over the remaining shards (replicas); a down
   shard is still used when it is the only holder left. When no shard left holds a
   needed expert, :class:`~lutb_client.errors.ExpertServiceError` names the layer and the
   experts (``UNAVAILABLE`` when their holders failed, ``NOT_FOUND`` when no shard holds
   them). Other errors (bad input) are raised as the shard reported them.

Only unary ``Forward`` calls are used; many calls may run concurrently (threads or tasks).
All shards must answer ``GetModelInfo`` when the client connects; :meth:`refresh` asks again.
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
import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client._proto.lutb.v1 import expert_service_pb2_grpc as pb_grpc
from lutb_client.client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT_S,
    WIRES,
    AsyncForwardStream,
    ForwardStream,
    build_request,
    open_channel,
    parse_response,
)
from lutb_client.codec import dtype_name, to_torch_dtype
from lutb_client.errors import ExpertServiceError, status_code

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
    holders: torch.Tensor  # bool [E, S]: shard s holds expert e
    null_ids: tuple[int | None, ...]  # per shard: an expert id it does not hold (None if it holds all)


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
        held: dict[int, torch.Tensor] = {}
        for s, info in enumerate(infos):
            for layer in info.layers:
                mask = held.setdefault(layer.layer, torch.zeros(self.num_experts, self.shards, dtype=torch.bool))
                ids = [e for e in layer.expert_ids if 0 <= e < self.num_experts]
                mask[ids, s] = True
        self.layers: dict[int, _LayerMap] = {}
        for layer, mask in held.items():
            nulls: list[int | None] = []
            for s in range(self.shards):
                free = (~mask[:, s]).nonzero()
                nulls.append(int(free[0]) if free.numel() else None)
            self.layers[layer] = _LayerMap(mask, tuple(nulls))

    def missing_experts(self) -> dict[int, list[int]]:
        return {layer: (~m.holders.any(1)).nonzero().flatten().tolist() for layer, m in sorted(self.layers.items())}


# -- planning (pure tensor code, shared by both clients) ------------------------------------


@dataclass
class _Sub:
    """One request to one shard: its tokens, and where its routes came from."""

    shard: int
    rows: torch.Tensor  # int64 [T_s]: token indices
    cols: torch.Tensor  # int64 [T_s, k_s]: original route index of each column
    valid: torch.Tensor  # bool [T_s, k_s]: False on padding
    ids: torch.Tensor  # [T_s, k_s]
    weights: torch.Tensor  # float32 [T_s, k_s]
    whole: bool  # the caller's request unchanged


def assign_routes(
    holders: torch.Tensor, ids: torch.Tensor, pending: torch.Tensor, usable: torch.Tensor, rank: torch.Tensor
) -> torch.Tensor:
    """Assign every pending ``(token, route)`` to one usable shard holding its expert.

    Args:
        holders: bool ``[E, S]``.
        ids: int64 ``[T, k]`` expert ids.
        pending: bool ``[T, k]``: routes to assign.
        usable: bool ``[S]``: shards that may be used.
        rank: int64 ``[S]``: preference among equals (lower first), a permutation of ``0..S-1``.

    Returns:
        int64 ``[T, k]``: the shard of each pending route, -1 where not pending or where no
        usable shard holds the expert.
    """
    shards = holders.shape[1]
    can = holders[ids] & usable & pending.unsqueeze(-1)  # [T, k, S]
    count = can.sum(1)  # [T, S]: routes of the token each shard can take
    key = count * shards + (shards - 1 - rank)  # most routes first, then the preferred shard
    score = torch.where(can, key.unsqueeze(1), torch.full_like(key.unsqueeze(1), -1))
    assign = score.argmax(-1)
    return torch.where(can.any(-1), assign, torch.full_like(assign, -1))


def build_subrequests(
    assign: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, null_ids: Sequence[int | None]
) -> list[_Sub]:
    """The requests that compute every assigned route once (see the module docstring, step 3)."""
    tokens, k = ids.shape
    subs: list[_Sub] = []
    for s in torch.unique(assign[assign >= 0]).tolist():
        mine = assign == s
        rows = mine.any(1).nonzero().flatten()
        m = mine[rows]
        counts = m.sum(1)
        if int(rows.numel()) == tokens and bool(m.all()):
            cols = torch.arange(k).expand(tokens, k)
            subs.append(_Sub(s, rows, cols, torch.ones_like(m), ids, weights, True))
            continue
        null = null_ids[s]
        groups = [(rows, m, counts)] if null is not None else [
            (rows[counts == c], m[counts == c], counts[counts == c]) for c in counts.unique().tolist()
        ]
        for g_rows, g_m, g_counts in groups:
            # padded to the call's own k where a null id exists: the server then always sees one
            # top-k per deployment, the one its CUDA graphs and compiled kernels were made for at
            # start-up (a top-k first met under load costs a graph capture and, since top-k is a
            # kernel constant, Triton compiles of about a second each, per server process)
            k_s = k if null is not None else int(g_counts.max())
            cols = torch.sort((~g_m).to(torch.int8), dim=1, stable=True).indices[:, :k_s]
            valid = torch.arange(k_s).unsqueeze(0) < g_counts.unsqueeze(1)
            sub_ids = ids[g_rows].gather(1, cols)
            sub_w = weights[g_rows].gather(1, cols)
            if not bool(valid.all()):
                sub_ids = sub_ids.masked_fill(~valid, int(null))  # type: ignore[arg-type]
                sub_w = sub_w.masked_fill(~valid, 0.0)
            subs.append(_Sub(s, g_rows, cols, valid, sub_ids, sub_w, False))
    return subs


class _Call:
    """The state of one sharded forward: what is left to compute and what has come back."""

    def __init__(self, core: _ShardedCore, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                 apply_router_weight_on_input: bool, output_mode: str) -> None:
        topo = core._topology
        if layer not in topo.layers:
            raise ExpertServiceError(
                grpc.StatusCode.NOT_FOUND, f"layer {layer} is not held by any shard; the shards hold layers {sorted(topo.layers)}")
        if output_mode not in ("combined", "route_major"):
            raise ExpertServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"output_mode: {output_mode!r} is not combined or route_major")
        if x.dim() != 2 or x.shape[1] != topo.hidden_size:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"hidden_states: shape {list(x.shape)} does not match [T, {topo.hidden_size}]")
        if ids.dtype not in (torch.int32, torch.int64) or ids.dim() != 2 or ids.shape[0] != x.shape[0] or ids.shape[1] < 1:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"topk_ids: {ids.dtype} shape {list(ids.shape)} is not int32/int64 [T, k] with T = {x.shape[0]} and k >= 1")
        if weights.shape != ids.shape:
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"topk_weights: shape {list(weights.shape)} does not match topk_ids shape {list(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= topo.num_experts):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ExpertServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"topk_ids: expert id {bad} outside the global range [0, {topo.num_experts})")
        self.core = core
        self.layer = layer
        self.map = topo.layers[layer]
        self.dtype = topo.dtype
        self.x = x.detach().to("cpu")
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
        self.ids = ids.detach().to("cpu", torch.int64)
        self.weights = weights.detach().to("cpu")
        self.kw = {"apply_router_weight_on_input": apply_router_weight_on_input, "output_mode": output_mode}
        self.route_major = output_mode == "route_major"
        tokens, k = self.ids.shape
        self.pending = torch.ones(tokens, k, dtype=torch.bool)
        self.excluded: set[int] = set()
        self.failed: dict[int, str] = {}
        self.parts: list[tuple[_Sub, torch.Tensor]] = []
        self.rounds = 0
        self.used: set[int] = set()

    @property
    def done(self) -> bool:
        return not bool(self.pending.any())

    def plan(self) -> list[tuple[_Sub, pb.ForwardRequest]]:
        """The next round of sub-requests (raises when a pending expert has no shard left)."""
        core, holders = self.core, self.map.holders
        shards = holders.shape[1]
        not_excluded = torch.tensor([s not in self.excluded for s in range(shards)], dtype=torch.bool)
        up = not_excluded & torch.tensor(core._up_mask(), dtype=torch.bool)
        rank = core._rank()
        assign = assign_routes(holders, self.ids, self.pending, up, rank)
        stuck = self.pending & (assign < 0)
        if bool(stuck.any()):  # holders marked down may have recovered: better than failing
            fallback = assign_routes(holders, self.ids, stuck, not_excluded, rank)
            assign = torch.where(stuck, fallback, assign)
            stuck = self.pending & (assign < 0)
        if bool(stuck.any()):
            raise self._missing(sorted(set(self.ids[stuck].tolist())))
        subs = build_subrequests(assign, self.ids, self.weights, self.map.null_ids)
        out = []
        for sub in subs:
            scales = None
            if self.mxfp8 is not None:
                q, scales = self.mxfp8
                if not sub.whole:
                    q, scales = q.index_select(0, sub.rows), scales.index_select(0, sub.rows)
                x = q.view(torch.float8_e4m3fn)
            else:
                x = self.x if sub.whole else self.x.index_select(0, sub.rows)
            request = build_request(
                self.layer, x, sub.ids.to(torch.int32), sub.weights, request_id=next(core._ids), hidden_scales=scales, **self.kw)
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
        self.parts.append((sub, output))
        self.used.add(sub.shard)
        r = sub.rows.unsqueeze(1).expand_as(sub.cols)
        self.pending[r[sub.valid], sub.cols[sub.valid]] = False

    def end_round(self, deadline: float) -> None:
        if not self.done:
            self.rounds += 1
            self.core._count_retry()
            if time.monotonic() >= deadline:
                raise ExpertServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED, f"layer {self.layer}: deadline passed while retrying on replicas "
                    f"(failed: {'; '.join(f'{self.core.targets[s]}: {w}' for s, w in sorted(self.failed.items()))})")

    def result(self) -> ShardedForwardResult:
        tokens, k = self.ids.shape
        hidden = self.x.shape[1]
        shards = tuple(self.core.targets[s] for s in sorted(self.used))
        if self.route_major:
            out = torch.zeros(tokens, k, hidden, dtype=self.dtype)
            for sub, y in self.parts:
                r = sub.rows.unsqueeze(1).expand_as(sub.cols)
                out[r[sub.valid], sub.cols[sub.valid]] = y[sub.valid].to(self.dtype)
            return ShardedForwardResult(out, shards, self.rounds)
        if len(self.parts) == 1 and self.parts[0][0].whole:
            return ShardedForwardResult(self.parts[0][1], shards, self.rounds)
        acc = torch.zeros(tokens, hidden, dtype=torch.float32)
        for sub, y in self.parts:
            acc.index_add_(0, sub.rows, y.to(torch.float32))
        return ShardedForwardResult(acc.to(self.dtype), shards, self.rounds)


# -- shared core ---------------------------------------------------------------------------


class _ShardedCore:
    _stream_class: ClassVar[type]
    """The stream type of a lane (``ForwardStream`` or ``AsyncForwardStream``)."""

    def __init__(self, targets: Sequence[str], timeout: float, attempt_timeout: float | None, down_s: float,
                 wire: str, transport: str) -> None:
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
        self._lanes: list[Any] = [None] * len(targets)  # per shard: its open stream (transport "stream")
        self._lanes_lock = threading.Lock()
        self.timeout = timeout
        self.attempt_timeout = attempt_timeout
        self.down_s = down_s
        self._lock = threading.Lock()
        self._counters = [_ShardCounters() for _ in targets]
        self._calls = 0
        self._retries = 0
        self._rr = itertools.count()
        self._ids = itertools.count(1)
        self._topology: _Topology | None = None
        self.infos: tuple[pb.ModelInfo, ...] = ()

    # topology -----------------------------------------------------------------------------

    def _set_infos(self, infos: Sequence[pb.ModelInfo]) -> None:
        self._topology = _Topology(self.targets, infos)
        self.infos = tuple(infos)

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
                e: [self.targets[s] for s in m.holders[e].nonzero().flatten().tolist()]
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
        now = time.monotonic()
        with self._lock:
            return [c.down_until <= now for c in self._counters]

    def _rank(self) -> torch.Tensor:
        """Shards by outstanding requests, ties broken round-robin: ``rank[s]`` (0 = preferred)."""
        n = len(self.targets)
        start = next(self._rr) % n
        with self._lock:
            order = sorted(range(n), key=lambda s: (self._counters[s].outstanding, (s - start) % n))
        rank = torch.empty(n, dtype=torch.int64)
        rank[torch.tensor(order)] = torch.arange(n)
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
            c.tokens += int(sub.rows.numel())
            c.routes += int(sub.valid.sum())
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

    def _lane(self, shard: int) -> Any:
        """The shard's open stream, (re)opened when missing or broken (any thread, or the event loop)."""
        with self._lanes_lock:
            lane = self._lanes[shard]
            if lane is None or lane.broken:
                if lane is not None:
                    lane.cancel()
                lane = self._lanes[shard] = self._stream_class(
                    self._stubs[shard], timeout=None, max_in_flight=LANE_MAX_IN_FLIGHT, ids=self._ids)
            return lane

    def _drop_lane(self, shard: int, lane: Any) -> None:
        """Cancel ``lane`` if it is still the shard's: a shard that let an attempt time out gets a fresh stream
        next time, so unanswered messages cannot pile up on a stuck one (their slots are bounded)."""
        with self._lanes_lock:
            if self._lanes[shard] is lane:
                self._lanes[shard] = None
                lane.cancel()

    def _cancel_lanes(self) -> None:
        with self._lanes_lock:
            for lane in self._lanes:
                if lane is not None:
                    lane.cancel()
            self._lanes = [None] * len(self._lanes)

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

    Raises:
        ExpertServiceError: a shard did not answer ``GetModelInfo`` (its target named), or the
            shards do not serve one model (``FAILED_PRECONDITION``, naming the field).
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
    ) -> None:
        super().__init__(targets, timeout, attempt_timeout, down_s, wire, transport)
        self._channels = [
            open_channel(t, aio=False, credentials=credentials, max_message_bytes=max_message_bytes,
                         channel_options=channel_options)
            for t in self.targets
        ]
        self._stubs = [pb_grpc.ExpertServiceStub(c) for c in self._channels]
        try:
            self.refresh(timeout=connect_timeout)
        except BaseException:
            self.close()
            raise

    def _on_done(self, sub: _Sub, started: float) -> Any:
        def done(future: Any) -> None:
            ok = not future.cancelled() and future.exception() is None
            self._answered(sub.shard, started, future.result() if ok else None)

        return done

    def _stream_send(self, sub: _Sub, request: pb.ForwardRequest) -> tuple[float, Any, Any]:
        """Send one sub-request on the shard's lane: ``(started, lane, future or the error)``."""
        started = self._sent(sub)
        lane = self._lane(sub.shard)
        try:
            return started, lane, lane.send(request)
        except ExpertServiceError as err:
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
            return self._lane_broke(sub.shard, err)
        finally:
            self._answered(sub.shard, started, response)

    def refresh(self, *, timeout: float = 30.0) -> None:
        """Ask every shard for its ``ModelInfo`` again (all in parallel) and rebuild the placement."""
        futures = [stub.GetModelInfo.future(pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True) for stub in self._stubs]
        infos = []
        for target, future in zip(self.targets, futures):
            try:
                infos.append(future.result())
            except grpc.RpcError as err:
                for f in futures:
                    f.cancel()
                raise _info_error(target, err) from None
        self._set_infos(infos)

    def close(self) -> None:
        self._cancel_lanes()
        for channel in self._channels:
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
        call = _Call(self, layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        self._count_call()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while not call.done:
            round_ = call.plan()
            attempt = self._attempt_timeout(deadline)
            if self.transport == "stream":
                attempt_end = time.monotonic() + attempt
                lanes = [(sub, *self._stream_send(sub, request)) for sub, request in round_]
                for sub, started, lane, sent_on in lanes:
                    call.absorb(sub, self._stream_result(sub, started, lane, sent_on, attempt_end, deadline), deadline)
                call.end_round(deadline)
                continue
            sent = []
            for sub, request in round_:
                future = self._stubs[sub.shard].Forward.future(request, timeout=attempt)
                future.add_done_callback(self._on_done(sub, self._sent(sub)))
                sent.append((sub, future))
            try:
                for sub, future in sent:
                    try:
                        response: Any = future.result()
                    except grpc.RpcError as err:
                        response = ExpertServiceError.from_rpc_error(err)
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
            ExpertServiceError: bad input (``INVALID_ARGUMENT``), a layer or expert no shard
                holds (``NOT_FOUND``), every holder of a needed expert failed (``UNAVAILABLE``),
                the deadline passed, or a shard's own error.
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
    ) -> None:
        super().__init__(targets, timeout, attempt_timeout, down_s, wire, transport)
        self.connect_timeout = connect_timeout
        self._channels = [
            open_channel(t, aio=True, credentials=credentials, max_message_bytes=max_message_bytes,
                         channel_options=channel_options)
            for t in self.targets
        ]
        self._stubs = [pb_grpc.ExpertServiceStub(c) for c in self._channels]
        self._connect_lock = asyncio.Lock()

    async def connect(self) -> None:
        """Ask the shards for their ``ModelInfo`` unless already done."""
        async with self._connect_lock:
            if self._topology is None:
                await self.refresh(timeout=self.connect_timeout)

    async def refresh(self, *, timeout: float = 30.0) -> None:
        """Ask every shard for its ``ModelInfo`` again and rebuild the placement."""

        async def one(target: str, stub: pb_grpc.ExpertServiceStub) -> pb.ModelInfo:
            try:
                return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout, wait_for_ready=True)
            except grpc.RpcError as err:
                raise _info_error(target, err) from None

        infos = await asyncio.gather(*(one(t, s) for t, s in zip(self.targets, self._stubs)))
        self._set_infos(infos)

    async def close(self) -> None:
        self._cancel_lanes()
        for channel in self._channels:
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
        response = None
        lane = None
        try:
            if self.transport == "unary":
                response = await self._stubs[sub.shard].Forward(request, timeout=timeout)
                return response
            lane = self._lane(sub.shard)
            future = await asyncio.wait_for(lane.send(request), timeout)
            outcome = _message_outcome(await asyncio.wait_for(asyncio.shield(future), timeout))  # a late answer is dropped
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
        await self.connect()
        call = _Call(self, layer, hidden_states, topk_ids, topk_weights, apply_router_weight_on_input, output_mode)
        self._count_call()
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
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
