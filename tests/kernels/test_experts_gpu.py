"""GPU experts backends (emulated, packed) vs ReferenceExperts on the GPU (spec section 6 tolerances)."""

from __future__ import annotations

import pytest
import torch
from lutb_gpu_testdata import make_batch, make_layer

from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts.reference import ReferenceExperts
from lutb_kernels.reference import rel_l2

pytestmark = pytest.mark.gpu
TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-2, torch.float32: 2e-3}


def _backend(name: str):  # noqa: ANN202
    from lutb_kernels.experts.emulated import LutBEmulationTritonExperts
    from lutb_kernels.experts.packed import LutBPackedExperts

    return {"packed": LutBPackedExperts, "packed_dense": LutBPackedExperts, "emulated": LutBEmulationTritonExperts}[name]


def _make(name: str, cfg: CheckpointConfig, layer):  # noqa: ANN001, ANN202
    """The backend; "packed_dense": packed forced onto its prefill path (dequantized weights)."""
    experts = _backend(name)(cfg, layer, "cuda")
    if name == "packed_dense":
        experts.dense_from_rows_per_expert = 0
    return experts


_LAYERS: dict = {}


def _layer(h: int, i: int, experts: int, held: tuple[int, ...], activation: str, dtype: str):  # noqa: ANN202
    key = (h, i, experts, held, activation, dtype)
    if key not in _LAYERS:
        cfg = CheckpointConfig(hidden_size=h, intermediate_size=i, num_experts=experts, activation=activation, dtype=dtype)
        layer = make_layer(cfg, list(held), device="cuda", seed=len(_LAYERS))
        _LAYERS[key] = (cfg, layer, ReferenceExperts(cfg, layer, "cuda"), {})
    return _LAYERS[key]


def _run(backend: str, h: int, i: int, experts: int, held: tuple[int, ...], activation: str, dtype: str,
         tokens: int, top_k: int, *, on_input: bool = False, mode: str = "combined", repeat: bool = False) -> None:
    """``repeat``: every token's second route names its first route's expert again (spec section 4 sums both)."""
    cfg, layer, ref, cache = _layer(h, i, experts, held, activation, dtype)
    if backend not in cache:
        cache[backend] = _make(backend, cfg, layer)
        assert _backend(backend).supports(cfg, torch.device("cuda")).ok
    x, ids, w = make_batch(tokens, top_k, experts, h, cfg.torch_dtype, device="cuda", seed=tokens)
    if repeat:
        ids[:, 1] = ids[:, 0]
    got = cache[backend].forward(x, ids, w, apply_router_weight_on_input=on_input, output_mode=mode)
    want = ref.forward(x, ids, w, apply_router_weight_on_input=on_input, output_mode=mode)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    assert rel_l2(got, want) <= TOL[cfg.torch_dtype], (backend, tokens, activation)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("tokens", [1, 2, 7, 64, 255, 1024, 4096])
def test_batch_sizes(backend: str, tokens: int) -> None:
    _run(backend, 256, 384, 8, tuple(range(8)), "silu", "bfloat16", tokens, 2)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize(("tokens", "mode"), [(1, "combined"), (7, "combined"), (300, "combined"), (7, "route_major")])
def test_an_expert_twice_in_one_token(backend: str, tokens: int, mode: str) -> None:
    """Duplicate expert ids in a token are two routes (spec section 4): both computed, both summed."""
    _run(backend, 256, 256, 8, tuple(range(8)), "silu", "bfloat16", tokens, 4, mode=mode, repeat=True)


@pytest.mark.parametrize("backend", ["packed", "emulated"])
@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul"])
def test_activations(backend: str, activation: str) -> None:
    _run(backend, 256, 256, 8, tuple(range(8)), activation, "bfloat16", 64, 2)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("tokens", [7, 1024])
def test_qwen_like_shape_expert_subset(backend: str, tokens: int) -> None:
    _run(backend, 2048, 768, 16, (0, 3, 4, 9, 15), "silu", "bfloat16", tokens, 8)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_other_model_dtypes(backend: str, dtype: str) -> None:
    _run(backend, 256, 256, 4, (0, 1, 2, 3), "silu", dtype, 64, 2)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
def test_weights_on_input_and_route_major(backend: str) -> None:
    _run(backend, 256, 256, 4, (1, 2), "gelu", "bfloat16", 100, 1, on_input=True)
    _run(backend, 256, 256, 4, (1, 2), "swigluoai", "bfloat16", 100, 2, mode="route_major")


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
def test_cuda_graph_capture(backend: str) -> None:
    cfg, layer, ref, cache = _layer(256, 384, 8, tuple(range(8)), "silu", "bfloat16")
    ex = _make(backend, cfg, layer)
    x, ids, w = make_batch(32, 2, 8, 256, torch.bfloat16, device="cuda", seed=5)
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    ex.forward_unchecked(x, ids, w, nonfinite=flag)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ex.forward_unchecked(x, ids, w, nonfinite=flag)
    x2, ids2, w2 = make_batch(32, 2, 8, 256, torch.bfloat16, device="cuda", seed=6)
    x.copy_(x2), ids.copy_(ids2), w.copy_(w2)
    graph.replay()
    torch.cuda.synchronize()
    assert int(flag) == 0
    assert rel_l2(out, ref.forward(x2, ids2, w2)) <= 1e-2


def test_supports_on_this_gpu() -> None:
    from lutb_kernels.experts.sm107 import LutBSm107Experts

    cfg = CheckpointConfig(hidden_size=256, intermediate_size=256, num_experts=2)
    assert _backend("packed").supports(cfg, torch.device("cuda")).ok
    assert _backend("emulated").supports(cfg, torch.device("cuda")).ok
    ok, reason = LutBSm107Experts.supports(cfg, torch.device("cuda"))
    if torch.cuda.get_device_capability() != (10, 7):
        assert not ok and "10.7" in reason
