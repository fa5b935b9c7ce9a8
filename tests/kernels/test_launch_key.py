"""``launch_key``: the experts' GEMM launch configs by batch size, as the warm-up needs them (CPU).

The configs are evaluated as on an H200 (132 SMs, not the interpreter's fixed config), on
experts objects built on the CPU; nothing is launched.
"""

from __future__ import annotations

import pytest
import torch
from lutb_gpu_testdata import make_layer, use_h200_rules

import lutb_kernels.grouped_gemm as grouped_gemm
import lutb_kernels.lut_b_gemm as lut_b_gemm
import lutb_kernels.mxfp8_triton as mxfp8_triton
from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts.emulated import LutBEmulationTritonExperts
from lutb_kernels.experts.packed import LutBPackedExperts
from lutb_server.worker import warm_up_sizes


@pytest.fixture
def h200_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """Config rules as on an H200 (the interpreter's fixed configs would make every key equal)."""
    use_h200_rules(monkeypatch.setattr)


# (experts held of 8, H, I), top-2, sizes 65..1024 (above graphs to 64): on both, powers of two alone miss configs
# (the shard: split-K changes inside a power-of-two range; the whole layer: the routing kernel's chunks)
CASES = [([0, 1, 2, 3], 1024, 2048), (list(range(8)), 256, 256)]


@pytest.mark.parametrize(("held", "hidden", "inter"), CASES)
@pytest.mark.parametrize("backend", [LutBPackedExperts, LutBEmulationTritonExperts])
def test_warm_up_sizes_meet_every_launch_key(h200_rules: None, backend: type, held: list[int], hidden: int, inter: int) -> None:
    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=8, activation="silu", dtype="bfloat16")
    experts = backend(cfg, make_layer(cfg, held, seed=len(held)), "cpu")
    key = experts.launch_key
    every = {key(t, 2) for t in range(65, 1025)}
    sizes = warm_up_sizes(64, 1024, key, 2)
    assert {key(t, 2) for t in sizes} == every
    assert {key(t, 2) for t in (128, 256, 512, 1024)} != every  # the case needs more than powers of two
    assert {128, 256, 512, 1024} <= set(sizes)


def test_launch_key_follows_the_configs_the_gemms_pick(h200_rules: None) -> None:
    cfg = CheckpointConfig(hidden_size=1024, intermediate_size=2048, num_experts=8, activation="silu", dtype="bfloat16")
    experts = LutBPackedExperts(cfg, make_layer(cfg, [0, 1, 2, 3]), "cpu")
    tokens, top_k = 320, 2
    routes = tokens * top_k
    block = experts.route_block(routes)
    held = experts.held_routes(routes)  # half the routes: 4 of 8 experts held
    cpu = torch.device("cpu")
    quantize = (mxfp8_triton.launch_blocks(tokens, 1024, cpu), mxfp8_triton.launch_blocks(routes, 2048, cpu))
    gemms = (lut_b_gemm.default_config(held, 2 * 2048, 1024, 4, block, cpu), lut_b_gemm.default_config(held, 1024, 2048, 4, block, cpu))
    key = experts.launch_key(tokens, top_k)
    assert key[0] == block and key[2] == quantize and key[3:] == gemms
    assert key[1] and all(isinstance(v, (int, bool)) for v in key[1])  # the routing kernel's chunks (Triton routing here)
    assert experts.launch_key(tokens, top_k) == key and hash(key) == hash(experts.launch_key(tokens, top_k))
    experts.dense_from_rows_per_expert = 0  # every batch on the dequantized-weights path: its configs
    dense = experts.launch_key(tokens, top_k)
    assert dense[3] == "dense" and all(isinstance(c, grouped_gemm.GroupedGemmConfig) for c in dense[4:])
