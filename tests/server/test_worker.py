"""ComputeWorker on the CPU: same results as the engine, staging buffers reused, thread and errors."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

from lutb_server.backends import choose_backend
from lutb_server.engine import ExpertEngine, PreparedRequest
from lutb_server.worker import ComputeWorker


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> ExpertEngine:
    from lutb_kernels.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint)
    return ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")), validate_tiles=False)


def _requests(engine: ExpertEngine, sizes: list[int], *, k: int = 2, seed: int = 0, layer: int = 0,
              mode: str = "combined", on_input: bool = False) -> list[PreparedRequest]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in sizes:
        x = torch.randn(t, engine.config.hidden_size, generator=gen)
        ids = torch.randint(0, engine.config.num_experts, (t, k), generator=gen, dtype=torch.int32)
        w = torch.rand(t, k, generator=gen)
        out.append(engine.prepare(layer, x, ids, w, apply_router_weight_on_input=on_input, output_mode=mode))
    return out


def _mxfp8_requests(engine: ExpertEngine, sizes: list[int], *, k: int = 2, seed: int = 0) -> tuple[list[PreparedRequest], list[PreparedRequest]]:
    """The same MXFP8 input two ways: (carried as sent, as a CUDA engine prepares it; dequantized by the engine)."""
    from lutb_kernels.mxfp8 import mxfp8_quantize

    gen = torch.Generator().manual_seed(seed)
    carried, dense = [], []
    for t in sizes:
        # rows of very different magnitudes: every block its own scale, subnormal e4m3 codes among them
        x = torch.randn(t, engine.config.hidden_size, generator=gen) * torch.exp2(torch.randint(-20, 20, (t, 1), generator=gen).float())
        q, scales = mxfp8_quantize(x.to(engine.model_dtype), engine.config.mxfp8_scale_mode)
        ids = torch.randint(0, engine.config.num_experts, (t, k), generator=gen, dtype=torch.int32)
        w = torch.rand(t, k, generator=gen)
        dense.append(engine.prepare(0, q, ids, w, hidden_scales=scales))
        carried.append(PreparedRequest(0, q, ids, w, False, "combined", scales, engine.model_dtype))
    return carried, dense


def _engine_pooled(engine: ExpertEngine, requests: list[PreparedRequest]) -> list[torch.Tensor]:
    """What the scheduler computed before the worker: concatenate, engine.forward, split."""
    first = requests[0]
    out = engine.forward(first.layer, torch.cat([r.x for r in requests]), torch.cat([r.topk_ids for r in requests]),
                         torch.cat([r.topk_weights for r in requests]),
                         apply_router_weight_on_input=first.apply_router_weight_on_input, output_mode=first.output_mode)
    return list(torch.split(out, [r.tokens for r in requests]))


@pytest.mark.parametrize(("sizes", "k", "mode", "on_input"), [
    ([5], 2, "combined", False),
    ([3, 1, 7], 2, "combined", False),
    ([2, 4], 3, "route_major", False),
    ([4, 1], 1, "combined", True),
    ([0, 3], 2, "combined", False),
])
def test_results_unchanged(engine: ExpertEngine, sizes: list[int], k: int, mode: str, on_input: bool) -> None:
    worker = ComputeWorker(engine)
    requests = _requests(engine, sizes, k=k, mode=mode, on_input=on_input, seed=sum(sizes) + k)
    before = time.monotonic()
    outputs, seconds, call_tokens, path, started = worker.run(requests)
    expected = _engine_pooled(engine, requests)
    assert seconds > 0 and len(outputs) == len(requests) and call_tokens == sum(sizes)
    assert started is not None and before <= started <= time.monotonic() - seconds + 1e-3
    assert path == "eager"  # no CUDA graphs on the CPU
    for got, want, r in zip(outputs, expected, requests):
        assert got.dtype == engine.model_dtype and got.device.type == "cpu"
        assert got.shape == ((r.tokens, k, engine.config.hidden_size) if mode == "route_major" else (r.tokens, engine.config.hidden_size))
        assert torch.equal(got, want)


def test_staging_buffers_are_reused(engine: ExpertEngine) -> None:
    worker = ComputeWorker(engine)
    worker.run(_requests(engine, [8, 8], seed=1))
    grown, nbytes = worker._host.grown, worker.staging_bytes["host"]
    x_ptr = worker._host.get("x", (1, engine.config.hidden_size), engine.model_dtype).data_ptr()
    for seed, sizes in enumerate(([3, 5], [1, 1, 1], [16])):
        requests = _requests(engine, sizes, seed=seed + 2)
        outputs = worker.run(requests).outputs
        for got, want in zip(outputs, _engine_pooled(engine, requests)):
            assert torch.equal(got, want)
    assert worker._host.grown == grown and worker.staging_bytes["host"] == nbytes
    assert worker._host.get("x", (1, engine.config.hidden_size), engine.model_dtype).data_ptr() == x_ptr
    assert worker.staging_bytes["device"] == 0  # CPU: no device copies
    assert worker.graph_layers == [] and worker.capture_graphs() == 0.0


def test_staging_views_are_made_once_per_shape() -> None:
    """A serving thread's torch calls cost GIL hand-overs under load: a view is made once per
    (name, shape, dtype), and a grown buffer's old views are never handed out again."""
    from lutb_server.worker import _Buffers

    bufs = _Buffers(torch.device("cpu"), pin=False)
    x = bufs.get("x", (4, 8), torch.float16)
    assert bufs.get("x", torch.Size([4, 8]), torch.float16) is x and bufs.get("x", (4, 8), torch.float32) is not x
    small = bufs.get("x", (1, 8), torch.float16)
    assert small.data_ptr() == x.data_ptr() and small.shape == (1, 8)
    big = bufs.get("x", (1024, 8), torch.float16)  # grows the buffer
    assert bufs.grown == 2 and big.data_ptr() != x.data_ptr()
    assert bufs.get("x", (4, 8), torch.float16).data_ptr() == big.data_ptr()  # a view of the new buffer
    bufs.MAX_VIEWS = 3
    for t in range(1, 6):
        assert bufs.get("y", (t,), torch.int32).shape == (t,)
    assert len(bufs._views) <= 3


