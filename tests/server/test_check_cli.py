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


def _rewrite_record(src: Path, dst: Path, change) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(src), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = dict(f.metadata())
    meta = json.loads(header["record"])
    change(meta)
    header["record"] = json.dumps(meta)
    save_file(tensors, str(dst), metadata=header)


def test_replay_splits_batches_to_the_judges_limit(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A record made on a node of the default limit, replayed against a judge node that takes 8 tokens per request:
    the judge's requests are split (they were sent whole, refused, and the target was failed). The headroom probe
    (one token per expert: 8 here) is split the same way, where all its probes were refused and it fell to 1.0."""
    rec = tmp_path / "big.lutbrec"
    assert _run(["record", server.address, "--out", str(rec), "--tokens", "32", "--topk", "4", "--suite", "normal"]) == 0
    with ServerThread(checkpoint=tiny_checkpoint, max_tokens_per_request=8) as small:
        assert _run(["check", "--replay", str(rec), "--against", small.address]) == 0
        assert "ok: worst rel L2" in capsys.readouterr().out
        report = tmp_path / "r.json"
        with ServerThread(checkpoint=tiny_checkpoint, max_tokens_per_request=4) as tiny:
            assert _run(["check", server.address, "--against", tiny.address, "--suite", "magnitudes", "--tokens", "16",
                         "--layers", "0", "--json", str(report)]) == 0
        assert json.loads(report.read_text())["headroom"]["0"] > 1e6


def test_check_refuses_what_it_cannot_run(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Exit 2 with a message, where each of these was a traceback or a verdict about the target."""
    rec = tmp_path / "node.lutbrec"
    assert _run(["record", server.address, "--out", str(rec), *FAST, "--suite", "normal"]) == 0
    capsys.readouterr()
    for name, change in (("no-info.lutbrec", lambda m: m.pop("model_info")), ("no-address.lutbrec", lambda m: m.pop("address")),
                         ("no-layers.lutbrec", lambda m: m["model_info"].pop("layers")),
                         ("empty.lutbrec", lambda m: m.update(batches=[], layers=[]))):
        _rewrite_record(rec, tmp_path / name, change)
        assert _run(["check", "--replay", str(tmp_path / name), "--checkpoint", str(tiny_checkpoint)]) == 2, name
        assert name in capsys.readouterr().err
    for device in ("bogus", "cuda:7"):
        assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--device", device]) == 2
        assert f"device '{device}'" in capsys.readouterr().err
    (tmp_path / "a-file").write_text("")
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--suite", "normal",
                 "--json", str(tmp_path / "a-file" / "r.json")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_unwritable_report_paths_are_refused_before_the_node_is_asked(server: ServerThread, tiny_checkpoint: Path,
                                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A check may take minutes: a --json or --plot it cannot write used to fail only after it ran."""
    from lutb_client.check import runner

    def never(*args, **kwargs):
        raise AssertionError("the check ran")

    monkeypatch.setattr(runner, "run_check", never)
    for flag, name in (("--json", "r.json"), ("--plot", "r.png")):
        assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, flag, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"cannot write {tmp_path}" in err and f"e.g. {tmp_path / ('report' + Path(name).suffix)}" in err, flag
        dangling = tmp_path / f"dangling{Path(name).suffix}"
        dangling.symlink_to(tmp_path / "nowhere" / name)
        assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, flag, str(dangling)]) == 2
        assert f"cannot write {dangling}" in capsys.readouterr().err, flag
        assert not (tmp_path / "nowhere").exists()  # a link's target folder is not made
        (tmp_path / "a-file").write_text("")
        assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST,
                     flag, str(tmp_path / "a-file" / name)]) == 2
        assert "cannot write" in capsys.readouterr().err, flag
    fifo = tmp_path / "fifo.json"
    __import__("os").mkfifo(fifo)
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--json", str(fifo)]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--json", str(tmp_path / "same"),
                 "--plot", str(tmp_path / "same")]) == 2
    assert "three different files" in capsys.readouterr().err
    assert _run(["check", "--replay", str(tmp_path / "r.lutbrec"), "--checkpoint", str(tiny_checkpoint),
                 "--json", str(tmp_path / "r.lutbrec")]) == 2
    assert "three different files" in capsys.readouterr().err
    for plot in ("r.txt", "r.pgf"):
        assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--plot", str(tmp_path / plot)]) == 2
        assert "give a file name ending in one of" in capsys.readouterr().err
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--plot", str(tmp_path / "r.txt")]) == 2
    assert "give a file name ending in one of" in capsys.readouterr().err and not (tmp_path / "r.txt").exists()
    for module in ("matplotlib", "matplotlib.figure"):  # importing them raises ImportError, as without matplotlib
        monkeypatch.setitem(__import__("sys").modules, module, None)
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--plot", str(tmp_path / "r.png")]) == 2
    assert "cannot draw" in capsys.readouterr().err and not (tmp_path / "r.png").exists()


@pytest.mark.parametrize("skew", [1.0, 1.05])
def test_a_report_write_failing_after_the_check_keeps_a_fail_verdict(server: ServerThread, tiny_checkpoint: Path,
                                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str], skew: float) -> None:
    """The JSON write fails after the check ran: a pass becomes exit 2 (no report), a failing node stays exit 1."""
    from lutb_client.check.report import CheckReport
    from lutb_client.client import ExpertClient

    original = ExpertClient.forward

    def skewed(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        return (out.float() * skew).to(out.dtype)

    monkeypatch.setattr(ExpertClient, "forward", skewed)

    def disk_full(self, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(CheckReport, "write_json", disk_full)
    code = _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--layers", "0", "--suite", "normal",
                 "--json", str(tmp_path / "r.json")])
    assert code == (2 if skew == 1.0 else 1)
    assert "No space left on device" in capsys.readouterr().err


def test_a_layer_named_twice_is_checked_once(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path) -> None:
    report = tmp_path / "r.json"
    assert _run(["check", server.address, "--checkpoint", str(tiny_checkpoint), *FAST, "--suite", "normal",
                 "--layers", "0", "0", "--json", str(report)]) == 0
    data = json.loads(report.read_text())
    assert data["layers_checked"] == [0]
    assert [row["tokens"] for row in data["layers"] if row["suite"] == "normal"] == [64]  # not 128: sent once


def test_a_node_against_itself_is_refused(server: ServerThread, capsys: pytest.CaptureFixture[str]) -> None:
    """Its answers equal themselves whatever they are: such a check used to pass and prove nothing."""
    assert _run(["check", server.address, "--against", server.address, *FAST]) == 2
    assert "against itself" in capsys.readouterr().err


def test_record_refuses_an_unwritable_out_before_asking_the_node(server: ServerThread, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """--out naming a folder used to fail with a traceback (exit 1) after every batch had been sent."""
    assert _run(["record", server.address, "--out", str(tmp_path), *FAST, "--suite", "normal"]) == 2
    assert "is a folder" in capsys.readouterr().err


@pytest.mark.parametrize("damage", ["layers not a list", "batch listed twice"])
def test_a_damaged_record_is_refused(server: ServerThread, tiny_checkpoint: Path, tmp_path: Path, damage: str,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A record whose metadata lies is a bad file (exit 2), not a mismatch (exit 1) nor a pass."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    rec = tmp_path / "node.lutbrec.safetensors"
    assert _run(["record", server.address, "--out", str(rec), *FAST, "--suite", "normal"]) == 0
    with safe_open(str(rec), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
        header = dict(f.metadata())
    meta = json.loads(header["record"])
    if damage == "layers not a list":
        meta["model_info"]["layers"] = "0,1"
    else:
        meta["batches"].append(dict(meta["batches"][0]))
    header["record"] = json.dumps(meta)
    save_file(tensors, str(rec), metadata=header)
    capsys.readouterr()
    assert _run(["check", "--replay", str(rec), "--checkpoint", str(tiny_checkpoint), *FAST]) == 2
    assert "record" in capsys.readouterr().err


def test_a_checkpoint_beside_another_judge_is_said_to_be_unused(server: ServerThread, tiny_checkpoint: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(checkpoint=tiny_checkpoint) as twin:
        assert _run(["check", server.address, "--against", twin.address, "--checkpoint", str(tiny_checkpoint),
                     *FAST, "--suite", "normal"]) == 0
    assert "--checkpoint is only read with --against reference" in capsys.readouterr().err
