"""`lutb_client.check` against real servers on loopback: a faulty expert is named, identical nodes pass,
records replay to the same verdict, the JSON report has its documented keys."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from lutb_client.check import NodeSide, ReferenceSide, open_recording, record_node, run_check
from lutb_client.check.report import SCHEMA
from lutb_kernels.checkpoint import Checkpoint, LayerWeights, write_checkpoint
from lutb_server.testing import ServerThread, make_tiny_checkpoint

BAD_LAYER, BAD_EXPERT = 3, 4
SMALL = {"tokens": 16, "topk": 4, "progress": False}

REPORT_KEYS = {"schema", "verdict", "target", "against", "replay", "identity", "suites", "seed", "tokens", "topk",
               "layers_checked", "tolerance", "headroom", "summary", "layers", "experts", "errors"}
SIDE_KEYS = {"address", "kind", "model_info"}
MODEL_INFO_KEYS = {"format", "format_version", "hidden_size", "intermediate_size", "num_experts", "layers", "activation",
                   "dtype", "mxfp8_scale_mode", "backend", "backend_reason", "device", "max_tokens_per_request",
                   "max_batch_tokens", "content_hash", "server_version"}
SUMMARY_KEYS = {"batches", "layer_rows", "expert_rows", "failing_layer_rows", "failing_expert_rows", "failing_layers",
                "failing_experts", "worst_rel_l2", "errors"}
STAT_KEYS = {"suite", "layer", "rel_l2", "max_abs", "cosine", "exact_share", "elements", "nan", "inf",
             "nonfinite_mismatch", "worst_row_rel_l2", "zero_rows_wrong", "judged", "limit", "ok", "reasons", "errors"}


def validate_report(data: dict) -> None:
    """The documented keys of schema lutb-check-report/1 (docs/checking.md), and their types."""
    assert set(data) == REPORT_KEYS and data["schema"] == SCHEMA and data["verdict"] in ("pass", "fail")
    for side in ("target", "against"):
        assert set(data[side]) == SIDE_KEYS
        assert MODEL_INFO_KEYS <= set(data[side]["model_info"])
    assert set(data["identity"]) == {"differences", "forced"}
    assert set(data["tolerance"]) == {"dtype", "rel_l2", "min_tokens", "gross_factor"}
    assert set(data["summary"]) == SUMMARY_KEYS
    for row in data["layers"]:
        assert set(row) == STAT_KEYS | {"tokens"} and set(row["nan"]) == {"target", "against"}
        assert row["judged"] in ("strict", "gross") and isinstance(row["ok"], bool)
    for row in data["experts"]:
        assert set(row) == STAT_KEYS | {"expert", "held", "routes"}
    for err in data["errors"]:
        assert set(err) == {"suite", "layer", "batch", "side", "code", "message"}
    json.dumps(data, allow_nan=False)


def _altered(src: Path, dst: Path) -> Path:
    """``src`` with the LUT of every tile of one expert of one layer reversed (still a valid checkpoint)."""
    ckpt = Checkpoint(src)
    layers = {}
    for layer in ckpt.layers:
        w = ckpt.layer(layer)
        w13, w2 = w.w13.clone(), w.w2.clone()
        if layer == BAD_LAYER:
            local = w.expert_ids.tolist().index(BAD_EXPERT)
            for tiles in (w13, w2):
                lut = tiles[local, ..., :16].reshape(*tiles.shape[1:-1], 8, 2)
                tiles[local, ..., :16] = lut.flip(-2).reshape(*tiles.shape[1:-1], 16)
        layers[layer] = LayerWeights(w13, w2, w.expert_ids)
    write_checkpoint(dst, ckpt.config, layers)
    return dst


def _claiming_loader(path: Path, claimed_hash: str):
    """An engine on ``path`` that claims to serve ``claimed_hash``: a node whose kernel computes one expert wrongly."""
    from lutb_server.backends import choose_backend
    from lutb_server.engine import ExpertEngine

    def load() -> ExpertEngine:
        ckpt = Checkpoint(path)
        engine = ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")))
        engine.content_hash = claimed_hash
        return engine

    return load


@pytest.fixture(scope="module")
def faulty(client_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    bad = _altered(client_checkpoint, tmp_path_factory.mktemp("bad") / "ckpt")
    loader = _claiming_loader(bad, Checkpoint(client_checkpoint).content_hash())
    with ServerThread(checkpoint=client_checkpoint, engine_loader=loader) as running:
        yield running


def test_faulty_expert_is_named(faulty: ServerThread, client_checkpoint: Path, tmp_path: Path) -> None:
    report = run_check(NodeSide(faulty.address), ReferenceSide(client_checkpoint), **SMALL)
    assert not report.ok and report.verdict == "fail"
    assert report.failing_experts == [(BAD_LAYER, BAD_EXPERT)]
    assert report.failing_layers == [BAD_LAYER]
    others = [r for r in report.expert_rows if r.layer == BAD_LAYER and r.expert != BAD_EXPERT]
    assert others and all(r.ok for r in others)
    worst = report.expert_rows[0]
    assert (worst.layer, worst.expert, worst.ok) == (BAD_LAYER, BAD_EXPERT, False)
    assert all(r.ok for r in report.layer_rows if r.layer != BAD_LAYER)
    text = report.format_text()
    assert f"layer {BAD_LAYER} expert {BAD_EXPERT}" in text.splitlines()[-1]
    data = report.to_json()
    validate_report(data)
    assert data["summary"]["failing_experts"] == [[BAD_LAYER, BAD_EXPERT]]
    report.plot(tmp_path / "bad.png")
    assert (tmp_path / "bad.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_records_replay_to_the_same_verdict(faulty: ServerThread, server: ServerThread, client_checkpoint: Path,
                                            tmp_path: Path) -> None:
    for name, node, ok in (("good", server, True), ("bad", faulty, False)):
        node_side = NodeSide(node.address)
        rec = record_node(node_side, tmp_path / f"{name}.lutbrec", suites=["coverage", "normal", "magnitudes"], **SMALL)
        assert rec.model_info["content_hash"] == node_side.info["content_hash"] and not rec.errors
        live = run_check(node_side, ReferenceSide(client_checkpoint), suites=["coverage", "normal", "magnitudes"], **SMALL)
        replayed = run_check(open_recording(tmp_path / f"{name}.lutbrec"), ReferenceSide(client_checkpoint), progress=False)
        assert live.ok is ok and replayed.ok is ok
        assert replayed.failing_experts == live.failing_experts
        assert replayed.replay is not None and replayed.target["model_info"]["backend"] == "reference"
        assert [(r.suite, r.layer, r.expert, r.stats.rel_l2) for r in sorted(replayed.expert_rows, key=lambda r: (r.suite, r.layer, r.expert))] == \
               [(r.suite, r.layer, r.expert, r.stats.rel_l2) for r in sorted(live.expert_rows, key=lambda r: (r.suite, r.layer, r.expert))]
        validate_report(replayed.to_json())
    # a record replayed against a live node (the good one judges the bad recording)
    against_node = run_check(open_recording(tmp_path / "bad.lutbrec"), NodeSide(server.address), progress=False)
    assert against_node.failing_experts == [(BAD_LAYER, BAD_EXPERT)]


def _refusing_loader(path: Path, refused_layer: int):
    """An engine on ``path`` that refuses every request for ``refused_layer`` (INVALID_ARGUMENT), as a node would a
    request it cannot serve."""
    from lutb_server.backends import choose_backend
    from lutb_server.engine import ExpertEngine
    from lutb_server.errors import InvalidArgument

    def load() -> ExpertEngine:
        ckpt = Checkpoint(path)
        engine = ExpertEngine(ckpt, choose_backend("reference", ckpt.config, torch.device("cpu")))
        prepare = engine.prepare

        def refusing(layer: int, *args, **kwargs):
            if layer == refused_layer:
                raise InvalidArgument(f"layer {layer}: refused by the test node")
            return prepare(layer, *args, **kwargs)

        engine.prepare = refusing  # type: ignore[method-assign]
        return engine

    return load


def test_record_exits_1_when_the_node_refused_requests(client_checkpoint: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """`lutb record` used to exit 0 when the node refused requests (kept only as errors in the file): a script could
    not tell. Now 1, a line on stderr with the count and the first error, and the record still written."""
    from lutb_server.cli import build_parser

    out = tmp_path / "refused.lutbrec"
    with ServerThread(checkpoint=client_checkpoint, engine_loader=_refusing_loader(client_checkpoint, 3)) as node:
        args = build_parser().parse_args(["record", node.address, "--out", str(out), "--suite", "normal",
                                          "--tokens", "16", "--topk", "4"])
        assert args.run(args) == 1
    err = capsys.readouterr().err
    assert "refused 4 of 8 requests" in err and "layer 3" in err and "INVALID_ARGUMENT" in err
    assert "refused by the test node" in err
    rec = open_recording(out).recording
    assert sorted(rec.errors) == [b.index for b in rec.batches if b.layer == 3]
    assert sorted(rec.outputs) == [b.index for b in rec.batches if b.layer == 0]


def test_two_identical_nodes_agree(server: ServerThread, client_checkpoint: Path) -> None:
    with ServerThread(checkpoint=client_checkpoint) as twin:
        report = run_check(NodeSide(server.address), NodeSide(twin.address), **SMALL)
    assert report.ok, report.format_text()
    assert {r.suite for r in report.layer_rows} >= {"normal", "coverage", "pooled", "magnitudes/huge", "weights_on_input"}
    # the shard holds 6 of 8 experts: coverage rows name exactly those, route_major also sees the others (zero rows)
    assert {r.expert for r in report.expert_rows if r.suite == "coverage"} == {0, 1, 2, 4, 5, 7}
    assert all(r.held is False for r in report.expert_rows if r.expert in (3, 6))
    validate_report(report.to_json())


def test_layers_not_held_are_refused(server: ServerThread, client_checkpoint: Path) -> None:
    from lutb_client.check import CheckError

    with pytest.raises(CheckError, match=r"does not hold layer\(s\) \[1\]"):
        run_check(NodeSide(server.address), ReferenceSide(client_checkpoint), layers=[1], **SMALL)


def test_scale_mode_is_identity(server: ServerThread, client_checkpoint: Path, tmp_path: Path) -> None:
    from lutb_client.check import IdentityMismatch

    floor = make_tiny_checkpoint(tmp_path / "floor", layers=(0, 3), num_experts=8, expert_ids=(0, 1, 2, 4, 5, 7),
                                 scale_mode="floor")
    with pytest.raises(IdentityMismatch) as caught:
        run_check(NodeSide(server.address), ReferenceSide(floor), **SMALL)
    assert [d["field"] for d in caught.value.differences] == ["content_hash", "mxfp8_scale_mode"]
    report = run_check(NodeSide(server.address), ReferenceSide(floor), force=True, suites=["magnitudes", "normal"], **SMALL)
    assert report.forced and {d["field"] for d in report.differences} == {"content_hash", "mxfp8_scale_mode"}
    assert "FORCED   mxfp8_scale_mode differs" in report.format_text()


def test_the_local_judge_names_a_bad_tile(client_checkpoint: Path, tmp_path: Path) -> None:
    """The reference judge checks its layer's tiles (spec section 1) as a server does: a reserved scale byte is named
    with its tensor and tile, not met later as NaN weights and a refused MXFP8 quantization."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from lutb_client.check import CheckError
    from lutb_client.check.suites import Batch

    ckpt = Checkpoint(client_checkpoint)
    write_checkpoint(tmp_path / "bad", ckpt.config, {layer: ckpt.layer(layer) for layer in ckpt.layers})
    layer = ckpt.layers[0]
    file = tmp_path / "bad" / f"layer-{layer:05d}.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
        meta = dict(f.metadata())
    tensors[f"layers.{layer}.w2"][0, 0, 0, 16] = 255  # a reserved E8M0 scale byte
    save_file(tensors, str(file), metadata=meta)
    judge = ReferenceSide(tmp_path / "bad", device="cpu")
    x = torch.randn(2, ckpt.config.hidden_size).to(torch.bfloat16)
    ids = ckpt.expert_ids(layer)[:2].repeat(2, 1).to(torch.int32)
    batch = Batch(0, "unit", "bad tile", layer, x, ids, torch.full((2, 2), 0.5))
    with pytest.raises(CheckError, match=rf"layers\.{layer}\.w2: tile \(0, 0, 0\): scale byte 255"):
        judge.forward(batch)


