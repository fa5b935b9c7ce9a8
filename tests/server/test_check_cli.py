"""`lutb check` and `lutb record` end to end: real servers on loopback, exit codes, JSON, PNG, replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lutb_server.cli import build_parser
from lutb_server.testing import ServerThread, free_port, make_tiny_checkpoint

FAST = ["--tokens", "16", "--topk", "4"]


def _run(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


def test_check_passes_on_the_same_checkpoint(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    report, png = tmp_path / "report.json", tmp_path / "report.png"
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST,
                 "--json", str(report), "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "rel_l2" in out and "cosine" in out and "ok: worst rel L2" in out and "(tolerance 0.01)" in out
    data = json.loads(report.read_text())
    assert data["schema"] == "lutb-check-report/1" and data["verdict"] == "pass"
    assert data["target"]["model_info"]["content_hash"] == data["against"]["model_info"]["content_hash"]
    assert data["layers_checked"] == [0, 1] and data["suites"][0] == "normal" and data["experts"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_check_refuses_another_checkpoint(server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = make_tiny_checkpoint(tmp_path / "other", seed=99)
    assert _run(["check", server.address, "--checkpoint", str(other), *FAST]) == 2
    err = capsys.readouterr().err
    assert "refusing" in err and "content_hash differs" in err and err.count("sha256:") == 2
    assert "mxfp8_scale_mode" not in err


def test_check_fails_beyond_tolerance(server: ServerThread, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Server outputs off by 5% (skewed as the client receives them) must fail the check."""
    from lutb_client.client import ExpertClient

    original = ExpertClient.forward

    def skewed(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return (out.float() * 1.05).to(out.dtype)

    monkeypatch.setattr(ExpertClient, "forward", skewed)
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), "--layers", "0",
                 "--suite", "normal,coverage", "--tokens", "64"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "strict" in out


def test_other_scale_mode_is_refused_then_flagged(tiny_checkpoint: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    floor = make_tiny_checkpoint(tmp_path / "floor", layers=(0, 1), num_experts=8, scale_mode="floor")
    with ServerThread(checkpoint=floor) as node:
        assert _run(["check", node.address, "--checkpoint", str(tiny_checkpoint), *FAST]) == 2
        err = capsys.readouterr().err
        assert "refusing" in err and "mxfp8_scale_mode differs" in err and "floor" in err and "rceil" in err
        report = tmp_path / "forced.json"
        code = _run(["check", node.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--force", "--json", str(report)])
    assert code in (0, 1)
    assert "FORCED   mxfp8_scale_mode differs" in capsys.readouterr().out
    data = json.loads(report.read_text())
    assert data["identity"]["forced"] is True
    assert {d["field"] for d in data["identity"]["differences"]} == {"content_hash", "mxfp8_scale_mode"}
    assert data["verdict"] == ("pass" if code == 0 else "fail")


def test_record_then_replay(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    rec = tmp_path / "node.lutbrec"
    assert _run(["record", server.address, "--out", str(rec), *FAST, "--suite", "normal", "--suite", "route_major"]) == 0
    assert "recorded" in capsys.readouterr().out and rec.exists()
    assert _run(["check", "--replay", str(rec), "--checkpoint", str(tiny_checkpoint)]) == 0
    assert "replay   " in capsys.readouterr().out
    assert _run(["check", "--replay", str(rec), "--against", server.address, "--layers", "1"]) == 0
    capsys.readouterr()
    # a record replayed against another checkpoint is refused
    other = make_tiny_checkpoint(tmp_path / "other", seed=7)
    assert _run(["check", "--replay", str(rec), "--checkpoint", str(other)]) == 2
    assert "refusing" in capsys.readouterr().err


def test_usage_errors(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", server.address]) == 2  # reference without --checkpoint
    assert "--checkpoint" in capsys.readouterr().err
    assert _run(["check", "--checkpoint", str(tiny_checkpoint)]) == 2  # neither TARGET nor --replay
    junk = tmp_path / "junk.lutbrec"
    junk.write_bytes(b"not a record")
    assert _run(["check", "--replay", str(junk), "--checkpoint", str(tiny_checkpoint)]) == 2
    assert "junk.lutbrec" in capsys.readouterr().err
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), "--suite", "nope"]) == 2
    assert "unknown suite" in capsys.readouterr().err
    assert _run(["check", f"127.0.0.1:{free_port()}", "--checkpoint", str(tiny_checkpoint), "--timeout", "0.5"]) == 2
    assert "127.0.0.1" in capsys.readouterr().err
