"""Hugging Face MoE checkpoints -> LUT-B: names, config, sharding, shared experts, refusals."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lutb_kernels.checkpoint as checkpoint_module
from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.errors import LutBFormatError
from lutb_kernels.hf_import import compact_ids, import_hf_checkpoint, read_hf_config
from hf_fixtures import H, I, make_mixtral, make_qwen
from lutb_kernels.tiles import tiles_to_dense


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).square().sum() / b.float().square().sum())


@pytest.mark.parametrize("shards", [1, 3])
def test_mixtral_import(tmp_path: Path, shards: int) -> None:
    src = make_mixtral(tmp_path / "src", shards=shards)
    report = import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)
    assert [r.layer for r in report.layers] == [0, 1]
    assert all(r.w13_sqnr_db > 14 and r.w2_sqnr_db > 14 for r in report.layers)
    ckpt = Checkpoint(tmp_path / "out")
    ckpt.validate()
    assert ckpt.layers == [0, 1]
    assert (ckpt.config.hidden_size, ckpt.config.intermediate_size, ckpt.config.num_experts) == (H, I, 3)
    assert ckpt.config.activation == "silu" and ckpt.config.dtype == "bfloat16"
    layer = ckpt.layer(1)
    assert layer.expert_ids.tolist() == [0, 1, 2]
    for e in range(3):
        p = f"model.layers.1.block_sparse_moe.experts.{e}"
        w13 = tiles_to_dense(layer.w13[e])
        assert _rel(w13[:I], src[f"{p}.w1.weight"]) < 0.05  # gate (w1) rows first
        assert _rel(w13[I:], src[f"{p}.w3.weight"]) < 0.05
        assert _rel(tiles_to_dense(layer.w2[e]), src[f"{p}.w2.weight"]) < 0.05
    assert "layer" in report.table()


def test_qwen_import_skips_dense_layer_and_shared_experts(tmp_path: Path) -> None:
    src = make_qwen(tmp_path / "src")
    report = import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False, scale_mode="floor")
    ckpt = Checkpoint(tmp_path / "out")
    assert ckpt.layers == [1, 2]
    assert ckpt.config.intermediate_size == I and ckpt.config.num_experts == 4
    assert ckpt.config.dtype == "float32" and ckpt.config.mxfp8_scale_mode == "floor"
    notes = " ".join(report.notes)
    assert "shared experts left out" in notes and "1-2" in notes
    assert "without routed experts skipped: 0" in notes
    layer = ckpt.layer(2)
    for e in range(4):
        p = f"model.layers.2.mlp.experts.{e}"
        w13 = tiles_to_dense(layer.w13[e])
        assert _rel(w13[:I], src[f"{p}.gate_proj.weight"]) < 0.05
        assert _rel(w13[I:], src[f"{p}.up_proj.weight"]) < 0.05
        assert _rel(tiles_to_dense(layer.w2[e]), src[f"{p}.down_proj.weight"]) < 0.05


def _write_config(path: Path, **fields: object) -> None:
    path.mkdir(parents=True, exist_ok=True)
    base = {"hidden_size": H, "intermediate_size": I, "num_local_experts": 2}
    base.update(fields)
    (path / "config.json").write_text(json.dumps(base))


@pytest.mark.parametrize(
    ("hidden_act", "expected"),
    [("silu", "silu"), ("swish", "silu"), ("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"), ("gelu_new", "gelu_tanh")],
)
def test_activation_mapping(tmp_path: Path, hidden_act: str, expected: str) -> None:
    _write_config(tmp_path, hidden_act=hidden_act)
    assert read_hf_config(tmp_path).activation == expected


def test_config_fields(tmp_path: Path) -> None:
    _write_config(tmp_path, n_routed_experts=256, num_local_experts=None, moe_intermediate_size=2048, intermediate_size=18432)
    cfg = read_hf_config(tmp_path)
    assert (cfg.num_experts, cfg.intermediate_size, cfg.dtype, cfg.activation) == (256, 2048, "bfloat16", "silu")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"hidden_act": "relu"}, "hidden_act 'relu'"),
        ({"torch_dtype": "float8_e4m3fn"}, "torch_dtype"),
        ({"num_local_experts": None}, "num_local_experts or num_experts or n_routed_experts"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_bad_config_refused(tmp_path: Path, fields: dict, message: str) -> None:
    _write_config(tmp_path, **fields)
    with pytest.raises(LutBFormatError, match=message):
        read_hf_config(tmp_path)


def test_missing_config_refused(tmp_path: Path) -> None:
    with pytest.raises(LutBFormatError, match="config.json"):
        read_hf_config(tmp_path)


def test_missing_projection_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src")
    save_file(
        {
            "model.layers.0.block_sparse_moe.experts.0.w1.weight": torch.randn(I, H),
            "model.layers.0.block_sparse_moe.experts.0.w2.weight": torch.randn(H, I),
        },
        str(tmp_path / "src" / "model.safetensors"),
    )
    with pytest.raises(LutBFormatError, match="layer 0 expert 0: lacks the up projection"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


def test_wrong_shape_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src", num_local_experts=1)
    p = "model.layers.0.block_sparse_moe.experts.0"
    save_file(
        {f"{p}.w1.weight": torch.randn(I, H), f"{p}.w3.weight": torch.randn(I, H), f"{p}.w2.weight": torch.randn(I, H)},
        str(tmp_path / "src" / "model.safetensors"),
    )
    with pytest.raises(LutBFormatError, match=r"experts\.0\.w2\.weight: shape"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


def test_fp8_weights_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src", num_local_experts=1)
    p = "model.layers.0.mlp.experts.0"
    save_file(
        {
            f"{p}.gate_proj.weight": torch.randn(I, H).to(torch.float8_e4m3fn),
            f"{p}.up_proj.weight": torch.randn(I, H).to(torch.float8_e4m3fn),
            f"{p}.down_proj.weight": torch.randn(H, I).to(torch.float8_e4m3fn),
        },
        str(tmp_path / "src" / "model.safetensors"),
    )
    with pytest.raises(LutBFormatError, match="dense"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


def test_no_experts_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src")
    save_file({"model.layers.0.mlp.gate_proj.weight": torch.randn(I, H)}, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(LutBFormatError, match="no routed expert tensors"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


def test_expert_id_beyond_config_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src", num_local_experts=2)
    p = "model.layers.0.block_sparse_moe.experts.5"
    save_file(
        {f"{p}.w1.weight": torch.randn(I, H), f"{p}.w3.weight": torch.randn(I, H), f"{p}.w2.weight": torch.randn(H, I)},
        str(tmp_path / "src" / "model.safetensors"),
    )
    with pytest.raises(LutBFormatError, match="exceed num_experts 2"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


@pytest.mark.parametrize("lost", ["index entries", "shard file"])
def test_a_layer_missing_experts_is_refused(tmp_path: Path, lost: str) -> None:
    """Expert 1 of 3 absent from the source (index entries or a shard lost) was converted without a word into a
    layer with expert_ids [0, 2]: in effect a shard, whose routes to expert 1 add exactly zero."""
    src = tmp_path / "src"
    tensors = make_mixtral(src, experts=3, layers=1, shards=2)
    index = src / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    if lost == "index entries":
        data["weight_map"] = {n: f for n, f in data["weight_map"].items() if ".experts.1." not in n}
        index.write_text(json.dumps(data))
    else:  # no index: the files are read as they are, and expert 1's tensors are in none of them
        index.unlink()
        for file in sorted(src.glob("*.safetensors")):
            save_file({n: tensors[n] for n in safe_keys(file) if ".experts.1." not in n}, str(file))
    with pytest.raises(LutBFormatError, match=r"layer 0: routed experts 1 missing .*num_experts = 3"):
        import_hf_checkpoint(src, tmp_path / "out", device="cpu", progress=False, iterations=1, refinements=0)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize(("ids", "text"), [([], ""), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([1, 3], "1,3")])
def test_compact_ids(ids: list[int], text: str) -> None:
    assert compact_ids(ids) == text


def test_writing_into_the_source_directory_is_refused_even_with_overwrite(tmp_path: Path) -> None:
    """``lutb quantize SRC --out SRC --overwrite`` once deleted the model's own safetensors files before reading them."""
    make_mixtral(tmp_path / "src")
    before = sorted(p.name for p in (tmp_path / "src").iterdir())
    with pytest.raises(FileExistsError, match="files being converted"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "src", device="cpu", progress=False, overwrite=True)
    assert sorted(p.name for p in (tmp_path / "src").iterdir()) == before


