"""ShardedExpertClient against real `lutb serve` processes holding shards made by `lutb shard`.

Cluster (started once for the module): a float32 synthetic checkpoint (2 layers, 8 experts,
H = I = 128) split by `lutb shard --placement balanced --replicas 2` into 3 shards (the 2
hottest experts of each layer on two shards), served by 4 processes: shard-0, shard-1,
shard-2 and a second copy of shard-1. The single-server reference is an in-process server
holding the whole checkpoint.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from lutb_client import AsyncShardedExpertClient, ExpertClient, ExpertServiceError, ShardedExpertClient
from lutb_client.routing import softmax_topk
from lutb_client.sharded import assign_routes, build_subrequests
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.sharding import write_load_file, write_shards
from lutb_kernels.synth import make_synthetic_checkpoint
from lutb_server.cli import main as lutb
from lutb_server.testing import ServeProcess, ServerThread

E, H, K = 8, 128, 3
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # 4 processes share 2 cores
HOT = (5, 2)  # per the load file below: the two hottest experts of each layer, replicated


@dataclass
class Cluster:
    procs: list[ServeProcess]  # shard-0, shard-1, shard-2, shard-1 (copy)
    plan: dict[int, list[list[int]]]
    single: str

    @property
    def targets(self) -> list[str]:
        return [p.address for p in self.procs]

    def holders(self, layer: int, expert: int) -> list[int]:
        """Process indices holding ``expert``."""
        shard_of_proc = [0, 1, 2, 1]
        return [i for i, s in enumerate(shard_of_proc) if expert in self.plan[layer][s]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("sharded")
    whole = make_synthetic_checkpoint(root / "whole", layers=2, experts=E, hidden=H, intermediate=H, dtype="float32", seed=11)
    load = [10.0, 20.0, 300.0, 30.0, 40.0, 500.0, 50.0, 60.0]
    write_load_file(root / "load.json", E, {0: load, 1: load})
    assert lutb(["shard", str(whole), "--out", str(root / "shards"), "--shards", "3", "--placement", "balanced",
                 "--load", str(root / "load.json"), "--replicas", "2"]) == 0
    manifest = json.loads((root / "shards" / "shards.json").read_text())
    plan = {int(k): v for k, v in manifest["layers"].items()}
    dirs = [root / "shards" / f"shard-{s}" for s in (0, 1, 2, 1)]
    procs = [ServeProcess("--checkpoint", str(d), "--backend", "reference", "--shutdown-grace-s", "2", env=ONE_THREAD) for d in dirs]
    single = ServerThread(checkpoint=whole, backend="reference")
    try:
        single.start()
        for p in procs:
            p.wait_ready()
        yield Cluster(procs, plan, single.address)
    finally:
        for p in procs:
            p.kill()
        single.stop()


def _batch(tokens: int, k: int = K, seed: int = 0, experts: list[int] | None = None) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    logits = torch.randn(tokens, E, generator=gen)
    if experts is not None:  # route only to these experts
        mask = torch.full((E,), float("-inf"))
        mask[experts] = 0.0
        logits = logits + mask
    weights, ids = softmax_topk(logits, k)
    return x, ids, weights


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _single(cluster: Cluster, *args: object, **kwargs: object) -> torch.Tensor:
    with ExpertClient(cluster.single) as client:
        return client.forward(*args, **kwargs)  # type: ignore[arg-type]


def test_placement_has_replicated_hot_experts(cluster: Cluster) -> None:
    with ShardedExpertClient(cluster.targets) as client:
        placement = client.placement()
        assert client.missing_experts() == {0: [], 1: []}
        assert client.dtype == torch.float32 and client.num_experts == E and client.hidden_size == H
    for layer in (0, 1):
        for e in range(E):
            shards = [s for s in range(3) if e in cluster.plan[layer][s]]
            assert len(shards) == (2 if e in HOT else 1)
            assert placement[layer][e] == [cluster.targets[i] for i in cluster.holders(layer, e)]


@pytest.mark.parametrize("layer, tokens, k", [(0, 64, 3), (1, 33, 8), (0, 1, 1), (1, 0, 2)])
def test_combined_output_equals_the_single_server(cluster: Cluster, layer: int, tokens: int, k: int) -> None:
    x, ids, w = _batch(tokens, k, seed=layer * 100 + tokens)
    expected = _single(cluster, layer, x, ids, w)
    with ShardedExpertClient(cluster.targets) as client:
        got = client.forward(layer, x, ids, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, H)
    if tokens:
        assert _rel(got, expected) <= 1e-5
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_route_major_and_weights_on_input_equal_the_single_server(cluster: Cluster) -> None:
    x, ids, w = _batch(48, 4, seed=5)
    with ShardedExpertClient(cluster.targets) as client:
        got = client.forward(1, x, ids, w, output_mode="route_major")
        expected = _single(cluster, 1, x, ids, w, output_mode="route_major")
        assert got.shape == (48, 4, H)
        assert _rel(got, expected) <= 1e-5
        x1, ids1, w1 = _batch(40, 1, seed=6)
        got1 = client.forward(0, x1, ids1, w1, apply_router_weight_on_input=True)
        expected1 = _single(cluster, 0, x1, ids1, w1, apply_router_weight_on_input=True)
        assert _rel(got1, expected1) <= 1e-5


def test_replicated_expert_is_computed_once(cluster: Cluster) -> None:
    """Every route to a replicated expert: a double count would double the output."""
    x, ids, w = _batch(32, 2, seed=8, experts=list(HOT))
    expected = _single(cluster, 0, x, ids, w)
    with ShardedExpertClient(cluster.targets) as client:
        result = client.forward_detailed(0, x, ids, w)
        stats = client.stats()
    assert _rel(result.output, expected) <= 1e-5
    assert sum(s.routes for s in stats.shards) == ids.numel()
    if any(all(e in part for e in HOT) for part in cluster.plan[0]):  # one shard covers every token: it takes them all
        assert len(result.shards) == 1


def test_tokens_on_one_shard_touch_only_that_shard(cluster: Cluster) -> None:
    shard = next(s for s in (0, 2) if len([e for e in cluster.plan[0][s] if e not in HOT]) >= 2)  # not the copied one
    alone = [e for e in cluster.plan[0][shard] if e not in HOT]
    x, ids, w = _batch(20, 2, seed=9, experts=alone)
    target = cluster.targets[shard]
    with ShardedExpertClient(cluster.targets) as client:
        for _ in range(3):
            result = client.forward_detailed(0, x, ids, w)
            assert result.shards == (target,)
        stats = client.stats().by_target()
        assert stats[target].requests == 3
        assert all(stats[t].requests == 0 for t in cluster.targets if t != target)
        # a call one shard answers alone is that shard's answer, unchanged
        with ExpertClient(target) as direct:
            assert torch.equal(result.output, direct.forward(0, x, ids, w))


def test_replicas_share_the_load(cluster: Cluster) -> None:
    only1 = [e for e in cluster.plan[1][1] if e not in HOT]
    x, ids, w = _batch(16, 2, seed=10, experts=only1)
    with ShardedExpertClient(cluster.targets) as client:
        with ThreadPoolExecutor(6) as pool:
            list(pool.map(lambda _: client.forward(1, x, ids, w), range(24)))
        stats = client.stats().by_target()
    copies = [stats[cluster.targets[1]].requests, stats[cluster.targets[3]].requests]
    assert sum(copies) == 24 and min(copies) >= 4, copies
    assert stats[cluster.targets[0]].requests == stats[cluster.targets[2]].requests == 0
    busy = stats[cluster.targets[1]]
    assert busy.latency_p99_ms > 0
    # the shard's own account of each sub-request: compute inside total, total inside what the client waited
    assert 0 < busy.server_compute_p50_ms <= busy.server_total_p50_ms <= busy.latency_p99_ms
    assert stats[cluster.targets[0]].server_total_p50_ms == 0.0  # no sub-requests, no samples


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_a_failed_call_leaves_no_shard_outstanding(cluster: Cluster, transport: str) -> None:
    """A call that fails on one shard's answer (here INVALID_ARGUMENT from every shard) must still book the
    other shards' answers: a shard left "outstanding" was never picked among its replicas again."""
    x, ids, w = _batch(8, 2, seed=16)
    with ShardedExpertClient(cluster.targets, transport=transport) as client:
        with pytest.raises(ExpertServiceError) as err:
            client.forward(0, x, ids, w, apply_router_weight_on_input=True)  # weights on input need k = 1
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert len({s for s in range(4) if client.stats().shards[s].requests}) >= 2  # it did span shards
        deadline = time.monotonic() + 5  # (unary: answers are booked by their futures' callbacks)
        while any(s.outstanding for s in client.stats().shards) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s.outstanding for s in client.stats().shards] == [0, 0, 0, 0]
        client.reset_stats()
        only1 = [e for e in cluster.plan[1][1] if e not in HOT]
        x1, ids1, w1 = _batch(16, 2, seed=10, experts=only1)
        for _ in range(8):
            client.forward(1, x1, ids1, w1)
        stats = client.stats().by_target()
        assert stats[cluster.targets[1]].requests and stats[cluster.targets[3]].requests  # both replicas in use


