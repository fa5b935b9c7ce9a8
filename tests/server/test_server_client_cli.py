"""`lutb info` and `lutb bench` against a real server on loopback (`lutb check`: test_check_cli.py)."""

from __future__ import annotations

import argparse
import json

import pytest

from lutb_server.cli import client_cmds
from lutb_server.testing import ServerThread


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="lutb")
    client_cmds.register(parser.add_subparsers(required=True))
    args = parser.parse_args(argv)
    return args.run(args)


def test_info(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["info", server.address]) == 0
    out = capsys.readouterr().out
    assert "hidden_size             128" in out and "backend                 reference" in out and "0-7" in out
    assert "front_end               0 of 1" in out
    assert _run(["info", server.address, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["content_hash"].startswith("sha256:")
    # numbers as numbers (not the proto3 mapping's strings), and every field, the ones at their default too
    assert info["hidden_size"] == 128 and info["num_experts"] == 8 and isinstance(info["max_batch_tokens"], int)
    assert info["format_version"] == 1 and info["dtype"] == "BFLOAT16" and [layer["layer"] for layer in info["layers"]] == [0, 1]
    assert info["layers"][0]["expert_ids"] == list(range(8))
    assert (info["front_end"], info["front_ends"]) == (0, 1)


def test_bench(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["bench", server.address, "--count", "12", "--concurrency", "3", "--tokens", "8", "--topk", "2"]) == 0
    out = capsys.readouterr().out
    for words in ("requests: 12 ok", "p50", "p99", "requests/s", "tokens/s", "queue", "compute"):
        assert words in out
    assert _run(["bench", server.address, "--duration", "0.3", "--stream", "--tokens", "4"]) == 0


def test_unreachable_target(capsys: pytest.CaptureFixture[str]) -> None:
    from lutb_server.testing import free_port

    assert _run(["info", f"127.0.0.1:{free_port()}", "--timeout", "0.5"]) == 2
    assert "127.0.0.1" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--topk", "0"], ["--tokens", "-1"], ["--concurrency", "0"], ["--count", "x"],
                                 ["--duration", "0"], ["--timeout", "-5"]])
def test_bench_refuses_bad_numbers_as_usage_errors(bad: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Each once ended in a traceback (exit 1) or, for --concurrency 0, sent nothing and exited 0."""
    with pytest.raises(SystemExit) as info:
        _run(["bench", "127.0.0.1:1", *bad])
    assert info.value.code == 2
    assert bad[0] in capsys.readouterr().err