@pytest.mark.parametrize("damage", ["config not json", "config a list", "index lists a missing shard", "shard truncated"])
def test_damaged_sources_are_format_errors_naming_the_file(tmp_path: Path, damage: str) -> None:
    """Each once surfaced as JSONDecodeError, AttributeError, FileNotFoundError or SafetensorError (a traceback
    from `lutb quantize`, which reports format errors)."""
    src = tmp_path / "src"
    make_mixtral(src, shards=3)
    shard = sorted(src.glob("*.safetensors"))[0]
    if damage == "config not json":
        (src / "config.json").write_text('{"hidden_size": 128,')
    elif damage == "config a list":
        (src / "config.json").write_text("[1, 2]")
    elif damage == "index lists a missing shard":
        if not (src / "model.safetensors.index.json").is_file():
            pytest.skip("the fixture writes no index")
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:-100])
    name = "config.json" if damage.startswith("config") else shard.name
    with pytest.raises(LutBFormatError, match=name):
        import_hf_checkpoint(src, tmp_path / "out", device="cpu", progress=False)


def test_experts_under_another_prefix_are_left_out_not_mixed_in(tmp_path: Path) -> None:
    """Layers are numbered per prefix: an extra module's "mtp.layers.0.mlp.experts.*" once replaced the
    main stack's layer 0 experts without a word. The prefix with the most layers is imported; the others noted."""
    src = make_qwen(tmp_path / "src")
    extra = {f"mtp.layers.1.mlp.experts.{e}.{p}.weight": torch.full(shape, 5.0)
             for e in range(4) for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I)))}
    save_file(extra, str(tmp_path / "src" / "mtp.safetensors"))
    index = tmp_path / "src" / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "mtp.safetensors" for name in extra})
        index.write_text(json.dumps(data))
    report = import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)
    assert any("'mtp.'" in note and "left out" in note for note in report.notes)
    layer = Checkpoint(tmp_path / "out").layer(1)
    p = "model.layers.1.mlp.experts.0"
    assert _rel(tiles_to_dense(layer.w2[0]), src[f"{p}.down_proj.weight"]) < 0.05