def test_async_client_equals_the_single_server(cluster: Cluster) -> None:
    x, ids, w = _batch(40, 4, seed=12)
    expected = _single(cluster, 0, x, ids, w)

    async def go() -> list[torch.Tensor]:
        async with AsyncShardedExpertClient(cluster.targets) as client:
            outs = await asyncio.gather(*(client.forward(0, x, ids, w) for _ in range(4)))
            assert client.stats().calls == 4
            return list(outs)

    for out in asyncio.run(go()):
        assert _rel(out, expected) <= 1e-5


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_several_connections_per_shard_give_the_same_output(cluster: Cluster, transport: str) -> None:
    """With ``connections=2`` sub-requests to a shard take its two connections in turn (each its own stream); the
    outputs stay those of the single server."""
    x, ids, w = _batch(40, 4, seed=13)
    expected = _single(cluster, 0, x, ids, w)
    with ShardedExpertClient(cluster.targets, connections=2, transport=transport) as client:
        assert [len(channels) for channels in client._channels] == [2] * len(cluster.targets)
        for _ in range(4):
            assert _rel(client.forward(0, x, ids, w), expected) <= 1e-5
        if transport == "stream":  # every shard got a sub-request per call: both of its lanes opened
            assert all(lane is not None for lanes in client._lanes for lane in lanes)

    async def go() -> torch.Tensor:
        async with AsyncShardedExpertClient(cluster.targets, connections=2, transport=transport) as aclient:
            outs = [await aclient.forward(0, x, ids, w) for _ in range(2)]
            return outs[-1]

    assert _rel(asyncio.run(go()), expected) <= 1e-5
    with pytest.raises(ValueError, match="connections"):
        ShardedExpertClient(cluster.targets, connections=0)


