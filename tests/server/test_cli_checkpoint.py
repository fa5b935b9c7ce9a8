"""``lutb synth``, ``lutb quantize`` and ``lutb inspect`` driven through ``lutb_server.cli.main``."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import lutb_kernels.checkpoint as checkpoint_module
from lutb_kernels.checkpoint import Checkpoint, write_checksums
from lutb_kernels.tiles import tiles_to_dense
from lutb_server.cli import main
from lutb_server.testing import make_tiny_checkpoint

import hf_fixtures as _hf



def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).square().sum() / b.float().square().sum())


def test_synth_then_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    seed = int(torch.randint(0, 1000, ()).item())
    argv = ["synth", "--out", str(out), "--layers", "3", "--experts", "5", "--hidden", "128", "--intermediate", "256",
            "--activation", "gelu", "--dtype", "float16", "--seed", str(seed), "--scale-mode", "floor"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(["inspect", str(out), "--json", "--no-progress"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["valid"] is True and info["error"] is None
    assert [layer["layer"] for layer in info["layers"]] == [0, 1, 2]
    assert all(layer["experts"] == 5 and layer["expert_ids"] == "0-4" for layer in info["layers"])
    assert (info["hidden_size"], info["intermediate_size"], info["num_experts"]) == (128, 256, 5)
    assert (info["activation"], info["dtype"], info["mxfp8_scale_mode"]) == ("gelu", "float16", "floor")
    assert info["weights"] == 3 * 5 * (2 * 256 * 128 + 128 * 256)
    assert info["bits_per_weight"] == pytest.approx(6672 * 8 / 128**2)
    assert info["content_hash"] == Checkpoint(out).content_hash()
    # Text output says the same; the same seed gives the same tensors.
    assert main(["inspect", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "3.2578 bits per weight" in text and "valid       yes" in text and "ids 0-4" in text
    again = tmp_path / "again"
    assert main(argv[:2] + [str(again)] + argv[3:]) == 0
    first, second = Checkpoint(out), Checkpoint(again)
    for layer in (0, 1, 2):
        for a, b in zip(first.layer(layer), second.layer(layer)):
            assert torch.equal(a, b)
    # (The content hash covers the file bytes, and safetensors may order the
    # metadata keys differently from one write to the next, so it is not compared.)


def test_synth_refuses_bad_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["synth", "--out", str(tmp_path / "x"), "--hidden", "100"]) == 1
    assert "multiples of 128" in capsys.readouterr().err


@pytest.mark.parametrize("std", ["inf", "nan", "1e38"])
def test_synth_names_gate_or_up_not_w13(tmp_path: Path, std: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Bad synthetic weights were reported against "w13" (the stacked gate/up matrix), a name no synth user wrote."""
    argv = ["synth", "--out", str(tmp_path / "x"), "--layers", "1", "--experts", "2", "--hidden", "128",
            "--intermediate", "128", "--weight-std", std]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(("lutb synth: gate of expert ", "lutb synth: up of expert ")), err
    assert "w13" not in err and "row " in err, err


def test_synth_reports_a_full_disk_naming_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """An output write error (here a full disk) once escaped `lutb synth` as a traceback."""
    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full)
    out = tmp_path / "out"
    assert main(["synth", "--out", str(out), "--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lutb synth: cannot write {out}: ") and "No space left" in err and "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores the directory's permissions")