def test_a_failed_import_leaves_no_checkpoint_and_keeps_the_old_one(tmp_path: Path) -> None:
    """NaN weights in layer 1 once left layer 0's file behind: a checkpoint that opened and validated as a
    complete one-layer model. Now nothing is left, and a checkpoint being overwritten stays as it was."""
    src = make_mixtral(tmp_path / "src")
    good = import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)
    assert [r.layer for r in good.layers] == [0, 1]
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    name = "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    file = next(f for f in (tmp_path / "src").glob("*.safetensors") if name in safe_keys(f))
    tensors = {k: v for k, v in src.items() if k in safe_keys(file)}
    tensors[name] = tensors[name].clone()
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(file))
    for out, overwrite in ((tmp_path / "fresh", False), (tmp_path / "out", True)):
        with pytest.raises(ValueError, match="NaN"):
            import_hf_checkpoint(tmp_path / "src", out, device="cpu", progress=False, overwrite=overwrite)
    assert not list((tmp_path / "fresh").glob("*.safetensors*"))
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before


@pytest.mark.parametrize("failure", ["disk full", "output directory gone"])
def test_an_output_write_error_names_the_output_not_the_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               failure: str) -> None:
    """The source files stay open (open_safetensors) while the layers are written, and open_safetensors once
    turned any OSError/SafetensorError raised in its `with` into "model.safetensors: unreadable safetensors file":
    a full disk on the output was blamed on the source."""
    make_mixtral(tmp_path / "src", experts=2, layers=1)
    real_save_file = checkpoint_module.save_file

    def disk_full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def directory_gone(tensors: dict, filename: str, metadata: dict | None = None) -> None:  # safetensors' own write error
        real_save_file(tensors, str(tmp_path / "gone" / Path(filename).name), metadata=metadata)

    monkeypatch.setattr(checkpoint_module, "save_file", disk_full if failure == "disk full" else directory_gone)
    with pytest.raises(OSError) as info:
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False, iterations=1, refinements=0)
    assert not isinstance(info.value, LutBFormatError)
    assert "unreadable" not in str(info.value) and "model.safetensors" not in str(info.value)
    if failure == "output directory gone":
        assert str(tmp_path / "out") in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # and nothing half-written is left


