"""`lutb info`, `lutb bench` and `lutb check` against a real server on loopback."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lutb_server.cli import client_cmds
from lutb_server.testing import ServerThread, make_tiny_checkpoint


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lutb")
    client_cmds.register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_info(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["info", server.address]) == 0
    out = capsys.readouterr().out
    assert "hidden_size             128" in out and "backend                 reference" in out and "0-7" in out
    assert _run(["info", server.address, "--json"]) == 0
    assert '"content_hash": "sha256:' in capsys.readouterr().out


def test_bench(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["bench", server.address, "--count", "12", "--concurrency", "3", "--tokens", "8", "--topk", "2"]) == 0
    out = capsys.readouterr().out
    for words in ("requests: 12 ok", "p50", "p99", "requests/s", "tokens/s", "queue", "compute"):
        assert words in out
    assert _run(["bench", server.address, "--duration", "0.3", "--stream", "--tokens", "4"]) == 0


def test_check_passes_on_the_same_checkpoint(server: ServerThread, tiny_checkpoint: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), "--batches", "2"]) == 0
    out = capsys.readouterr().out
    assert "rel_l2" in out and "cosine" in out and out.strip().endswith("(tolerance 0.01)")


def test_check_refuses_another_checkpoint(server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = make_tiny_checkpoint(tmp_path / "other", seed=99)
    assert _run(["check", server.address, "--checkpoint", str(other)]) == 2
    err = capsys.readouterr().err
    assert "refusing" in err and err.count("sha256:") == 2


def test_check_fails_beyond_tolerance(server: ServerThread, tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Server outputs off by 5% (skewed as the client receives them) must fail the check."""
    from lutb_client.client import ExpertClient

    original = ExpertClient.forward

    def skewed(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return (out.float() * 1.05).to(out.dtype)

    monkeypatch.setattr(ExpertClient, "forward", skewed)
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), "--batches", "1", "--layers", "0"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    from lutb_server.testing import free_port

    assert _run(["info", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 2
    assert "127.0.0.1" in capsys.readouterr().err