def test_outputs_do_not_alias_the_staging_buffers(engine: ExpertEngine) -> None:
    worker = ComputeWorker(engine)
    first = worker.run(_requests(engine, [4, 4], seed=3)).outputs
    kept = [o.clone() for o in first]
    worker.run(_requests(engine, [4, 4], seed=4))
    for a, b in zip(first, kept):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("sizes", "k", "mode", "given"), [
    ([5], 2, "combined", [True]),
    ([3, 1, 7], 2, "combined", [True, False, True]),
    ([2, 4], 3, "route_major", [False, True]),
    ([0, 3], 2, "combined", [True, True]),
    ([4, 2], 2, "combined", [False, False]),
])
def test_outputs_go_into_their_destinations(engine: ExpertEngine, sizes: list[int], k: int, mode: str,
                                            given: list[bool]) -> None:
    """``run(into=)`` writes each output into its destination (poisoned before) and hands that tensor back;
    requests without one get tensors of their own, not views of anyone's destination."""
    worker = ComputeWorker(engine)
    requests = _requests(engine, sizes, k=k, mode=mode, seed=7 + sum(sizes))
    into = [torch.full(r.output_shape, float("nan"), dtype=engine.model_dtype) if g else None for r, g in zip(requests, given)]
    outputs = worker.run(requests, into).outputs
    for got, want, dest in zip(outputs, _engine_pooled(engine, requests), into):
        assert torch.equal(got, want)
        if dest is not None:
            assert got is dest
        else:
            assert all(other is None or got.data_ptr() != other.data_ptr() for other in into)
    kept = [o.clone() for o in outputs]
    worker.run(_requests(engine, sizes, k=k, mode=mode, seed=99), into)
    for got, want, dest in zip(outputs, kept, into):
        if dest is None:  # its own memory: the next batch does not overwrite it
            assert torch.equal(got, want)