def safe_keys(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), framework="pt") as f:
        return list(f.keys())


@pytest.mark.parametrize("part", ["w1", "w3"], ids=["gate", "up"])
@pytest.mark.parametrize("bad", [float("nan"), 3.4e38], ids=["nan", "too-large"])
def test_bad_gate_or_up_weights_are_reported_against_their_own_tensor(tmp_path: Path, part: str, bad: float) -> None:
    """Gate and up are quantized stacked as W13 [2I, H], and any bad value in either was reported against the gate
    tensor (w1), with rows of the stacked matrix: a NaN in w3 row 5 read as "w1 ... rows 256..384"."""
    src = make_mixtral(tmp_path / "src", experts=2, layers=1, dtype=torch.float32)
    name = f"model.layers.0.block_sparse_moe.experts.1.{part}.weight"
    other = name.replace(part, "w3" if part == "w1" else "w1")
    row = int(torch.randint(0, I, ()))
    src[name][row, int(torch.randint(0, H, ()))] = bad
    save_file(src, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(ValueError) as info:
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False, iterations=1, refinements=0)
    msg = str(info.value)
    what = "weights hold NaN or infinity" if bad != bad else "weights too large for LUT-B"
    assert msg.startswith(f"{name}: {what}") and other not in msg, msg
    assert f"(row {row})" in msg or f"; row {row} holds" in msg, msg
    assert not (tmp_path / "out").exists()


def test_an_mtp_layer_numbered_num_hidden_layers_is_left_out_and_dense_layers_still_noted(tmp_path: Path) -> None:
    """DeepSeek-V3 / GLM-4.5 store their multi-token-prediction layer as model.layers.{num_hidden_layers}: it was
    converted as a model layer, and because it made up the count, the note on the skipped dense layers vanished."""
    src = tmp_path / "src"
    tensors = make_qwen(src)  # layer 0 dense, layers 1-2 MoE, num_hidden_layers 3
    for e in range(4):
        for p, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            tensors[f"model.layers.3.mlp.experts.{e}.{p}.weight"] = torch.randn(shape) * 0.02
    tensors["model.layers.3.eh_proj.weight"] = torch.randn(H, 2 * H)
    save_file(tensors, str(src / "model.safetensors"))
    report = import_hf_checkpoint(src, tmp_path / "out", device="cpu", progress=False, iterations=1, refinements=0)
    assert Checkpoint(tmp_path / "out").layers == [1, 2]
    assert [r.layer for r in report.layers] == [1, 2]
    notes = " ".join(report.notes)
    assert "without routed experts skipped: 0" in notes, report.notes
    assert "layer(s) 3 left out" in notes and "num_hidden_layers = 3" in notes, report.notes


def test_routed_experts_only_beyond_num_hidden_layers_are_refused(tmp_path: Path) -> None:
    tensors = make_mixtral(tmp_path / "src", experts=2, layers=1)  # config.json: num_hidden_layers 1
    save_file({k.replace("layers.0.", "layers.1."): v for k, v in tensors.items()}, str(tmp_path / "src" / "model.safetensors"))
    with pytest.raises(LutBFormatError, match="none below config.json's num_hidden_layers = 1"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


@pytest.mark.parametrize(
    ("device", "cuda", "count", "message"),
    [
        ("gpu", False, 0, "'gpu' is not a device name"),
        ("cuda", False, 0, "'cuda': CUDA is not available"),
        ("cuda:1", False, 0, "'cuda:1': CUDA is not available"),
        ("cuda:2", True, 2, r"'cuda:2': this host has 2 CUDA device\(s\)"),
        ("meta", False, 0, "'meta': the quantizer runs on cpu or cuda"),
    ],
    ids=["typo", "no-cuda", "no-cuda-index", "index-too-high", "meta"],
)
def test_a_device_this_host_lacks_is_a_value_error_before_anything_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str, cuda: bool, count: int, message: str
) -> None:
    """`lutb quantize --device cuda` on a host without CUDA ended in an AssertionError, `--device gpu` in a
    RuntimeError: tracebacks, where the command reports ValueErrors as one line and exit status 1."""
    make_mixtral(tmp_path / "src", experts=2, layers=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    with pytest.raises(ValueError, match=message):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device=device, progress=False, iterations=1, refinements=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
