"""The routing kernel's launch shape and where the experts pick it over the torch version (sizes only).

Pinned to the H200 timings in bench/results/2026-12-04-routing-chunk-h200.md; CPU only.
"""

from __future__ import annotations

import pytest
from lutb_kernels.routing import max_padded_routes
from lutb_kernels.routing_triton import (
    PAIRWISE_RANK_CHUNK,
    routing_launch,
    triton_routing_wins,
)


@pytest.mark.parametrize("routes,experts,wins", [
    (8, 256, True), (256, 256, True), (4096, 256, True),  # 2.7-44 us against 61-103 us
    (16384, 256, True),  # 164 against 146 us on the GPU, but ~0.9 ms less to launch eagerly
    (16385, 256, False), (32768, 128, False),  # the server's eager batches (4096+ tokens, top-8)
    (16, 8, True), (8192, 8, True), (16384, 8, False),  # the one-hot mode
    (4096, 64, True), (4097, 128, True), (16384, 128, True), (16385, 128, False),
])
def test_triton_routing_wins_where_measured(routes: int, experts: int, wins: bool) -> None:
    assert triton_routing_wins(routes, experts) is wins


@pytest.mark.parametrize("routes,experts,onehot,rank_chunk", [
    (8, 256, False, 16), (64, 256, False, 32), (65536, 256, False, 32),
    (8, 64, True, 16), (256, 64, True, 128), (65536, 8, True, 512),
])
def test_launch_shape(routes: int, experts: int, onehot: bool, rank_chunk: int) -> None:
    padded = max_padded_routes(routes, 16, experts)
    launch = routing_launch(routes, experts, padded, -(-padded // 16))
    assert (launch.onehot, launch.rank_chunk, launch.num_warps) == (onehot, rank_chunk, 4)
    assert launch.e_pad >= experts and launch.e_pad & (launch.e_pad - 1) == 0
    if not onehot:
        assert launch.rank_chunk <= PAIRWISE_RANK_CHUNK