@pytest.mark.parametrize("bad", ["count", "shape", "dtype", "broadcastable"])
def test_wrong_destinations_are_refused_before_computing(engine: ExpertEngine, bad: str) -> None:
    worker = ComputeWorker(engine)
    requests = _requests(engine, [3, 2], seed=11)
    h = engine.config.hidden_size
    into: list[torch.Tensor | None] = [torch.full((3, h), 7.0, dtype=engine.model_dtype), None]
    if bad == "count":
        into.append(None)
    elif bad == "shape":
        into[1] = torch.zeros(2, h + 1, dtype=engine.model_dtype)
    elif bad == "dtype":
        into[1] = torch.zeros(2, h, dtype=torch.float64)
    else:  # copy_ would broadcast one row into two silently
        into[1] = torch.zeros(1, h, dtype=engine.model_dtype)
    calls = worker.batches
    with pytest.raises(ValueError, match="into"):
        worker.run(requests, into)
    assert worker.batches == calls and bool((into[0] == 7.0).all())  # nothing ran, nothing written


def test_thread_submit_call_and_errors(engine: ExpertEngine) -> None:
    worker = ComputeWorker(engine).start()
    try:
        requests = _requests(engine, [2, 3], seed=5)
        outputs = worker.submit(requests).result(30).outputs
        for got, want in zip(outputs, _engine_pooled(engine, requests)):
            assert torch.equal(got, want)
        import threading

        assert worker.call(lambda: threading.current_thread().name).result(10) == "lutb-compute"
        bad = PreparedRequest(0, torch.zeros(2, 5), torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, 1), False, "combined")
        with pytest.raises(Exception):
            worker.submit([bad]).result(30)
        outputs = worker.submit(requests[:1]).result(30).outputs  # still alive after a failure
        assert outputs[0].shape == (2, engine.config.hidden_size)
    finally:
        worker.close(10)
    with pytest.raises(RuntimeError):
        worker.submit(requests)


def test_a_batch_whose_deadline_passed_while_it_waited_is_not_run(engine: ExpertEngine) -> None:
    """``submit(requests, deadline)``: a batch still queued behind another when its deadline passes fails with
    DeadlineExpired and does not run; one whose deadline is ahead runs."""
    import threading

    from lutb_server.errors import DeadlineExpired

    worker = ComputeWorker(engine).start()
    try:
        requests = _requests(engine, [2], seed=6)
        gate = threading.Event()
        blocker = worker.call(gate.wait, 10)  # holds the worker thread
        late = worker.submit(requests, time.monotonic() + 0.02)
        timely = worker.submit(requests, time.monotonic() + 60)
        time.sleep(0.05)
        calls = worker.batches
        gate.set()
        assert blocker.result(10)
        with pytest.raises(DeadlineExpired, match="not computed"):
            late.result(10)
        assert torch.equal(timely.result(30).outputs[0], _engine_pooled(engine, requests)[0])
        assert worker.batches == calls + 1  # only the timely one ran
    finally:
        worker.close(10)


@pytest.mark.parametrize("limit, sizes", [(0, []), (1, [1]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12])])
def test_warm_up_sizes_are_powers_of_two_then_the_limit(limit: int, sizes: list[int]) -> None:
    from lutb_server.worker import _powers_of_two_upto

    assert _powers_of_two_upto(limit) == sizes


