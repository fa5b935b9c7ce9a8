"""Hugging Face MoE checkpoints -> LUT-B: names, config, sharding, shared experts, refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lutb_kernels.checkpoint import Checkpoint
from lutb_kernels.errors import LutBFormatError
from lutb_kernels.hf_import import compact_ids, import_hf_checkpoint, read_hf_config
from lutb_kernels.tiles import tiles_to_dense

H, I = 128, 256


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).square().sum() / b.float().square().sum())


def make_mixtral(path: Path, *, experts: int = 3, layers: int = 2, shards: int = 1, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """A tiny Mixtral-style checkpoint; returns every tensor written."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": H,
        "intermediate_size": I,
        "num_local_experts": experts,
        "num_experts_per_tok": 2,
        "num_hidden_layers": layers,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    (path / "config.json").write_text(json.dumps(cfg))
    tensors: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(64, H).to(dtype)}
    for layer in range(layers):
        p = f"model.layers.{layer}"
        tensors[f"{p}.self_attn.q_proj.weight"] = torch.randn(H, H).to(dtype)
        tensors[f"{p}.block_sparse_moe.gate.weight"] = torch.randn(experts, H).to(dtype)
        for e in range(experts):
            q = f"{p}.block_sparse_moe.experts.{e}"
            tensors[f"{q}.w1.weight"] = (torch.randn(I, H) * 0.02).to(dtype)
            tensors[f"{q}.w3.weight"] = (torch.randn(I, H) * 0.03).to(dtype)
            tensors[f"{q}.w2.weight"] = (torch.randn(H, I) * 0.02).to(dtype)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(path / file))
            weight_map.update({n: file for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def make_qwen(path: Path, *, experts: int = 4) -> dict[str, torch.Tensor]:
    """A tiny Qwen2-MoE-style checkpoint: layer 0 dense, layers 1 and 2 MoE with a shared expert."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["Qwen2MoeForCausalLM"],
        "hidden_size": H,
        "intermediate_size": 384,  # the dense MLP's; the experts use moe_intermediate_size
        "moe_intermediate_size": I,
        "shared_expert_intermediate_size": 384,
        "num_experts": experts,
        "num_hidden_layers": 3,
        "mlp_only_layers": [0],
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    (path / "config.json").write_text(json.dumps(cfg))
    tensors: dict[str, torch.Tensor] = {
        "model.layers.0.mlp.gate_proj.weight": torch.randn(384, H),
        "model.layers.0.mlp.up_proj.weight": torch.randn(384, H),
        "model.layers.0.mlp.down_proj.weight": torch.randn(H, 384),
    }
    for layer in (1, 2):
        p = f"model.layers.{layer}.mlp"
        tensors[f"{p}.gate.weight"] = torch.randn(experts, H)
        tensors[f"{p}.shared_expert_gate.weight"] = torch.randn(1, H)
        for part, shape in (("gate_proj", (384, H)), ("up_proj", (384, H)), ("down_proj", (H, 384))):
            tensors[f"{p}.shared_expert.{part}.weight"] = torch.randn(shape)
        for e in range(experts):
            tensors[f"{p}.experts.{e}.gate_proj.weight"] = torch.randn(I, H) * 0.02
            tensors[f"{p}.experts.{e}.up_proj.weight"] = torch.randn(I, H) * 0.02
            tensors[f"{p}.experts.{e}.down_proj.weight"] = torch.randn(H, I) * 0.02
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


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
    _write_config(tmp_path / "src")
    p = "model.layers.0.block_sparse_moe.experts.0"
    save_file(
        {f"{p}.w1.weight": torch.randn(I, H), f"{p}.w3.weight": torch.randn(I, H), f"{p}.w2.weight": torch.randn(I, H)},
        str(tmp_path / "src" / "model.safetensors"),
    )
    with pytest.raises(LutBFormatError, match=r"experts\.0\.w2\.weight: shape"):
        import_hf_checkpoint(tmp_path / "src", tmp_path / "out", device="cpu", progress=False)


def test_fp8_weights_refused(tmp_path: Path) -> None:
    _write_config(tmp_path / "src")
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


@pytest.mark.parametrize(("ids", "text"), [([], ""), ([3], "3"), ([0, 1, 2, 5, 7, 8], "0-2,5,7-8"), ([1, 3], "1,3")])
def test_compact_ids(ids: list[int], text: str) -> None:
    assert compact_ids(ids) == text
