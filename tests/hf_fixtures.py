"""Tiny Hugging Face style MoE checkpoints (Mixtral and Qwen2-MoE naming) for the import tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

H, I = 128, 256


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