def test_mxfp8_wire_equals_sending_the_dequantized_values(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each shard gets the e4m3 codes and scales of its own tokens; sums equal the native wire on QDQ(x)."""
    import lutb_client.sharded as sharded
    from lutb_kernels.mxfp8 import mxfp8_dequantize, mxfp8_quantize

    sent: list[tuple[torch.dtype, int, int]] = []  # hidden dtype, rows, scale rows of every sub-request
    build = sharded.build_request

    def spy(layer, x, ids, w, **kw):  # noqa: ANN001, ANN202, ANN003
        scales = kw.get("hidden_scales")
        sent.append((x.dtype, int(x.shape[0]), -1 if scales is None else int(scales.shape[0])))
        return build(layer, x, ids, w, **kw)

    monkeypatch.setattr(sharded, "build_request", spy)
    x, ids, w = _batch(40, 4, seed=21)
    x = x * torch.logspace(-3, 3, H)  # blocks of very different magnitudes: scales matter
    q, scales = mxfp8_quantize(x)  # float32 checkpoint, rceil (the synthetic default)
    expected = _single(cluster, 0, mxfp8_dequantize(q, scales, torch.float32), ids, w)
    with ShardedExpertClient(cluster.targets, wire="mxfp8") as client:
        result = client.forward_detailed(0, x, ids, w)
    assert len(result.shards) > 1 and len(sent) == len(result.shards)  # really split
    assert all(dtype == torch.float8_e4m3fn and rows == scale_rows for dtype, rows, scale_rows in sent)
    assert _rel(result.output, expected) <= 1e-5

    async def go() -> torch.Tensor:
        async with AsyncShardedExpertClient(cluster.targets, wire="mxfp8") as client:
            return await client.forward(0, x, ids, w)

    assert _rel(asyncio.run(go()), expected) <= 1e-5
    with pytest.raises(ValueError, match="wire must be one of"):
        ShardedExpertClient(cluster.targets, wire="fp4")
    with ShardedExpertClient(cluster.targets, wire="mxfp8") as client, pytest.raises(ExpertServiceError) as err:
        client.forward(0, torch.full_like(x, float("nan")), ids, w)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "hidden_states" in err.value.message


def test_missing_expert_names_layer_and_experts(cluster: Cluster) -> None:
    x, ids, w = _batch(8, 2, seed=13)
    ids[:, 0] = cluster.plan[1][1][0]
    ids[:, 1] = cluster.plan[1][2][-1]
    absent = sorted({e for e in ids.flatten().tolist() if e not in cluster.plan[1][0]})
    with ShardedExpertClient([cluster.targets[0]]) as client:
        with pytest.raises(ExpertServiceError) as err:
            client.forward(1, x, ids, w)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert "layer 1" in err.value.message and str(absent) in err.value.message
        with pytest.raises(ExpertServiceError, match="layer 7 is not held by any shard"):
            client.forward(7, x, ids, w)
        with pytest.raises(ExpertServiceError, match="topk_ids: expert id 8 outside"):
            client.forward(0, x, torch.full_like(ids, E), w)
        assert client.stats().shards[0].requests == 0  # refused before sending


def test_shards_of_different_models_are_refused(cluster: Cluster, tmp_path: Path) -> None:
    other = make_synthetic_checkpoint(tmp_path / "bf16", layers=1, experts=E, hidden=H, intermediate=H, dtype="bfloat16", seed=1)
    with ServerThread(checkpoint=other, backend="reference") as server:
        with pytest.raises(ExpertServiceError) as err:
            ShardedExpertClient([cluster.targets[0], server.address])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype differs" in err.value.message and "FLOAT32" in err.value.message and "BFLOAT16" in err.value.message


def test_bfloat16_shards_agree_with_the_single_server(tmp_path: Path) -> None:
    whole = make_synthetic_checkpoint(tmp_path / "whole", layers=1, experts=E, hidden=H, intermediate=H, dtype="bfloat16", seed=2)
    plan = {0: [[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]]}  # 3 and 4 on both
    dirs = write_shards(Checkpoint(whole), tmp_path / "shards", plan)
    x, ids, w = _batch(96, 4, seed=3)
    with ServerThread(checkpoint=whole) as single, ServerThread(checkpoint=dirs[0]) as a, ServerThread(checkpoint=dirs[1]) as b:
        with ExpertClient(single.address) as client:
            expected = client.forward(0, x.to(torch.bfloat16), ids, w)
        with ShardedExpertClient([a.address, b.address]) as client:
            got = client.forward(0, x.to(torch.bfloat16), ids, w)
            stats = client.stats()
    assert got.dtype == torch.bfloat16 and not bool(torch.isnan(got).any())
    assert _rel(got, expected) <= 1e-2  # spec section 6
    assert sum(s.routes for s in stats.shards) == ids.numel()


@pytest.mark.parametrize("seed", range(4))
def test_route_assignment_covers_each_route_once(seed: int) -> None:
    """The planning functions on CPU tensors, as callers may pass them (tests/client/test_sharded_planning.py has the rest)."""
    gen = torch.Generator().manual_seed(seed)
    shards, tokens, k = 3, 50, 4
    holders = torch.rand(E, shards, generator=gen) < 0.5
    holders[torch.arange(E), torch.randint(0, shards, (E,), generator=gen)] = True  # every expert somewhere
    if seed == 3:
        holders[:, 2] = True  # a shard holding every expert: no padding id exists there
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k, generator=gen)
    pending = torch.rand(tokens, k, generator=gen) < (0.6 if seed % 2 else 1.0)  # a retry round: some routes done
    usable = torch.ones(shards, dtype=torch.bool)
    assign = assign_routes(holders, ids, pending, usable, torch.tensor([2, 0, 1]))
    h, i, p, w = holders.numpy(), ids.numpy(), pending.numpy(), weights.numpy()
    assert np.array_equal(assign >= 0, p)
    assert h[i[p], assign[p]].all()
    nulls = [None if h[:, s].all() else int(np.flatnonzero(~h[:, s])[0]) for s in range(shards)]
    seen = np.zeros((tokens, k), dtype=np.int64)
    for sub in build_subrequests(assign, ids, weights, nulls):
        t, j = np.divmod(sub.flat, k)
        seen[t, j] += 1
        assert np.array_equal(sub.ids[sub.valid], i[t, j]) and np.array_equal(sub.weights[sub.valid], w[t, j])
        assert not h[sub.ids[~sub.valid], sub.shard].any(), "padding must point to an expert the shard does not hold"
        if nulls[sub.shard] is not None:  # one top-k per deployment: the one the servers warmed up for
            assert sub.ids.shape[1] == k
    assert np.array_equal(seen, p.astype(np.int64))


def _stall_case(cluster: Cluster) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, ServeProcess]:
    """Layer-1 tokens routed only to shard-1's own experts, their single-server output, and the copy of shard-1 to stall."""
    only1 = [e for e in cluster.plan[1][1] if e not in HOT]
    batch = _batch(16, 2, seed=14, experts=only1)
    return batch, _single(cluster, 1, *batch), cluster.procs[3]


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_a_stalled_replica_is_bypassed_after_attempt_timeout(cluster: Cluster, transport: str) -> None:
    """SIGSTOP the copy of shard-1: requests to it time out after attempt_timeout and go to the other copy."""
    (x, ids, w), expected, stalled = _stall_case(cluster)
    with ShardedExpertClient(cluster.targets, timeout=20, attempt_timeout=0.5, down_s=30, transport=transport) as client:
        for _ in range(4):  # connected to everything first (both copies of shard-1 have answered)
            client.forward(1, x, ids, w)
        stalled.proc.send_signal(signal.SIGSTOP)
        try:
            outs = [client.forward_detailed(1, x, ids, w) for _ in range(4)]
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
        stats = client.stats().by_target()
    assert all(_rel(r.output, expected) <= 1e-5 for r in outs)
    assert all(r.shards == (cluster.targets[1],) for r in outs[1:])  # marked down: not tried again
    assert stats[stalled.address].failures <= 1 and stats[stalled.address].down  # failed once if it was picked first
    assert sum(r.retries for r in outs) == stats[stalled.address].failures


@pytest.mark.parametrize("transport", ["stream", "unary"])
def test_async_client_bypasses_a_stalled_replica(cluster: Cluster, transport: str) -> None:
    """The asyncio client, both transports: as above; a late answer on the stalled shard's stream is dropped."""
    (x, ids, w), expected, stalled = _stall_case(cluster)

    async def go() -> tuple[list, dict]:  # noqa: ANN202
        async with AsyncShardedExpertClient(cluster.targets, timeout=20, attempt_timeout=0.5, down_s=30,
                                            transport=transport) as client:
            for _ in range(4):  # both copies of shard-1 have answered (an open stream each, with transport="stream")
                await client.forward(1, x, ids, w)
            stalled.proc.send_signal(signal.SIGSTOP)
            try:
                outs = [await client.forward_detailed(1, x, ids, w) for _ in range(4)]
            finally:
                stalled.proc.send_signal(signal.SIGCONT)
            await asyncio.sleep(0.2)  # the stalled shard's late answer arrives on the open stream
            outs.append(await client.forward_detailed(1, x, ids, w))
            return outs, client.stats().by_target()

    outs, stats = asyncio.run(go())
    assert all(_rel(r.output, expected) <= 1e-5 for r in outs)
    assert stats[stalled.address].failures <= 1 and stats[stalled.address].down  # failed once if it was picked first
    assert all(r.shards == (cluster.targets[1],) for r in outs[1:])


def test_async_client_rejects_unknown_transport(cluster: Cluster) -> None:
    with pytest.raises(ValueError, match="transport must be one of"):
        AsyncShardedExpertClient(cluster.targets, transport="carrier-pigeon")


def test_the_calls_own_deadline_is_not_a_shard_failure(cluster: Cluster) -> None:
    x, ids, w = _batch(256, 8, seed=15)
    with ShardedExpertClient(cluster.targets) as client:
        with pytest.raises(ExpertServiceError) as err:
            client.forward(0, x, ids, w, timeout=0.001)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not any(s.down for s in client.stats().shards)


def test_killing_a_replica_during_a_run_loses_no_call(cluster: Cluster) -> None:
    """Runs last: SIGKILL the second copy of shard-1 while 4 threads (blocking clients: 2 over streams,
    2 over unary calls) and an asyncio client (streams) make calls; each call still succeeds."""
    batches = [_batch(24, K, seed=100 + i) for i in range(4)]
    expected = [_single(cluster, i % 2, *b) for i, b in enumerate(batches)]
    victim = cluster.procs[3]
    results: list[float] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    with ShardedExpertClient(cluster.targets, timeout=20, down_s=5.0) as client, \
            ShardedExpertClient(cluster.targets, timeout=20, down_s=5.0, transport="unary") as unary_client:

        def worker(index: int) -> None:
            for n in range(30):
                i = (index + n) % 4
                try:
                    out = (client if index % 2 else unary_client).forward(i % 2, *batches[i])
                except BaseException as exc:  # noqa: BLE001 - recorded and asserted below
                    with lock:
                        errors.append(exc)
                    return
                with lock:
                    results.append(_rel(out, expected[i]))

        async def async_calls() -> None:  # the asyncio client over streams, alongside the threads
            async with AsyncShardedExpertClient(cluster.targets, timeout=20, down_s=5.0) as aclient:

                async def one(index: int) -> None:
                    for n in range(30):
                        i = (index + n) % 4
                        out = await aclient.forward(i % 2, *batches[i])
                        with lock:
                            async_results.append(_rel(out, expected[i]))

                await asyncio.gather(*(one(c) for c in range(2)))

        def async_worker() -> None:
            try:
                asyncio.run(async_calls())
            except BaseException as exc:  # noqa: BLE001 - recorded and asserted below
                with lock:
                    errors.append(exc)

        async_results: list[float] = []
        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)] + [threading.Thread(target=async_worker)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < 20 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        assert client.stats().by_target()[victim.address].requests > 0  # it was serving before the kill
        assert unary_client.stats().by_target()[victim.address].requests > 0
        victim.proc.send_signal(signal.SIGKILL)
        for t in threads:
            t.join(60)
        stats = client.stats()
    assert not errors, errors
    assert len(results) == 120 and len(async_results) == 60
    assert max(results + async_results) <= 1e-5
    assert stats.by_target()[victim.address].down
    assert unary_client.stats().by_target()[victim.address].down
    print("failover stats:", stats)


BAD_TIMEOUTS = [0, -1.0, float("inf"), float("nan"), "5", True]
NOWHERE = ["127.0.0.1:1"]  # no server: every argument below is refused before a call (a channel connects lazily)


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_a_bad_constructor_timeout_is_refused_as_by_the_plain_clients(timeout: object) -> None:
    """The sharded clients' ``timeout`` follows ExpertClient's rule (ValueError naming ``timeout``); a wrong type
    once failed later in the deadline arithmetic, and inf, nan or 0 were kept as the default deadline."""
    for client_class in (ShardedExpertClient, AsyncShardedExpertClient):
        with pytest.raises(ValueError, match="timeout"):
            client_class(NOWHERE, timeout=timeout, connect_timeout=0.5)


@pytest.mark.parametrize("name", ["attempt_timeout", "connect_timeout"])
@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_the_other_constructor_bounds_are_refused_by_name(name: str, value: object) -> None:
    """``attempt_timeout`` and ``connect_timeout`` follow the same rule, and the error names the argument (a bad
    ``connect_timeout`` once failed inside the first refresh as a bad ``timeout``, or was taken as given)."""
    for client_class in (ShardedExpertClient, AsyncShardedExpertClient):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            client_class(NOWHERE, **{name: value})


@pytest.mark.parametrize("timeout", BAD_TIMEOUTS)
def test_a_bad_per_call_timeout_raises_the_clients_error(timeout: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-call timeouts of the sharded clients (forward, forward_detailed, refresh) follow the plain clients' rule
    and fail with INVALID_ARGUMENT naming ``timeout`` before any shard is called, where they once raised TypeError
    or reached grpc as they were."""
    def refused(call: object) -> None:
        with pytest.raises(ExpertServiceError) as info:
            call()  # type: ignore[operator]
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in info.value.message

    x, ids, w = _batch(2)
    with monkeypatch.context() as patch:  # the blocking client asks the shards for their ModelInfo when made
        patch.setattr(ShardedExpertClient, "refresh", lambda self, *, timeout=30.0: None)
        client = ShardedExpertClient(NOWHERE, timeout=1)
    with client:
        refused(lambda: client.forward(0, x, ids, w, timeout=timeout))
        refused(lambda: client.forward_detailed(0, x, ids, w, timeout=timeout))
        refused(lambda: client.refresh(timeout=timeout))

    async def body() -> None:
        aclient = AsyncShardedExpertClient(NOWHERE, timeout=1, connect_timeout=0.5)
        try:
            for call in (
                lambda: aclient.forward(0, x, ids, w, timeout=timeout),
                lambda: aclient.forward_detailed(0, x, ids, w, timeout=timeout),
                lambda: aclient.refresh(timeout=timeout),
            ):
                with pytest.raises(ExpertServiceError) as info:
                    await call()
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "timeout" in info.value.message
        finally:
            await aclient.close()

    asyncio.run(body())
