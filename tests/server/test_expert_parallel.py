"""Expert-parallel serving, server side: shard servers serve their subsets, expert-load metrics,
`lutb load` into `lutb shard --placement balanced`.

Three `lutb serve` processes (started once for the module) hold the contiguous shards of a
float32 synthetic checkpoint (2 layers, 6 experts, H = I = 128) with expert metrics on (two
by flag, one by LUTB_EXPERT_METRICS); an in-process server holding the whole checkpoint
(expert metrics off) is the single-server reference.
"""

from __future__ import annotations

import json
import signal
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from lutb_client import ExpertClient, ShardedExpertClient
from lutb_kernels.sharding import balanced_placement, read_load_file
from lutb_kernels.synth import make_synthetic_checkpoint
from lutb_server.cli import main as lutb
from lutb_server.cli.load_cmd import metrics_url, scrape_expert_tokens
from lutb_server.expert_load import ExpertLoad
from lutb_server.settings import load_settings
from lutb_server.testing import ServeProcess, ServerThread, free_port

E, H = 6, 128


@dataclass
class Deployment:
    whole: Path
    procs: list[ServeProcess]
    metrics: list[str]  # metrics URL per process
    plan: dict[int, list[list[int]]]
    single: ServerThread
    single_metrics: str

    @property
    def targets(self) -> list[str]:
        return [p.address for p in self.procs]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    root = tmp_path_factory.mktemp("ep")
    whole = make_synthetic_checkpoint(root / "whole", layers=2, experts=E, hidden=H, intermediate=H, dtype="float32", seed=4)
    assert lutb(["shard", str(whole), "--out", str(root / "shards"), "--shards", "3"]) == 0
    manifest = json.loads((root / "shards" / "shards.json").read_text())
    plan = {int(k): v for k, v in manifest["layers"].items()}
    ports = [free_port() for _ in range(3)]
    procs = []
    for s, port in enumerate(ports):
        args = ["--checkpoint", str(root / "shards" / f"shard-{s}"), "--backend", "reference", "--metrics-port", str(port)]
        env = {"OMP_NUM_THREADS": "1", **({"LUTB_EXPERT_METRICS": "true"} if s == 2 else {})}
        procs.append(ServeProcess(*args, *(["--expert-metrics"] if s != 2 else []), env=env))
    single_port = free_port()
    single = ServerThread(checkpoint=whole, backend="reference", metrics_port=single_port)
    try:
        single.start()
        for p in procs:
            p.wait_ready()
        yield Deployment(whole, procs, [f"127.0.0.1:{p}" for p in ports], plan, single, f"127.0.0.1:{single_port}")
    finally:
        for p in procs:
            p.kill()
        single.stop()


def _scrape(url: str) -> dict[int, dict[int, float]]:
    return scrape_expert_tokens(metrics_url(url, ""), timeout=10)


def _batch(tokens: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)]).to(torch.int32)
    return torch.randn(tokens, H, generator=gen), ids, torch.rand(tokens, k, generator=gen)


def test_shard_servers_report_and_serve_their_subsets(deployment: Deployment) -> None:
    x, ids, w = _batch(40, 3, seed=1)
    with ExpertClient(deployment.single.address) as single:
        expected = single.forward(0, x, ids, w)
    total = torch.zeros(40, H)
    for s, target in enumerate(deployment.targets):
        with ExpertClient(target) as client:
            info = client.model_info()
            assert [list(layer.expert_ids) for layer in info.layers] == [deployment.plan[0][s], deployment.plan[1][s]]
            assert info.num_experts == E
            total += client.forward(0, x, ids, w)  # the whole request: routes held elsewhere add zero
            foreign = [e for e in range(E) if e not in deployment.plan[0][s]][:2]
            zero = client.forward(0, x[:5], torch.tensor([foreign] * 5, dtype=torch.int32), w[:5, :2])
            assert torch.equal(zero, torch.zeros(5, H))
    assert float((total - expected).norm() / expected.norm()) <= 1e-5


def test_expert_metrics_are_off_by_default(deployment: Deployment) -> None:
    assert load_settings({}).expert_metrics is False
    with urllib.request.urlopen(f"http://{deployment.single_metrics}/metrics", timeout=10) as response:
        assert "lutb_expert_tokens" not in response.read().decode()
    with pytest.raises(LookupError, match="start the server with --expert-metrics"):
        _scrape(deployment.single_metrics)


def test_expert_load_counts_match_the_routes_sent(deployment: Deployment) -> None:
    before = [_scrape(url) for url in deployment.metrics]
    x, ids, w = _batch(64, 4, seed=2)
    with ShardedExpertClient(deployment.targets) as client:
        client.forward(1, x, ids, w)
        client.forward(0, x[:10], ids[:10], w[:10], output_mode="route_major")
    after = [_scrape(url) for url in deployment.metrics]
    for s in range(3):
        for layer, sent in ((1, ids), (0, ids[:10])):
            held = deployment.plan[layer][s]
            assert sorted(after[s][layer]) == held  # one series per held expert
            counts = torch.bincount(sent.flatten().long(), minlength=E)
            for e in held:
                assert after[s][layer][e] - before[s].get(layer, {}).get(e, 0.0) == counts[e], (s, layer, e)


