"""The server on a GPU: compute worker (pinned staging, one stream; thread or process), CUDA graphs captured before SERVING, MXFP8 wire.

Run on the device (``bench/serving_device.sh``); every test here skips without CUDA.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lutb_client import ExpertClient
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.experts.graphs import CudaGraphExperts, GraphKey
from lutb_kernels.experts.reference import ReferenceExperts
from lutb_kernels.reference import rel_l2
from lutb_server.testing import ServerThread, make_tiny_checkpoint

pytestmark = pytest.mark.gpu
H, E = 256, 16


def _batch(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, E, generator=gen).topk(k, dim=1).indices.to(torch.int32)
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=1)
    return x, ids, w


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "ckpt", layers=(0,), num_experts=E, hidden=H, intermediate=256, seed=7)


@pytest.fixture(scope="module")
def reference(checkpoint: Path) -> ReferenceExperts:
    ckpt = Checkpoint(checkpoint)
    return ReferenceExperts(ckpt.config, ckpt.layer(0), "cuda")


@pytest.fixture(scope="module", params=["packed", "emulated"])
def servers(request: pytest.FixtureRequest, checkpoint: Path) -> Iterator[tuple[ServerThread, ServerThread]]:
    """The same backend with CUDA graphs (buckets up to 64, top-k 4 captured at start-up) and without."""
    common = dict(checkpoint=checkpoint, backend=request.param, device="cuda", max_wait_us=0)
    with ServerThread(cuda_graph_max_tokens=64, cuda_graph_top_k=4, **common) as graphs, \
            ServerThread(cuda_graph_max_tokens=0, **common) as eager:
        yield graphs, eager


def test_graphs_captured_before_serving(servers: tuple[ServerThread, ServerThread]) -> None:
    graphs, eager = servers
    worker = graphs.server.scheduler.worker
    assert worker.graph_layers == [0], "backend must declare capture_safe = True for CUDA graphs"
    experts = worker._experts[0]
    assert isinstance(experts, CudaGraphExperts)
    assert experts.graphs == {GraphKey(b, 4, False, "combined"): True for b in (1, 2, 4, 8, 16, 32, 64)}
    assert all(e.rows.dequantize_graph is not None for e in experts._entries.values())  # MXFP8 input's, per bucket
    assert eager.server.scheduler.worker.graph_layers == []


@pytest.mark.parametrize(("tokens", "k", "mode"), [(1, 4, "combined"), (5, 4, "combined"), (64, 4, "combined"),
                                                   (100, 4, "combined"), (600, 4, "combined"), (3, 2, "route_major"),
                                                   (17, 1, "combined")])  # graphs to 64; 100: chunks; 600 > 8 x 64: eager
def test_outputs_match_reference_and_eager(servers: tuple[ServerThread, ServerThread], reference: ReferenceExperts,
                                           tokens: int, k: int, mode: str) -> None:
    graphs, eager = servers
    x, ids, w = _batch(tokens, k, seed=tokens * 10 + k)
    with ExpertClient(graphs.address) as g, ExpertClient(eager.address) as e:
        out_g, out_e = g.forward(0, x, ids, w, output_mode=mode), e.forward(0, x, ids, w, output_mode=mode)
    want = reference.forward(x.cuda(), ids.cuda(), w.cuda(), output_mode=mode).cpu()
    assert out_g.shape == want.shape == out_e.shape and not out_g.isnan().any()
    assert rel_l2(out_g, want) <= 1e-2 and rel_l2(out_e, want) <= 1e-2
    experts = graphs.server.scheduler.worker._experts[0]
    if tokens <= 64:
        assert experts.graphs[experts.key_for(tokens, k, False, mode)]  # rarer variants are captured on first use
    path = experts.path_for(tokens, k, False, mode)  # graph up to 64, chunks up to 512, eager above
    assert path == ("graph" if tokens <= 64 else "chunks" if tokens <= 512 else "eager")
    labels = {"backend": experts.name, "layer": "0", "path": path}
    assert graphs.server.metrics.registry.get_sample_value("lutb_batches_total", labels) >= 1


def test_pinned_staging_and_pooling(servers: tuple[ServerThread, ServerThread], reference: ReferenceExperts) -> None:
    graphs, _ = servers
    batches = [_batch(4, 4, seed=100 + i) for i in range(32)]
    results: list[tuple[int, torch.Tensor, int]] = []
    lock = threading.Lock()

    def call(i: int) -> None:
        with ExpertClient(graphs.address) as client:
            res = client.forward_detailed(0, *batches[i])
        with lock:
            results.append((i, res.output, int(res.timing.batch_tokens)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 32
    for i, out, _ in results:
        x, ids, w = batches[i]
        assert rel_l2(out, reference.forward(x.cuda(), ids.cuda(), w.cuda()).cpu()) <= 1e-2
    worker = graphs.server.scheduler.worker
    assert all(buf.is_pinned() for buf in worker._host._bufs.values())
    assert worker._dev.device.type == "cuda"


def test_mxfp8_wire_on_gpu(servers: tuple[ServerThread, ServerThread], reference: ReferenceExperts) -> None:
    graphs, eager = servers
    experts = graphs.server.scheduler.worker._experts[0]
    replays = lambda: sum(e.rows.dequantized for e in experts._entries.values())  # noqa: E731 - shared rows: some twice
    before = replays()
    x, ids, w = _batch(16, 4, seed=3)
    with ExpertClient(graphs.address, wire="mxfp8") as mx, ExpertClient(graphs.address) as native:
        got, plain = mx.forward(0, x, ids, w), native.forward(0, x, ids, w)
        got_dev = mx.forward(0, x.cuda(), ids.cuda(), w.cuda())  # quantized on the GPU by the client
    assert replays() >= before + 2  # dequantized by the rows' graphs
    assert torch.equal(got, got_dev) or rel_l2(got, got_dev) <= 1e-2
    # Equal inputs after the server's dequantization; bit-equal unless the kernels' split-K atomics reorder.
    assert rel_l2(got, plain) <= 1e-2
    assert rel_l2(got, reference.forward(x.cuda(), ids.cuda(), w.cuda()).cpu()) <= 1e-2
    for tokens in (5, 100, 600):  # one graph, chunks of graphs, eager: as the server without graphs computes it
        x, ids, w = _batch(tokens, 4, seed=tokens + 5)
        with ExpertClient(graphs.address, wire="mxfp8") as g, ExpertClient(eager.address, wire="mxfp8") as e:
            in_graphs, eagerly = g.forward(0, x, ids, w), e.forward(0, x, ids, w)
        assert torch.equal(in_graphs, eagerly) or rel_l2(in_graphs, eagerly) <= 1e-2, tokens
        assert rel_l2(in_graphs, reference.forward(x.cuda(), ids.cuda(), w.cuda()).cpu()) <= 1e-2, tokens


@pytest.mark.parametrize("backend", ["packed", "emulated"])
def test_compute_process_serves_like_the_thread(checkpoint: Path, reference: ReferenceExperts, backend: str) -> None:
    """compute_worker = "process": the child owns the GPU (graphs captured there before SERVING), same outputs."""
    common = dict(checkpoint=checkpoint, backend=backend, device="cuda", max_wait_us=0, cuda_graph_max_tokens=64, cuda_graph_top_k=4)
    with ServerThread(compute_worker="process", **common) as process, ServerThread(**common) as thread:
        assert process.server.engine.weight_bytes == 0  # no weights in the serving process
        for tokens, k in ((1, 4), (17, 4), (100, 2)):
            x, ids, w = _batch(tokens, k, seed=tokens + 1000)
            with ExpertClient(process.address) as p, ExpertClient(thread.address) as t:
                out_p, out_t = p.forward(0, x, ids, w), t.forward(0, x, ids, w)
            want = reference.forward(x.cuda(), ids.cuda(), w.cuda()).cpu()
            assert torch.equal(out_p, out_t), (backend, tokens)
            assert rel_l2(out_p, want) <= 1e-2
            with ExpertClient(process.address, wire="mxfp8") as p, ExpertClient(thread.address, wire="mxfp8") as t:
                mx_p, mx_t = p.forward(0, x, ids, w), t.forward(0, x, ids, w)  # carried as sent to the child's device
            assert torch.equal(mx_p, mx_t), (backend, tokens, "mxfp8")
            assert rel_l2(mx_p, want) <= 1e-2


def test_front_ends_share_one_compute_process_on_the_gpu(checkpoint: Path, reference: ReferenceExperts) -> None:
    """``lutb serve --front-ends 2``: right answers through either front end (their outputs copied by the GPU into
    each front end's page-locked arena), and only the compute process holds a CUDA context (the front ends validate
    and batch on the CPU; a context each would cost GPU memory). With ``--compute-cpu auto`` (a CPU of its own where
    the machine has 3 or more): CUDA runs in the pinned process."""
    import re
    import subprocess

    from lutb_server.testing import ServeProcess

    serving = ServeProcess("--checkpoint", str(checkpoint), "--backend", "packed", "--device", "cuda", "--compute-worker",
                           "process", "--front-ends", "2", "--no-validate-checkpoint", "--cuda-graph-max-tokens", "64",
                           "--cuda-graph-top-k", "4", "--compute-cpu", "auto").wait_ready(300)
    try:
        for seed in range(8):  # own connection each: the kernel spreads them over the front ends
            x, ids, w = _batch(1 + 7 * seed, 4, seed=seed + 500)
            with ExpertClient(serving.address, channel_options=[("grpc.use_local_subchannel_pool", 1)]) as client:
                assert rel_l2(client.forward(0, x, ids, w), reference.forward(x.cuda(), ids.cuda(), w.cuda()).cpu()) <= 1e-2
        assert sum("page-locked a serving process's arena" in line for line in serving.lines) == 2  # outputs by DMA
        compute = int(next(m for m in (re.search(r"compute process (\d+) ready", line) for line in serving.lines) if m).group(1))
        front_ends = [int(p) for p in re.search(r"pids \[([\d, ]+)\]", next(
            line for line in serving.lines if "front ends 1-1 started" in line)).group(1).split(",")]  # type: ignore[union-attr]
        smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True, text=True)
        if smi.returncode == 0 and smi.stdout.strip():  # containers may hide other processes' pids: then nothing to check
            pids = {int(p) for p in smi.stdout.split()}
            assert compute in pids and not pids & {serving.pid, *front_ends}, (pids, compute, serving.pid, front_ends)
        assert serving.stop(60) == 0, "".join(serving.lines[-30:])
    finally:
        serving.kill()


def test_lutb_check_passes_against_the_reference(servers: tuple[ServerThread, ServerThread], checkpoint: Path,
                                                 tmp_path: Path) -> None:
    """``lutb check --suite all`` of the GPU backend (graphs and eager) against the CPU reference: the per-row bound of
    ``heavy_tailed`` and ``magnitudes/*`` and the zero-row rule must not fail a correct GPU node."""
    import json

    from lutb_server.cli import build_parser

    for server, name in zip(servers, ("graphs", "eager")):
        report = tmp_path / f"{name}.json"
        args = build_parser().parse_args(["check", server.address, "--checkpoint", str(checkpoint), "--suite", "all",
                                          "--device", "cpu", "--json", str(report)])
        code = args.run(args)
        assert code in (0, 1), (name, code)  # 2: the check could not run (its reason is on stderr)
        data = json.loads(report.read_text())
        assert code == 0 and data["verdict"] == "pass", (name, json.dumps(data)[:4000])
