"""bench/serving.py --layers N: a checkpoint of N layers, and payloads each caller sends layer 0, 1, .., N-1 in turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]


def _serving(monkeypatch: pytest.MonkeyPatch) -> Any:
    return load_bench("serving.py", monkeypatch)


@pytest.mark.parametrize("wire", ["bf16", "mxfp8"])
def test_payload_p_targets_layer_p_mod_layers_and_each_caller_walks_the_layers(wire: str,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """make_requests(..., layers=3): DISTINCT_REQUESTS payloads per layer, payload p for layer p % 3 (tensors and mx
    beside it); a caller walking payloads[i % len] from its index (as _run_load's caller does) sends layers in
    order from its own starting layer. With one layer (the default) each payload is its own tensors' request for layer 0."""
    from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
    from lutb_client.client import build_request

    serving = _serving(monkeypatch)
    shape = serving.SHAPES["smoke"]
    reqs = serving.make_requests(shape, 2, wire, dtype=torch.bfloat16, scale_mode="rceil", seed=2, layers=3)
    assert len(reqs.payloads) == len(reqs.tensors) == len(reqs.mx) == 3 * serving.DISTINCT_REQUESTS
    decoded = [pb.ForwardRequest.FromString(p) for p in reqs.payloads]
    assert [r.layer for r in decoded] == [p % 3 for p in range(len(decoded))]
    assert [r.request_id for r in decoded] == list(range(1, len(decoded) + 1))
    assert all(r.hidden_states.shape == [2, shape["hidden"]] for r in decoded)
    for caller in range(5):
        sent = [decoded[i % len(decoded)].layer for i in range(caller, caller + 7)]
        assert sent == [(caller + k) % 3 for k in range(7)]
    one = serving.make_requests(shape, 2, wire, dtype=torch.bfloat16, scale_mode="rceil", seed=2)
    assert len(one.payloads) == serving.DISTINCT_REQUESTS
    for i, (payload, (x, ids, w), mx) in enumerate(zip(one.payloads, one.tensors, one.mx)):  # each payload: its tensors, layer 0
        if wire == "mxfp8":
            again = build_request(0, mx[0], ids, w, request_id=i + 1, hidden_scales=mx[1])
        else:
            again = build_request(0, x, ids, w, request_id=i + 1)
        assert payload == again.SerializeToString()
    with pytest.raises(ValueError, match="layers"):
        serving.make_requests(shape, 2, wire, dtype=torch.bfloat16, scale_mode="rceil", seed=2, layers=0)


def test_checkpoint_of_several_layers_has_its_own_cache_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """make_checkpoint(..., layers=2): layers 0 and 1, each its own tiles, layer 0 that of the single-layer
    checkpoint, cached as <name>-L2 beside the unchanged single-layer name."""
    from lutb_kernels.checkpoint import Checkpoint

    serving = _serving(monkeypatch)
    one = serving.make_checkpoint(tmp_path, "smoke", dtype="bfloat16", scale_mode="rceil", device="cpu")
    two = serving.make_checkpoint(tmp_path, "smoke", dtype="bfloat16", scale_mode="rceil", device="cpu", layers=2)
    assert (one.name, two.name) == ("smoke-bfloat16-rceil", "smoke-bfloat16-rceil-L2")
    a, b = Checkpoint(one), Checkpoint(two)
    assert a.layers == [0] and b.layers == [0, 1]
    assert torch.equal(a.layer(0).w13, b.layer(0).w13)
    assert not torch.equal(b.layer(0).w13, b.layer(1).w13)
    assert serving.make_checkpoint(tmp_path, "smoke", dtype="bfloat16", scale_mode="rceil", device="cpu", layers=2) == two


def test_serving_bench_smoke_over_layers(tmp_path: Path) -> None:
    """bench/serving.py --smoke --layers 2: every request answered, batches formed, layers in settings and header."""
    out = tmp_path / "out"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / d) for d in ("kernels", "client", "server")] + [env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "serving.py"), "--smoke", "--out", str(out), "--layers", "2",
                           "--concurrency", "3", "--tokens", "4", "--wires", "bf16", "--apis", "stream", "--duration-s", "0.2",
                           "--warmup-s", "0.05"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "serving.json").read_text())
    assert report["settings"]["layers"] == 2
    assert report["servers"]["smoke"]["checkpoint"].endswith("smoke-bfloat16-rceil-L2")
    (row,) = report["rows"]
    assert row["server"]["requests"] > 0 and row["server"]["error_count"] == 0 and row["server"]["batch_tokens_p50"] >= 4
    assert row["inproc"]["us"] > 0
    # the in-process baseline loaded the single-layer checkpoint (its tiles are layer 0's), not every layer
    assert any((out / "checkpoints" / "smoke-bfloat16-rceil").glob("*.safetensors"))
    assert "2 MoE layer(s) per shape" in (out / "serving.md").read_text().splitlines()[0]