def test_expert_load_ignores_routes_to_experts_held_elsewhere() -> None:
    class Engine:
        layer_ids = [3]
        config = type("Config", (), {"num_experts": 5})()

        def expert_ids(self, layer: int) -> list[int]:
            return [1, 4]

    class Request:
        layer = 3
        topk_ids = torch.tensor([[1, 0], [4, 1], [2, 3]], dtype=torch.int32)

    load = ExpertLoad()
    engine = Engine()
    load.record(engine, Request())
    load.record(engine, Request())
    assert load.snapshot() == {3: {1: 4, 4: 2}}
    samples = {tuple(sorted(s.labels.items())): s.value for f in load.collect() for s in f.samples}
    assert samples == {(("expert", "1"), ("layer", "3")): 4.0, (("expert", "4"), ("layer", "3")): 2.0}


def test_lutb_load_then_balanced_shard_round_trip(deployment: Deployment, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = torch.Generator().manual_seed(3)
    hot = torch.tensor([0.02, 0.5, 0.03, 0.3, 0.05, 0.1])  # skewed routing: experts 1 and 3 hot
    ids = torch.stack([torch.multinomial(hot, 2, generator=gen) for _ in range(200)]).to(torch.int32)
    x, w = torch.randn(200, H, generator=gen), torch.rand(200, 2, generator=gen)
    with ShardedExpertClient(deployment.targets) as client:
        for layer in (0, 1):
            client.forward(layer, x, ids, w)
    out = tmp_path / "load.json"
    args = ["load", *deployment.targets, "--out", str(out)]
    for url in deployment.metrics:
        args += ["--metrics-url", url]
    assert lutb(args) == 0
    assert "wrote" in capsys.readouterr().out
    load = read_load_file(out)
    scraped = [_scrape(url) for url in deployment.metrics]
    for layer in (0, 1):
        assert load[layer] == [sum(s[layer].get(e, 0.0) for s in scraped) for e in range(E)]
        assert load[layer][1] > load[layer][0]
    shards = tmp_path / "balanced"
    assert lutb(["shard", str(deployment.whole), "--out", str(shards), "--shards", "2", "--placement", "balanced",
                 "--load", str(out)]) == 0
    manifest = json.loads((shards / "shards.json").read_text())
    for layer in (0, 1):
        placed = manifest["layers"][str(layer)]
        assert placed == balanced_placement(dict(enumerate(load[layer])), 2)
        assert not any(1 in part and 3 in part for part in placed)  # the two hottest are split


def test_lutb_load_refuses_servers_without_expert_metrics(deployment: Deployment, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "load.json"
    code = lutb(["load", deployment.single.address, "--out", str(out), "--metrics-url", deployment.single_metrics])
    assert code == 1 and not out.exists()
    assert "--expert-metrics" in capsys.readouterr().err
    assert lutb(["load", *deployment.targets[:2], "--out", str(out), "--metrics-url", deployment.metrics[0]]) == 2


def test_lutb_load_refuses_one_server_named_twice(deployment: Deployment, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """One server under two names (its ModelInfo.instance_id the same) would have its load summed twice."""
    out = tmp_path / "load.json"
    port = deployment.targets[0].rsplit(":", 1)[1]
    code = lutb(["load", deployment.targets[0], f"localhost:{port}", "--out", str(out),
                 "--metrics-url", deployment.metrics[0], "--metrics-url", deployment.metrics[0]])
    assert code == 1 and not out.exists()
    assert "are one server" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["0", "-1", "nan"])
def test_lutb_load_refuses_a_non_positive_timeout_as_a_usage_error(timeout: str, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--timeout 0 once reached the client and exited 1 (a failure), not 2 (bad usage)."""
    out = tmp_path / "load.json"
    with pytest.raises(SystemExit) as info:
        lutb(["load", "127.0.0.1:1", "--out", str(out), "--timeout", timeout])
    assert info.value.code == 2 and not out.exists()
    err = capsys.readouterr().err
    assert "--timeout" in err and "must be > 0" in err


def test_metrics_url_forms() -> None:
    assert metrics_url(None, "10.0.0.5:50051") == "http://10.0.0.5:9400/metrics"
    assert metrics_url("h:9500", "x:1") == "http://h:9500/metrics"
    assert metrics_url("https://h:9500/custom", "x:1") == "https://h:9500/custom"
    assert metrics_url("http://h:9500", "x:1") == "http://h:9500/metrics"


def test_sigterm_on_a_shard_drains_it_and_exits(deployment: Deployment) -> None:
    """Runs last: a shard leaving gracefully answers what it has, exits 0, and its experts become unavailable."""
    victim = deployment.procs[2]
    x, ids, w = _batch(8, 2, seed=5)
    with ShardedExpertClient(deployment.targets, timeout=10) as client:
        client.forward(0, x, ids, w)
        victim.proc.send_signal(signal.SIGTERM)
        assert victim.proc.wait(30) == 0
        only_there = torch.tensor([[deployment.plan[0][2][0]]] * 8, dtype=torch.int32)
        with pytest.raises(Exception) as err:
            client.forward(0, x, only_there, w[:, :1])
        assert "layer 0" in str(err.value) and "no live shard" in str(err.value) and "UNAVAILABLE" in str(err.value)
