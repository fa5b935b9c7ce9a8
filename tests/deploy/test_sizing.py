"""deploy/sizing.py: memory per expert/layer/model and shard counts, checked against numbers
worked out independently here and against the tables printed in docs/deploy.md."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from deploy_support import REPO

SCRIPT = REPO / "deploy" / "sizing.py"


@pytest.fixture(scope="module")
def sizing():
    spec = importlib.util.spec_from_file_location("lutb_deploy_sizing", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up while building classes
    spec.loader.exec_module(module)
    return module


def test_tile_constants_match_the_format(sizing) -> None:
    from lutb_kernels import tiles

    assert sizing.TILE_BYTES == tiles.TILE_BYTES == 6672
    assert sizing.TILE == 128
    assert sizing.BITS_PER_WEIGHT == pytest.approx(3.2578, abs=5e-5)


# Worked by hand: tiles = (2I/128)(H/128) + (H/128)(I/128); bytes = tiles x 6672.
@pytest.mark.parametrize(
    ("name", "tiles", "lutb_expert", "bf16_expert"),
    [
        ("qwen3-30b-a3b", 12 * 16 + 16 * 6, 288 * 6672, 3 * 768 * 2048 * 2),
        ("mixtral-8x7b", 224 * 32 + 32 * 112, 10752 * 6672, 3 * 14336 * 4096 * 2),
        ("deepseek-v3", 32 * 56 + 56 * 16, 2688 * 6672, 3 * 2048 * 7168 * 2),
    ],
)
def test_bytes_per_expert(sizing, name, tiles, lutb_expert, bf16_expert) -> None:
    shape = sizing.SHAPES_BY_NAME[name]
    assert shape.tiles_per_expert == tiles
    assert shape.expert_bytes("lutb") == lutb_expert
    assert shape.expert_bytes("bf16") == bf16_expert
    assert shape.layer_bytes("lutb") == shape.experts * lutb_expert
    assert shape.model_bytes("lutb") == shape.moe_layers * shape.experts * lutb_expert
    # LUT-B is 3.2578 / 16 of bf16 for every shape (no padding at multiples of 128).
    assert shape.expert_bytes("lutb") / shape.expert_bytes("bf16") == pytest.approx(sizing.BITS_PER_WEIGHT / 16)


def test_deepseek_v3_shards(sizing) -> None:
    ds = sizing.SHAPES_BY_NAME["deepseek-v3"]
    per_expert_all_layers = 2688 * 6672 * 58  # 1,040,191,488 bytes
    # 80 GB, 15 % headroom: 68e9 bytes -> 65 experts fit -> 4 shards of 64.
    plan = sizing.shards_needed(ds, 80)
    assert (plan.shards, plan.experts_per_shard) == (4, 64)
    assert plan.shard_bytes == 64 * per_expert_all_layers <= plan.budget_bytes == 68 * 10**9
    # 141 GB: 119.85e9 bytes -> 115 experts fit -> 3 shards, the largest 86 experts.
    plan = sizing.shards_needed(ds, 141)
    assert (plan.shards, plan.experts_per_shard) == (3, 86)
    # Without any headroom two 141 GB shards would hold it (128 experts = 133.1e9 bytes).
    assert sizing.shards_needed(ds, 141, headroom=0).shards == 2
    # bf16 needs five times as many GPUs.
    assert sizing.shards_needed(ds, 80, "bf16").shards == 20


@pytest.mark.parametrize("gpu_gb", [1, 24, 40, 80, 141, 192])
@pytest.mark.parametrize("fmt", ["lutb", "bf16"])
def test_shard_plan_is_minimal_and_fits(sizing, gpu_gb, fmt) -> None:
    for shape in sizing.REFERENCE_SHAPES:
        try:
            plan = sizing.shards_needed(shape, gpu_gb, fmt)
        except ValueError:
            assert shape.expert_bytes(fmt) * shape.moe_layers > gpu_gb * 10**9 * 0.85
            continue
        per = shape.expert_bytes(fmt) * shape.moe_layers
        assert plan.shard_bytes <= plan.budget_bytes
        assert plan.experts_per_shard * (plan.shards - 1) < shape.experts <= plan.experts_per_shard * plan.shards
        if plan.shards > 1:  # one shard fewer would not fit
            fewer = -(-shape.experts // (plan.shards - 1))
            assert fewer * per > plan.budget_bytes


@pytest.mark.parametrize(("hidden", "intermediate"), [(2000, 768), (2048, 0), (2048, 100)])
def test_rejects_shapes_off_the_tile_grid(sizing, hidden, intermediate) -> None:
    with pytest.raises(ValueError):
        sizing.MoEShape("bad", experts=8, hidden=hidden, intermediate=intermediate, moe_layers=1, top_k=2)


def test_rejects_bad_headroom(sizing) -> None:
    with pytest.raises(ValueError):
        sizing.shards_needed(sizing.REFERENCE_SHAPES[0], 80, headroom=1.0)


def test_cli_json_and_markdown_run_standalone() -> None:
    """The script needs only the standard library (run here with -I: no project on the path)."""
    out = subprocess.run([sys.executable, "-I", str(SCRIPT), "--json"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["models"]["deepseek-v3"]["lutb"]["shards"]["80"]["shards"] == 4
    md = subprocess.run([sys.executable, "-I", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert md.returncode == 0 and md.stdout.count("| deepseek-v3 |") == 4  # memory, two shard rows, CUDA graphs


def test_docs_tables_match_the_script(sizing) -> None:
    doc = (REPO / "docs" / "deploy.md").read_text()
    assert sizing.memory_table() in doc, "docs/deploy.md memory table is stale: paste `python deploy/sizing.py`"
    assert sizing.shard_table() in doc, "docs/deploy.md shard table is stale: paste `python deploy/sizing.py`"
    assert sizing.graph_table() in doc, "docs/deploy.md CUDA-graph table is stale: paste `python deploy/sizing.py`"


@pytest.mark.parametrize("top_k", [0, 9])
def test_rejects_top_k_outside_the_experts(sizing, top_k) -> None:
    with pytest.raises(ValueError):
        sizing.MoEShape("bad", experts=8, hidden=128, intermediate=128, moe_layers=1, top_k=top_k)


@pytest.mark.parametrize("max_tokens", [0, 1, 48, 512, 600, 2048])
def test_graph_buckets_are_the_servers(sizing, max_tokens) -> None:
    from lutb_kernels.experts.graphs import token_buckets

    assert tuple(sizing.graph_buckets(max_tokens)) == token_buckets(max_tokens)


@pytest.mark.parametrize(("top_k", "max_tokens"), [(2, 16), (3, 24)])
def test_graph_bytes_are_what_the_graph_wrappers_allocate(sizing, top_k, max_tokens) -> None:
    """The estimate equals the static buffers three layers' CudaGraphExperts sharing one StaticBuffers (as a worker
    builds them) hold after capturing every bucket for both kinds of input: on the CPU they keep the same buffers without graphs, and a
    layer's combined output is the shared buffer its replay returns."""
    import torch

    from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
    from lutb_kernels.experts.graphs import CudaGraphExperts, StaticBuffers
    from lutb_kernels.experts.reference import ReferenceExperts
    from lutb_kernels.tiles import TILE, TILE_BYTES

    class ZeroExperts(ReferenceExperts):
        capture_safe = True

        def forward_unchecked(self, x, topk_ids, topk_weights, *, out=None, **kwargs):  # noqa: ANN001, ANN003
            return out.zero_() if out is not None else torch.zeros(x.shape, dtype=x.dtype)

    hidden, experts, layers = 2 * TILE, 4, 3
    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=TILE, num_experts=experts, dtype="bfloat16")
    tiles = lambda shape: torch.zeros((*shape, TILE_BYTES), dtype=torch.uint8)  # noqa: E731 - never decoded
    weights = LayerWeights(tiles(cfg.w13_tiles_shape(experts)), tiles(cfg.w2_tiles_shape(experts)), torch.arange(experts, dtype=torch.int32))
    buffers = StaticBuffers()
    wrappers = [CudaGraphExperts(ZeroExperts(cfg, weights, "cpu"), max_tokens=max_tokens, use_graphs=False, buffers=buffers)
                for _ in range(layers)]
    for wrapper in wrappers:  # the start-up variants: input in the model dtype and MXFP8
        assert wrapper.capture(top_k, mxfp8_input=True) == len(wrapper.buckets)  # no dequantization graphs on the CPU
        for bucket in wrapper.buckets:
            ids, w = torch.zeros((bucket, top_k), dtype=torch.int32), torch.zeros((bucket, top_k))
            out = wrapper.forward_unchecked(torch.zeros((bucket, hidden), dtype=torch.bfloat16), ids, w)
            assert out.shape == (bucket, hidden)
            out = wrapper.forward_unchecked(torch.zeros((bucket, hidden), dtype=torch.float8_e4m3fn), ids, w,
                                            x_scales=torch.zeros((bucket, hidden // 32), dtype=torch.uint8))
            assert out.shape == (bucket, hidden) and out.dtype == torch.bfloat16
    held = {id(t): t for wrapper in wrappers for e in wrapper._entries.values()  # each once
            for t in (e.x, e.ids, e.w, e.out, e.rows.xq, e.rows.xs)}
    shape = sizing.MoEShape("tiny", experts=experts, hidden=hidden, intermediate=TILE, moe_layers=layers, top_k=top_k)
    assert sum(t.nbytes for t in held.values()) == buffers.nbytes == shape.graph_bytes(max_tokens)