@pytest.mark.parametrize(("above", "limit", "keys", "sizes"), [
    (0, 0, None, []),
    (512, 512, None, []),
    (64, 512, None, [128, 256, 512]),
    (64, 600, None, [128, 256, 512, 600]),
    # a key that changes inside a power-of-two range: its smallest size joins
    (64, 512, lambda t, k: 700 < t * k <= 800, [128, 256, 351, 512]),
    (64, 512, lambda t, k: (t > 300, t % 200 < 5), [128, 200, 256, 400, 512]),
    (64, 512, lambda t, k: 0, [128, 256, 512]),
])
def test_warm_up_sizes_meet_every_launch_key(above: int, limit: int, keys, sizes: list[int]) -> None:  # noqa: ANN001
    from lutb_server.worker import warm_up_sizes

    got = warm_up_sizes(above, limit, keys, 2)
    assert got == sizes
    if keys is not None:
        assert {keys(t, 2) for t in range(above + 1, limit + 1)} == {keys(t, 2) for t in got}


def test_warm_up_is_a_no_op_on_the_cpu(engine: ExpertEngine) -> None:
    worker = ComputeWorker(engine).start()
    try:
        assert worker.call(worker.warm_up, 4096).result(timeout=30) == 0.0
    finally:
        worker.close()


@pytest.mark.gpu
def test_warm_up_runs_every_eager_size_on_the_gpu(tiny_checkpoint: Path) -> None:
    from lutb_kernels.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("auto", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=16).start()  # graphs to 16, their chunks to 128
    try:
        assert worker.call(worker.warm_up, 512).result(timeout=300) > 0.0  # eager 256 and 512 at least
        requests = _requests(gpu_engine, [300], k=2)
        outputs = worker.submit(requests).result(timeout=60).outputs
        assert outputs[0].shape == (300, gpu_engine.config.hidden_size) and torch.isfinite(outputs[0].float()).all()
    finally:
        worker.close()


@pytest.mark.gpu
def test_no_eager_batch_size_compiles_after_the_warm_up(tiny_checkpoint: Path) -> None:
    """Batches of sizes the warm-up did not run (other classes of divisibility by 16 of rows,
    routes and routing blocks) reuse its kernels: a compile would stall them for seconds."""
    import triton

    from lutb_kernels.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=16, cuda_graph_top_k=2).start()
    compiled: list[str] = []

    def hook(*, fn, **_: object) -> bool:
        compiled.append(fn.name)
        return False

    previous = triton.knobs.runtime.jit_cache_hook
    try:
        worker.call(worker.capture_graphs).result(timeout=300)  # the server's start-up: graphs to 16 tokens (chunks to 128),
        worker.call(worker.warm_up, 512).result(timeout=300)  # then eager sizes 256, 512 and other launch keys
        triton.knobs.runtime.jit_cache_hook = hook
        for tokens in (65, 200, 300, 333, 480, 511):  # 65: chunks of graphs; the rest eager
            got = worker.submit(_requests(gpu_engine, [tokens], k=2, seed=tokens)).result(timeout=120).outputs[0]
            assert got.shape == (tokens, gpu_engine.config.hidden_size) and torch.isfinite(got.float()).all()
        for tokens in (3, 65, 300):  # MXFP8 input carried to the device: its dequantization was compiled too
            got = worker.submit(_mxfp8_requests(gpu_engine, [tokens], seed=tokens)[0]).result(timeout=120).outputs[0]
            assert got.shape == (tokens, gpu_engine.config.hidden_size) and torch.isfinite(got.float()).all()
        assert compiled == []
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
        worker.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