def test_synth_reports_a_read_only_output_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A PermissionError creating the output under a read-only directory once escaped `lutb synth` as a traceback."""
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o555)
    out = parent / "out"
    try:
        assert main(["synth", "--out", str(out), "--layers", "1", "--experts", "2", "--hidden", "128", "--intermediate", "128"]) == 1
    finally:
        parent.chmod(0o755)
    err = capsys.readouterr().err
    assert err.startswith(f"lutb synth: cannot write {out}: ") and "Permission denied" in err


def test_inspect_corrupted_scale_byte(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ckpt"
    assert main(["synth", "--out", str(out), "--layers", "2", "--experts", "3"]) == 0
    file = out / "layer-00001.safetensors"
    with safe_open(str(file), framework="pt") as f:
        meta = f.metadata()
        tensors = {k: f.get_tensor(k).clone() for k in f.keys()}
    # Expert 2, tile (3, 1) of w13; scale of row 7, group 2.
    tensors["layers.1.w13"][2, 3, 1, 16 + 4 * 7 + 2] = 255
    save_file(tensors, str(file), metadata=meta)
    write_checksums(out, sorted(out.glob("*.safetensors")))  # as a converter that wrote the bad tile would
    capsys.readouterr()
    assert main(["inspect", str(out), "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert "layers.1.w13" in captured.err and "(2, 3, 1)" in captured.err and "255" in captured.err
    assert main(["inspect", str(out), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["valid"] is False and "layers.1.w13" in info["error"] and "(2, 3, 1)" in info["error"]


def test_inspect_a_damaged_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Bytes changed after the writer wrote them (a bad copy): inspect names the file; its tiles alone would pass."""
    out = tmp_path / "ckpt"
    assert main(["synth", "--out", str(out), "--layers", "2", "--experts", "3"]) == 0
    assert main(["inspect", str(out), "--no-progress"]) == 0
    assert "SHA256SUMS: every file checked" in capsys.readouterr().out
    file = out / "layer-00001.safetensors"
    data = bytearray(file.read_bytes())
    data[len(data) // 2:] = bytes(len(data) - len(data) // 2)
    file.write_bytes(bytes(data))
    assert main(["inspect", str(out), "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["valid"] is False and info["checksums"] is True
    assert "layer-00001.safetensors differs from the sha256 in SHA256SUMS" in info["error"]


def test_inspect_unreadable_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no .safetensors" in capsys.readouterr().err
    save_file({"something.else": torch.zeros(1)}, str(tmp_path / "x.safetensors"), metadata={"format": "lut-b"})
    assert main(["inspect", str(tmp_path)]) == 1
    assert "x.safetensors" in capsys.readouterr().err


def test_quantize_mixtral(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _hf.make_mixtral(tmp_path / "src", experts=4, layers=2, shards=2)
    out = tmp_path / "out"
    assert main(["quantize", str(tmp_path / "src"), "--out", str(out), "--device", "cpu", "--seed", "3", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 2 MoE layer(s)" in printed and "w13 SQNR" in printed
    ckpt = Checkpoint(out)
    ckpt.validate()
    assert ckpt.layers == [0, 1] and ckpt.config.num_experts == 4
    for layer in (0, 1):
        weights = ckpt.layer(layer)
        assert weights.expert_ids.tolist() == [0, 1, 2, 3]
        for e in range(4):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}"
            ref13 = torch.cat([src[f"{p}.w1.weight"], src[f"{p}.w3.weight"]])
            assert _rel(tiles_to_dense(weights.w13[e]), ref13) < 0.05
            assert _rel(tiles_to_dense(weights.w2[e]), src[f"{p}.w2.weight"]) < 0.05
    assert main(["inspect", str(out), "--no-progress"]) == 0


def test_quantize_qwen(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = _hf.make_qwen(tmp_path / "src", experts=3)
    out = tmp_path / "out"
    assert main(["quantize", str(tmp_path / "src"), "--out", str(out), "--scale-mode", "floor", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "note: shared experts left out" in printed
    ckpt = Checkpoint(out)
    assert ckpt.layers == [1, 2]
    assert ckpt.config.mxfp8_scale_mode == "floor" and ckpt.config.num_experts == 3
    assert ckpt.config.intermediate_size == 256
    with safe_open(str(ckpt.files[0]), framework="pt") as f:
        assert not any("shared" in k for k in f.keys())
    weights = ckpt.layer(1)
    for e in range(3):
        p = f"model.layers.1.mlp.experts.{e}"
        assert _rel(tiles_to_dense(weights.w2[e]), src[f"{p}.down_proj.weight"]) < 0.05
    # A second run into the same directory is refused, --overwrite allows it.
    assert main(["quantize", str(tmp_path / "src"), "--out", str(out), "--no-progress"]) == 1
    assert "already holds" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path / "src"), "--out", str(out), "--no-progress", "--overwrite"]) == 0


def test_quantize_bad_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["quantize", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "config.json" in capsys.readouterr().err


def test_quantize_reports_an_output_write_error_naming_the_output(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk on the output was once reported as "model.safetensors: unreadable safetensors file"."""
    _hf.make_mixtral(tmp_path / "src", experts=2, layers=1)

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full)
    out = tmp_path / "out"
    assert main(["quantize", str(tmp_path / "src"), "--out", str(out), "--device", "cpu", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"lutb quantize: cannot write {out}: " in err and "No space left" in err and "model.safetensors" not in err


def test_quantize_refuses_weights_too_large_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Finite float32 weights beyond bfloat16's range raised a plain ValueError out of `lutb quantize`."""
    src = _hf.make_mixtral(tmp_path / "src", experts=2, layers=1, dtype=torch.float32)
    name = "model.layers.0.block_sparse_moe.experts.1.w2.weight"
    src[name][0, 0] = 3.4e38
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    assert main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--device", "cpu", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"lutb quantize: {name}: weights too large for LUT-B" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("device", "cuda"), [("cuda", False), ("cuda:3", True), ("gpu", False)],
                         ids=["no-cuda", "index-too-high", "typo"])
def test_quantize_refuses_a_device_this_host_lacks_without_a_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                        monkeypatch: pytest.MonkeyPatch, device: str,
                                                                        cuda: bool) -> None:
    """`--device cuda` on a host without CUDA raised AssertionError ("Torch not compiled with CUDA enabled") and
    `--device gpu` RuntimeError out of `lutb quantize`, instead of one line and exit status 1."""
    _hf.make_mixtral(tmp_path / "src", experts=2, layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1 if cuda else 0)
    assert main(["quantize", str(tmp_path / "src"), "--out", str(tmp_path / "out"), "--device", device, "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"lutb quantize: device {device!r}") and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("ids", [[[0, 1], [2, 3]], 0], ids=["2-D", "0-D"])
@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_reports_malformed_expert_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str], ids: object,
                                              as_json: bool) -> None:
    """describe() once turned each layer's expert_ids into ints before validating anything: a 2-D or 0-D tensor
    ended `lutb inspect` in a TypeError traceback."""
    out = make_tiny_checkpoint(tmp_path / "ckpt", layers=(0, 1), num_experts=4)
    file = out / "layer-00001.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    tensors["layers.1.expert_ids"] = torch.tensor(ids, dtype=torch.int32)
    save_file(tensors, str(file), metadata=meta)
    assert main(["inspect", str(out), "--no-progress", *(["--json"] if as_json else [])]) == 1
    captured = capsys.readouterr()
    shape = str(tuple(torch.tensor(ids).shape))
    assert f"layer-00001.safetensors: layers.1.expert_ids: must be a 1-D int32 tensor, got torch.int32 {shape}" in captured.err
    if as_json:
        info = json.loads(captured.out)
        assert info["valid"] is False and "layers.1.expert_ids" in info["error"]


def test_inspect_shows_progress_while_hashing(tmp_path: Path, stderr_while_hashing: list[str]) -> None:
    """inspect hashed every byte before its "validate" bar started, with no output: minutes of silence on a large
    checkpoint. A "hash" bar shows now, unless --no-progress or --json."""
    out = make_tiny_checkpoint(tmp_path / "ckpt", layers=(0, 1, 2), num_experts=4)
    assert main(["inspect", str(out)]) == 0
    assert "hash" in stderr_while_hashing[-1] and "100%" in stderr_while_hashing[-1]
    for quiet in (["--no-progress"], ["--json"]):
        assert main(["inspect", str(out), *quiet]) == 0
        assert stderr_while_hashing[-1] == ""