def test_the_headroom_probes_show_progress(server: ServerThread, client_checkpoint: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """The probes of the huge and heavy-tailed inputs run before the first batch (about 7 judge calls a layer, slow
    on a CPU judge of a large layer): a bar says so instead of minutes of silence."""
    run_check(NodeSide(server.address), ReferenceSide(client_checkpoint, device="cpu"), suites=["heavy_tailed"],
              tokens=16, topk=2, progress=True)
    assert "probe headroom on reference" in capsys.readouterr().err


class _FailingProbes(ReferenceSide):
    """Answers every batch but the headroom probes (index < 0), which fail with ``code``."""

    def __init__(self, ckpt: Path, code: grpc.StatusCode) -> None:
        super().__init__(ckpt, device="cpu")
        self.address, self.code = "probed:1", code

    def forward(self, batch):  # type: ignore[no-untyped-def]
        from lutb_client.errors import ExpertServiceError

        if batch.index < 0:
            raise ExpertServiceError(self.code, "probe failed")
        return super().forward(batch)


@pytest.mark.parametrize("code", ["UNAVAILABLE", "DEADLINE_EXCEEDED", "INTERNAL"])
def test_record_fails_when_the_nodes_headroom_probe_fails(tmp_path: Path, code: str) -> None:
    """A node that is down or failing during `lutb record`'s headroom probe fails the recording (naming the node and
    the code); it is not recorded as a headroom of 1."""
    from lutb_client.check import CheckError

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", layers=(0,), num_experts=4)
    with pytest.raises(CheckError, match=f"the node \\(probed:1\\) failed on a headroom probe .*{code}"):
        record_node(_FailingProbes(ckpt, getattr(grpc.StatusCode, code)), tmp_path / "r.safetensors",
                    suites=["heavy_tailed"], tokens=8, topk=2, progress=False)
    assert not (tmp_path / "r.safetensors").exists()


def test_record_counts_the_nodes_refusal_as_too_big(tmp_path: Path) -> None:
    """The node's INVALID_ARGUMENT on every probe (its refusal of an overflowing input) is "too big" at every
    magnitude: the lowest headroom, and the recording goes on."""
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", layers=(0,), num_experts=4)
    rec = record_node(_FailingProbes(ckpt, grpc.StatusCode.INVALID_ARGUMENT), tmp_path / "r.safetensors",
                      suites=["heavy_tailed"], tokens=8, topk=2, progress=False)
    assert rec.headroom == {0: 1.0}
