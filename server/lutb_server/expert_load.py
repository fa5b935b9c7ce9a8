"""Expert load: tokens routed to each (layer, expert) this server holds.

Counted when a request is answered (refused ones, e.g. queue-full or past their deadline, are not,
so a client's retries count once), one per ``(token, route)`` whose expert the server holds; routes to experts held elsewhere add
zero work here and are not counted, so the counts of the shards of a deployment add up to
the whole model's load. Exported, only with ``--expert-metrics`` (``LUTB_EXPERT_METRICS``),
as the Prometheus counter ``lutb_expert_tokens_total{layer, expert}``: one series per
held expert and layer (E x layers), zeros included, from the first request on. ``lutb load`` scrapes it into a load
file for ``lutb shard --placement balanced``.

Counting is a numpy ``bincount`` per request into an int64 array per layer (no per-label work and no
torch call on the request path); the series are built at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from lutb_client.codec import WireTensor, host_array

METRIC = "lutb_expert_tokens"
"""Family name; the exported sample is ``lutb_expert_tokens_total``."""
HELP = "Tokens routed to each expert this server holds (one per token and route), counted for each answered request"


class _Config(Protocol):
    num_experts: int


class _Engine(Protocol):
    config: _Config

    @property
    def layer_ids(self) -> list[int]: ...

    def expert_ids(self, layer: int) -> list[int]: ...


class _Request(Protocol):
    layer: int
    topk_ids: torch.Tensor | WireTensor


class ExpertLoad(Collector):
    """Counts tokens per (layer, held expert); a Prometheus collector of ``lutb_expert_tokens_total``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engine: object | None = None
        self._held: dict[int, np.ndarray] = {}  # layer -> bool [num_experts]: held here
        self._counts: dict[int, np.ndarray] = {}  # layer -> int64 [num_experts]
        self._num_experts = 0

    def bind(self, engine: _Engine) -> None:
        """Learn the layers and held experts of ``engine`` (its series start at zero); :meth:`record` does it on first use."""
        num_experts = int(engine.config.num_experts)
        held, counts = {}, {}
        for layer in engine.layer_ids:
            mask = np.zeros(num_experts, dtype=bool)
            mask[np.asarray(engine.expert_ids(layer), dtype=np.int64)] = True
            held[layer] = mask
            counts[layer] = np.zeros(num_experts, dtype=np.int64)
        with self._lock:
            self._engine, self._held, self._counts, self._num_experts = engine, held, counts, num_experts

    def record(self, engine: _Engine, request: _Request) -> None:
        """Count a validated request's routes (``topk_ids`` int ``[T, k]`` in ``[0, num_experts)``)."""
        if self._engine is not engine:
            self.bind(engine)
        held = self._held.get(request.layer)
        ids = host_array(request.topk_ids)
        if held is None or ids.size == 0:
            return
        counts = np.bincount(ids.reshape(-1), minlength=self._num_experts)[: self._num_experts]
        counts[~held] = 0
        with self._lock:
            self._counts[request.layer] += counts

    def snapshot(self) -> dict[int, dict[int, int]]:
        """``{layer: {held expert: tokens}}`` so far."""
        with self._lock:
            return {
                layer: {int(e): int(self._counts[layer][e]) for e in np.flatnonzero(mask).tolist()}
                for layer, mask in sorted(self._held.items())
            }

    def describe(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(METRIC, HELP, labels=["layer", "expert"])

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(METRIC, HELP, labels=["layer", "expert"])
        for layer, experts in self.snapshot().items():
            for expert, tokens in experts.items():
                family.add_metric([str(layer), str(expert)], float(tokens))
        yield family


__all__ = ["HELP", "METRIC", "ExpertLoad"]