def test_a_nonfinite_batch_fails_alone_on_the_gpu(tiny_checkpoint: Path, tokens: int) -> None:
    """The device NaN/Inf flag is reset only after a batch that set it: that batch raises,
    the batches before and after it (same graph, chunks or eager size) come back right."""
    import dataclasses

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.errors import NonFiniteInputError

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    good = _requests(gpu_engine, [tokens], k=2, seed=tokens)
    bad_x = good[0].x.clone()
    bad_x[tokens // 2, 3] = float("nan")  # past the engine's validation, as an overflow inside the layer would be
    bad = [dataclasses.replace(good[0], x=bad_x)]
    want = worker.run(good).outputs[0]  # the graph's padding may change the kernels' sums: compare within the worker
    eager = _engine_pooled(gpu_engine, good)[0].float()
    assert not want.is_pinned() and torch.linalg.norm(want.float() - eager) <= 1e-2 * torch.linalg.norm(eager)
    for _ in range(2):
        with pytest.raises(NonFiniteInputError):
            worker.run(bad)
        assert torch.equal(worker.run(good).outputs[0], want)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
def test_outputs_go_into_their_destinations_on_the_gpu(tiny_checkpoint: Path, tokens: int) -> None:
    """On the device the outputs are copied from the pinned staging straight into their destinations: equal to
    the outputs of a run without them, and a request without a destination gets memory of its own (not the
    pinned staging, which the next batch overwrites)."""
    from lutb_kernels.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    requests = _requests(gpu_engine, [tokens, 3, tokens // 2], k=2, seed=tokens)
    want = worker.run(requests).outputs
    into = [torch.full(r.output_shape, float("nan"), dtype=gpu_engine.model_dtype) for r in requests]
    into[1] = None
    got = worker.run(requests, into).outputs
    assert got[0] is into[0] and got[2] is into[2] and not got[1].is_pinned()
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    kept = got[1].clone()
    worker.run(_requests(gpu_engine, [tokens, 3, tokens // 2], k=2, seed=tokens + 1), [None, None, None])
    assert torch.equal(got[1], kept)


@pytest.mark.parametrize("sizes", [[5], [3, 1, 7], [0, 4]])
def test_mxfp8_carried_as_sent_gives_the_dequantized_results(engine: ExpertEngine, sizes: list[int]) -> None:
    """Batches of MXFP8 input carried as sent (off CUDA the worker dequantizes them itself) compute exactly what
    the engine's dequantized requests do, into poisoned destinations too."""
    carried, dense = _mxfp8_requests(engine, sizes, seed=sum(sizes))
    assert all(r.x_scales is None and r.x.dtype == engine.model_dtype for r in dense)  # a CPU engine dequantizes
    want = ComputeWorker(engine).run(dense).outputs
    into = [torch.full(r.output_shape, float("nan"), dtype=engine.model_dtype) for r in carried]
    for got in (ComputeWorker(engine).run(carried).outputs, ComputeWorker(engine).run(carried, into).outputs):
        for g, w in zip(got, want):
            assert g.dtype == engine.model_dtype and torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
def test_mxfp8_input_is_dequantized_on_the_gpu(tiny_checkpoint: Path, tokens: int) -> None:
    """A CUDA engine carries MXFP8 input to the device as sent; the worker's results equal those of the same
    input dequantized on the CPU, bit for bit, on every path."""
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.mxfp8 import mxfp8_dequantize

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    carried, _ = _mxfp8_requests(gpu_engine, [tokens, 3], seed=tokens + 11)
    prepared = [gpu_engine.prepare(0, r.x, r.topk_ids, r.topk_weights, hidden_scales=r.x_scales) for r in carried]
    assert all(p.x_scales is not None and p.x.dtype == torch.float8_e4m3fn for p in prepared)  # carried as sent
    dense = [gpu_engine.prepare(0, mxfp8_dequantize(r.x, r.x_scales, gpu_engine.model_dtype), r.topk_ids, r.topk_weights)
             for r in carried]
    want = worker.run(dense).outputs
    into = [torch.full(r.output_shape, float("nan"), dtype=gpu_engine.model_dtype) for r in prepared]
    result = worker.run(prepared, into)
    assert result.path == {5: "graph", 100: "chunks", 600: "eager"}[tokens]  # the batch holds 3 tokens more
    if result.path != "eager":  # the rows' dequantization graphs ran
        assert any(entry.rows.dequantized and entry.rows.dequantize_graph is not None
                   for entry in worker._experts[0]._entries.values())
    for g, w in zip(result.outputs, want):
        assert torch.equal(g, w)


def test_registering_host_memory_is_a_no_op_off_cuda(engine: ExpertEngine) -> None:
    """Off CUDA nothing is page-locked and destinations inside the memory are still written (by the CPU)."""
    worker = ComputeWorker(engine)
    requests = _requests(engine, [3, 2], seed=13)
    memory = torch.full((2 * 5 * engine.config.hidden_size,), float("nan"), dtype=engine.model_dtype)
    assert worker.register_host_memory(memory) is False
    worker.unregister_host_memory(memory)  # not registered: nothing to undo
    into = [memory[:3 * engine.config.hidden_size].view(3, -1), None]
    got = worker.run(requests, into).outputs
    assert got[0] is into[0]
    for g, w in zip(got, _engine_pooled(engine, requests)):
        assert torch.equal(g, w)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
def test_outputs_reach_registered_memory_by_dma(tiny_checkpoint: Path, tokens: int) -> None:
    """Destinations inside a registered shared arena are written by the device's copy engine, others through the
    staging, in any mix; nothing outside the destinations is written; after unregistering, the staging again."""
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.shared_arena import SharedArena, dtype_name

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    requests = _requests(gpu_engine, [tokens, 3, tokens // 2 + 1, 7], k=2, seed=tokens)
    want = worker.run(requests).outputs
    arena = SharedArena.create(4 * sum(r.tokens for r in requests) * gpu_engine.config.hidden_size * 2 + (1 << 16))
    try:
        assert worker.register_host_memory(arena.memory) is True
        assert worker.register_host_memory(arena.memory) is True  # twice: no second registration
        assert arena.memory.is_pinned()
        dtype = dtype_name(gpu_engine.model_dtype)

        def slots(mask: list[str]) -> list[torch.Tensor | None]:
            arena.memory.fill_(0xFF)  # bf16 NaN everywhere
            into: list[torch.Tensor | None] = []
            offset = 4096
            for r, kind in zip(requests, mask):
                if kind == "arena":
                    into.append(arena.view((offset, dtype, tuple(r.output_shape))))
                    offset += r.tokens * gpu_engine.config.hidden_size * 2 + 4096  # gaps stay poisoned
                else:
                    into.append(torch.full(r.output_shape, float("nan"), dtype=gpu_engine.model_dtype) if kind == "plain" else None)
            return into

        for mask in (["arena", "none", "arena", "plain"], ["arena"] * 4, ["plain", "arena", "none", "none"]):
            into = slots(mask)
            got = worker.run(requests, into).outputs
            for g, w, dest in zip(got, want, into):
                assert torch.equal(g, w)
                assert dest is None or g is dest
            arena_bytes = sum(d.numel() * 2 for d, k in zip(into, mask) if k == "arena")
            assert int((arena.memory != 0xFF).sum()) <= arena_bytes  # nothing outside the slots was written
        worker.unregister_host_memory(arena.memory)
        assert not arena.memory.is_pinned()
        into = slots(["arena", "none", "arena", "plain"])
        for g, w in zip(worker.run(requests, into).outputs, want):  # through the pinned staging again
            assert torch.equal(g, w)
    finally:
        worker.unregister_host_memory(arena.memory)
        arena.close()


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
@pytest.mark.parametrize("mxfp8", [False, True], ids=["bf16", "mxfp8"])
def test_inputs_in_registered_memory_go_to_the_device_from_there(tiny_checkpoint: Path, tokens: int, mxfp8: bool) -> None:
    """Requests whose x lies in a registered shared arena (a compute process's views) are copied to the device
    from there, one copy each, without the pinned staging; the outputs equal those of the same requests in plain
    memory; a batch with one x outside the arena goes through the staging as before; so does everything after
    unregistering."""
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_server.shared_arena import ALIGN, SharedArena, dtype_name

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    sizes = [tokens, 3, tokens // 2 + 1, 1]
    if mxfp8:
        plain, _ = _mxfp8_requests(gpu_engine, sizes, seed=tokens + 5)
    else:
        plain = _requests(gpu_engine, sizes, k=2, seed=tokens + 5)
    want = worker.run(plain).outputs
    hidden = gpu_engine.config.hidden_size
    arena = SharedArena.create(sum(sizes) * hidden * 2 + len(sizes) * 2 * ALIGN + (1 << 16))
    try:
        arena.memory.fill_(0xFF)  # poison between the slots
        in_arena, offset = [], ALIGN
        for r in plain:
            view = arena.view((offset, dtype_name(r.x.dtype), tuple(r.x.shape)))
            view.copy_(r.x)
            in_arena.append(PreparedRequest(r.layer, view, r.topk_ids, r.topk_weights, False, "combined",
                                            r.x_scales, r.x_dtype))
            offset += -(-r.x.numel() * r.x.element_size() // ALIGN) * ALIGN + ALIGN
        assert worker.register_host_memory(arena.memory) is True
        assert worker._registered_sources(in_arena) and not worker._registered_sources(plain)
        staged = worker._host._bufs.get("x")
        if staged is not None:
            staged.fill_(0xFF)  # the staging's x, poisoned: the direct path must neither read nor write it
        got = worker.run(in_arena).outputs
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        if staged is not None:
            assert worker._host._bufs["x"] is staged and bool((staged == 0xFF).all())
        mixed = [in_arena[0], plain[1], *in_arena[2:]]  # one x outside the arena: all through the staging
        assert not worker._registered_sources(mixed)
        for g, w in zip(worker.run(mixed).outputs, want):
            assert torch.equal(g, w)
        worker.unregister_host_memory(arena.memory)
        assert not worker._registered_sources(in_arena)
        for g, w in zip(worker.run(in_arena).outputs, want):
            assert torch.equal(g, w)
    finally:
        worker.unregister_host_memory(arena.memory)
        arena.close()


def test_a_worker_that_cannot_use_its_device_fails_jobs_instead_of_hanging(engine: ExpertEngine,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device: object) -> None:
        raise ValueError("no such device")

    monkeypatch.setattr(torch.cuda, "set_device", refuse)
    worker = ComputeWorker(engine)
    worker.cuda = True  # as if on a GPU: the thread calls torch.cuda.set_device first
    worker.start()
    try:
        with pytest.raises(ValueError, match="no such device"):
            worker.call(lambda: 1).result(timeout=10)
    finally:
        worker.close(10)


def test_overlap_runs_once_before_the_outputs_are_delivered(engine: ExpertEngine) -> None:
    """``run(overlap=)``: called exactly once per call (off CUDA, before the experts run), and the outputs are the same."""
    worker = ComputeWorker(engine)
    requests = _requests(engine, [3, 2], k=2, mode="combined", on_input=False, seed=5)
    calls: list[int] = []
    got = worker.run(requests, overlap=lambda: calls.append(worker.batches))
    assert calls == [0]  # before the call was counted
    for a, b in zip(got.outputs, ComputeWorker(engine).run(requests).outputs):
        assert torch.equal(a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [5, 100, 600], ids=["graph", "chunks", "eager"])  # graphs to 64, chunks to 512
def test_overlap_runs_while_the_device_works(tiny_checkpoint: Path, tokens: int) -> None:
    """On the device ``overlap`` runs once, after the call is queued and before the worker waits for it: the
    outputs' destinations are still poisoned when it runs, and the outputs equal a run without it."""
    from lutb_kernels.checkpoint import Checkpoint

    ckpt = Checkpoint(tiny_checkpoint)
    gpu_engine = ExpertEngine(ckpt, choose_backend("packed", ckpt.config, torch.device("cuda")), validate_tiles=False)
    worker = ComputeWorker(gpu_engine, cuda_graph_max_tokens=64, cuda_graph_top_k=2)
    requests = _requests(gpu_engine, [tokens, 3], k=2, seed=tokens + 7)
    want = worker.run(requests).outputs
    into = [torch.full(r.output_shape, float("nan"), dtype=gpu_engine.model_dtype) for r in requests]
    seen: list[tuple[int, bool]] = []
    got = worker.run(requests, into, overlap=lambda: seen.append((worker.batches, bool(into[0].isnan().all())))).outputs
    assert seen == [(1, True)]  # once, before the call was counted; a pageable destination is written after the wait
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_NAME is Linux's")
def test_the_worker_thread_carries_its_name_in_the_os(engine: ExpertEngine) -> None:
    """/proc (top -H, the benchmarks' per-thread CPU) shows the worker thread by its name, not the process's."""
    worker = ComputeWorker(engine, name="lutb-compute").start()
    try:
        worker.call(lambda: None).result(timeout=30)
        assert worker._thread is not None
        comm = Path(f"/proc/self/task/{worker._thread.native_id}/comm").read_text().strip()
        assert comm == "lutb-compute"
    finally:
        worker.close()


@pytest.mark.parametrize("forms", [["wire"], ["torch", "wire"], ["wire", "wire", "torch"], ["torch", "torch"]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.float32])
def test_staging_takes_wire_tensors_and_torch_tensors(forms: list[str], dtype: torch.dtype) -> None:
    """A batch's parts in either form land in the staging buffer where torch.cat puts them, over poison, also after
    the buffer grew; a size mismatch is refused."""
    from lutb_client.codec import WireTensor, encode_tensor
    from lutb_server.worker import _Buffers

    buffers = _Buffers(torch.device("cpu"), pin=False)
    for rows in (1, 5, 300):  # 300 rows grow the buffer past its first size
        whole = (torch.randn(rows * len(forms), 6) * 100).to(dtype)
        chunks = list(whole.split(rows))
        parts = [WireTensor.from_message(encode_tensor(c)) if f == "wire" else c for f, c in zip(forms, chunks)]
        buffers.get("x", (whole.shape[0] + 8, 6), dtype).fill_(7)  # poison
        got = buffers.fill("x", tuple(whole.shape), dtype, parts)
        assert torch.equal(got, whole) and got is buffers.get("x", tuple(whole.shape), dtype)
    if "wire" in forms:
        with pytest.raises(ValueError, match="bytes"):
            buffers.fill("x", (whole.shape[0] + 1, 6), dtype, parts)


def test_what_counts_as_registered_memory(engine: ExpertEngine) -> None:
    """The predicates behind the DMA paths (their copies run on CUDA only): a contiguous CPU tensor wholly inside a
    registered span counts; one straddling its end, a strided view, a WireTensor or anything outside does not."""
    from lutb_client.codec import WireTensor, encode_tensor

    worker = ComputeWorker(engine)
    big = torch.zeros(8192, dtype=torch.uint8)
    memory = big[:4096]  # the registered span: the first half
    inside = memory[256:1280].view(torch.bfloat16).view(8, 64)
    straddling = big[4000:4200]
    outside = torch.zeros(8, 64, dtype=torch.bfloat16)
    assert not worker._in_registered(inside)  # nothing registered yet
    worker._registered[memory.data_ptr()] = memory.data_ptr() + memory.numel()  # as register_host_memory records it
    assert worker._in_registered(inside) and worker._in_registered(memory)
    assert not worker._in_registered(memory[4000:].view(torch.uint8).unsqueeze(0).expand(2, -1))  # not contiguous
    assert not worker._in_registered(inside.t())
    assert not worker._in_registered(outside) and not worker._in_registered(straddling)
    assert not worker._in_registered(WireTensor.from_message(encode_tensor(outside)))
    assert worker._by_dma([inside, None, outside]) == [True, False, False]
    assert worker._by_dma([outside, None]) is None and worker._by_dma(None) is None
    r = _requests(engine, [8], seed=2)[0]
    in_memory = PreparedRequest(r.layer, memory[:8 * 128 * 2].view(torch.bfloat16).view(8, 128), r.topk_ids,
                                r.topk_weights, False, "combined")
    assert worker._registered_sources([in_memory, in_memory]) and not worker._registered_sources([in_memory, r])
