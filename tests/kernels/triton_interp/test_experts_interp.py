"""GPU experts backends vs ReferenceExperts, run on the CPU interpreter at tiny sizes (spec section 6)."""

from __future__ import annotations

import pytest
import torch
from lutb_gpu_testdata import make_batch, make_layer

from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.experts.emulated import LutBEmulationTritonExperts
from lutb_kernels.experts.packed import LutBPackedExperts
from lutb_kernels.experts.reference import ReferenceExperts
from lutb_kernels.experts.sm107 import NATIVE_OP_SCHEMA, LutBSm107Experts
from lutb_kernels.lut_b_gemm import lut_b_moe_gemm_reference
from lutb_kernels.reference import rel_l2

TOL = {torch.float32: 2e-3, torch.float16: 1e-2}
BACKENDS = {"packed": LutBPackedExperts, "packed_dense": LutBPackedExperts, "emulated": LutBEmulationTritonExperts}


def _make(backend: str, cfg: CheckpointConfig, layer):  # noqa: ANN001, ANN202
    """The backend; "packed_dense": packed forced onto its prefill path (dequantized weights)."""
    experts = BACKENDS[backend](cfg, layer, "cpu")
    if backend == "packed_dense":
        experts.dense_from_rows_per_expert = 0
    return experts

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")  # triton interpreter



def _check(backend: str, activation: str, dtype: str, tokens: int, top_k: int, held: list[int], *,
           on_input: bool = False, mode: str = "combined", experts: int = 4, repeat: bool = False) -> None:
    """``repeat``: every token's second route names its first route's expert again."""
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=experts, activation=activation, dtype=dtype)
    layer = make_layer(cfg, held, seed=tokens)
    x, ids, w = make_batch(tokens, top_k, experts, 128, cfg.torch_dtype, seed=tokens + 1)
    if repeat:
        ids[:, 1] = ids[:, 0]
    got = _make(backend, cfg, layer).forward(x, ids, w, apply_router_weight_on_input=on_input, output_mode=mode)
    want = ReferenceExperts(cfg, layer, "cpu").forward(x, ids, w, apply_router_weight_on_input=on_input, output_mode=mode)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert not got.isnan().any()
    if want.numel():
        assert rel_l2(got, want) <= TOL[cfg.torch_dtype]


@pytest.mark.parametrize("activation", ["silu", "gelu", "gelu_tanh", "swigluoai", "silu_no_mul", "gelu_no_mul", "relu2_no_mul"])
def test_packed_every_activation(activation: str) -> None:
    _check("packed", activation, "float32", 9, 2, [0, 1, 2, 3])


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_expert_subset_and_odd_batch(backend: str, dtype: str) -> None:
    _check(backend, "silu", dtype, 33, 2, [1, 3])


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("mode", ["combined", "route_major"])
def test_an_expert_twice_in_one_token(backend: str, mode: str) -> None:
    """Two routes of a token to one expert (spec section 4): both computed, and summed in combined output."""
    _check(backend, "silu", "float32", 6, 3, [0, 1, 2, 3], mode=mode, repeat=True)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
def test_weights_on_input(backend: str) -> None:
    _check(backend, "gelu", "float32", 7, 1, [0, 2, 3], on_input=True)


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("held", [[0, 3], [3, 1, 0, 2]], ids=["shard", "whole-permuted"])
def test_route_major(backend: str, held: list[int]) -> None:
    _check(backend, "swigluoai", "float32", 5, 2, held, mode="route_major")


@pytest.mark.parametrize("backend", ["packed", "emulated"])
@pytest.mark.parametrize("held", [[0, 2], [0, 1, 2, 3]], ids=["shard", "whole"])
def test_forward_unchecked_writes_a_combined_output_into_out(backend: str, held: list[int]) -> None:
    """``out=`` (what CUDA graphs sharing outputs across layers pass): the combined output lands in it, poisoned
    beforehand, bit-equal to the output without it; route-major ignores it."""
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4, activation="silu", dtype="float32")
    ex = _make(backend, cfg, make_layer(cfg, held, seed=3))
    x, ids, w = make_batch(6, 2, 4, 128, cfg.torch_dtype, seed=4)
    want = ex.forward_unchecked(x, ids, w)
    out = torch.full((6, 128), float("nan"))
    got = ex.forward_unchecked(x, ids, w, out=out)
    assert got is out and torch.equal(out, want)
    route_major = ex.forward_unchecked(x, ids, w, output_mode="route_major", out=torch.full((6, 128), float("nan")))
    assert route_major.shape == (6, 2, 128) and not route_major.isnan().any()
    empty = torch.empty((0, 128))
    assert ex.forward_unchecked(x[:0], ids[:0], w[:0], out=empty) is empty


def test_whole_layer() -> None:
    """A layer holding every expert (in any order) is whole; one holding some is a shard."""
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4)
    assert LutBPackedExperts(cfg, make_layer(cfg, [2, 0, 3, 1]), "cpu").whole_layer
    assert not LutBPackedExperts(cfg, make_layer(cfg, [0, 1, 2]), "cpu").whole_layer


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("held", [[2, 0, 3, 1], [1, 3]], ids=["whole", "shard"])
@pytest.mark.parametrize("mode", ["combined", "route_major"])
def test_padding_routes_get_no_rows(backend: str, held: list[int], mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens padded as CudaGraphExperts pads a bucket (x 0, weights 0, every id -1) get no GEMM rows, whole layer
    or shard: the routing's rows in use are those of the real tokens alone; the real tokens' outputs are the
    reference's, and nothing is flagged."""
    import lutb_kernels.experts._triton_common as common
    from lutb_kernels.routing import moe_align_block_size

    totals = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        routing = moe_align_block_size(*args, **kwargs)
        totals.append(int(routing[2]))
        return routing

    monkeypatch.setattr(common, "moe_align_block_size_triton", spy)
    monkeypatch.setattr(common, "moe_align_block_size", spy)
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4, activation="silu", dtype="float32")
    layer = make_layer(cfg, held, seed=8)
    real, bucket = 5, 8
    x, ids, w = make_batch(real, 2, 4, 128, cfg.torch_dtype, seed=9)
    xp, idp, wp = torch.zeros(bucket, 128), torch.full((bucket, 2), -1, dtype=torch.int32), torch.zeros(bucket, 2)
    xp[:real], idp[:real], wp[:real] = x, ids, w
    ex = _make(backend, cfg, layer)
    flag = torch.zeros(1, dtype=torch.int32)
    got = ex.forward_unchecked(xp, idp, wp, output_mode=mode, nonfinite=flag)
    want = ReferenceExperts(cfg, layer, "cpu").forward(x, ids, w, output_mode=mode)
    assert int(flag) == 0 and rel_l2(got[:real], want) <= TOL[torch.float32]
    block = ex.route_block(bucket * 2)
    assert totals == [int(moe_align_block_size(ids, block, 4, ex.expert_map())[2])]  # the real tokens' rows only
    if mode == "route_major" and not ex.whole_layer:
        assert not got[real:].any()  # a shard's routes not held are zeros


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
def test_single_token_and_empty_batch(backend: str) -> None:
    _check(backend, "relu2_no_mul", "float16", 1, 2, [0, 1, 2, 3])
    _check(backend, "silu", "float32", 0, 2, [0, 1])


@pytest.mark.parametrize("backend", ["packed", "packed_dense", "emulated"])
def test_nonfinite_and_bad_input_refused(backend: str) -> None:
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2, dtype="float32")
    ex = _make(backend, cfg, make_layer(cfg, [0, 1]))
    x, ids, w = make_batch(3, 1, 2, 128, torch.float32)
    x[1, 7] = float("nan")
    with pytest.raises(NonFiniteInputError):
        ex.forward(x, ids, w)
    x[1, 7] = 0.0
    with pytest.raises(ValueError):
        ex.forward(x, ids + 5, w)  # expert ids out of range
    with pytest.raises(ValueError):
        ex.forward(x[:, :64], ids, w)
    assert ex.weight_bytes > 0


@pytest.mark.parametrize("backend", ["reference", "packed", "packed_dense", "emulated"])
def test_every_backend_refuses_the_same_input(backend: str) -> None:
    """A NaN in a token routed only to experts this shard does not hold, ``x`` in another dtype than the model's, and
    (weights on input) ``x * w`` overflowing in such a token: every backend refuses all three (the reference once
    answered the first and the third with zeros and converted the second)."""
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4, dtype="float32")
    layer = make_layer(cfg, [0, 1])
    ex = ReferenceExperts(cfg, layer, "cpu") if backend == "reference" else _make(backend, cfg, layer)
    x, ids, w = make_batch(3, 2, 4, 128, torch.float32, seed=5)
    ids[1] = torch.tensor([2, 3], dtype=ids.dtype)  # token 1: no expert held here
    ex.forward(x, ids, w)  # finite: answered
    x[1, 5] = float("nan")
    with pytest.raises(NonFiniteInputError):
        ex.forward(x, ids, w)
    x[1, 5] = 0.0
    with pytest.raises(ValueError, match="model dtype"):
        ex.forward(x.half(), ids, w)
    # weights on input: x * w (spec step 1) overflows in a token routed to no expert held here, x and w finite
    x1, ids1, w1 = make_batch(3, 1, 4, 128, torch.float32, seed=6)
    ids1[:, 0] = torch.tensor([0, 2, 1], dtype=ids1.dtype)
    ex.forward(x1, ids1, w1, apply_router_weight_on_input=True)  # finite: answered
    x1[1, 3], w1[1, 0] = 3.0e38, 4.0
    with pytest.raises(NonFiniteInputError):
        ex.forward(x1, ids1, w1, apply_router_weight_on_input=True)


@pytest.mark.parametrize("backend", ["reference", "packed", "packed_dense", "emulated"])
@pytest.mark.parametrize("token", [0, 1], ids=["held", "not-held"])
def test_every_backend_refuses_a_float16_qdq_that_overflows(backend: str, token: int) -> None:
    """float16 x of 64000 (finite) is 250 x 2^8 in its block, which e4m3 rounds to 256 x 2^8 = 65536: spec step 2's
    QDQ rounded to float16 is infinite (docs/format.md (k)). Every backend refuses it, in a token routed to an expert
    held here or not; the packed path once answered it, feeding its GEMM the exact 65536 in bfloat16."""
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4, activation="silu", dtype="float16")
    layer = make_layer(cfg, [0, 1])
    ex = ReferenceExperts(cfg, layer, "cpu") if backend == "reference" else _make(backend, cfg, layer)
    x, ids, w = make_batch(2, 2, 4, 128, torch.float16, seed=7)
    ids[1] = torch.tensor([2, 3], dtype=ids.dtype)  # token 1: no expert held here
    assert torch.isfinite(ex.forward(x, ids, w)).all()
    if token == 1:  # 63000 rounds down to 61440: finite, answered (in a held token its h would overflow float16)
        x[token, 40] = 63000.0
        assert torch.isfinite(ex.forward(x, ids, w)).all()
    x[token, 40] = 64000.0
    with pytest.raises(NonFiniteInputError, match="32-block"):
        ex.forward(x, ids, w)


def test_packed_takes_the_dense_path_by_rows_per_expert() -> None:
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=8)
    ex = LutBPackedExperts(cfg, make_layer(cfg, [0, 1, 2, 3]), "cpu")  # a shard: 4 of 8 experts held
    limit = ex.dense_from_rows_per_expert
    assert limit is not None
    # half the routes go to experts held elsewhere: 8 * limit routes give the held ones `limit` each
    assert not ex.uses_dense_weights(8 * limit - 1) and ex.uses_dense_weights(8 * limit)
    assert not ex.uses_dense_weights(1)
    assert ex.dense_bytes == 4 * 256 * 128 * 2  # W13 of 4 experts (2I x H) in bf16
    ex.dense_scratch_bytes = ex.dense_bytes - 1  # a layer too large for the scratch keeps decoding in the GEMM
    assert not ex.uses_dense_weights(1 << 30)
    ex.dense_scratch_bytes = ex.dense_bytes
    assert ex.uses_dense_weights(1 << 30)
    ex.dense_from_rows_per_expert = None
    assert not ex.uses_dense_weights(1 << 30)


# (held experts of 8, routes in the batch, route block): a shard sizes its blocks by the routes it
# receives (uniform share), as the whole layer would for the same rows per held expert.
ROUTE_BLOCK_CASES = [
    (8, 8 * 16, 16), (8, 8 * 17, 32), (8, 8 * 100, 128), (8, 8 * 600, 256),
    (4, 8 * 16, 16), (4, 8 * 17, 32), (4, 8 * 100, 128), (4, 8 * 600, 256),
    (2, 8 * 60, 64), (2, 1, 16), (1, 8 * 600, 256),
]


@pytest.mark.parametrize("held, routes, block", ROUTE_BLOCK_CASES)
def test_route_block_by_rows_per_held_expert(held: int, routes: int, block: int) -> None:
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=8)
    assert LutBPackedExperts(cfg, make_layer(cfg, list(range(held))), "cpu").route_block(routes) == block


def test_supports_refuses_cpu() -> None:
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2)
    for cls in (LutBPackedExperts, LutBEmulationTritonExperts, LutBSm107Experts):
        ok, reason = cls.supports(cfg, torch.device("cpu"))
        assert not ok and "CUDA" in reason


@pytest.fixture
def stand_in_native_op():
    """Registers torch.ops.lutb.lut_b_moe_gemm for the CPU, forwarding to the torch reference."""
    lib = torch.library.Library("lutb", "FRAGMENT")
    lib.define(NATIVE_OP_SCHEMA)
    calls = []

    def impl(a, a_scales, w, out, topk_weights, sorted_token_ids, expert_ids, ntpp, top_k):  # noqa: ANN001
        calls.append(top_k)
        lut_b_moe_gemm_reference(a, a_scales, w, out, topk_weights, sorted_token_ids, expert_ids, ntpp, top_k, block_m=128)

    lib.impl("lut_b_moe_gemm", impl, "CPU")
    yield calls
    lib._destroy()


def test_native_flow_on_a_stand_in_op(stand_in_native_op) -> None:  # noqa: ANN001
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=4, activation="silu", dtype="float32")
    layer = make_layer(cfg, [0, 2, 3])
    x, ids, w = make_batch(6, 2, 4, 128, torch.float32)
    got = LutBSm107Experts(cfg, layer, "cpu").forward(x, ids, w)
    want = ReferenceExperts(cfg, layer, "cpu").forward(x, ids, w)
    assert rel_l2(got, want) <= 2e-3
    assert stand_in_native_op == [2, 1]  # GEMM1 with top_k, GEMM2 with 1
    assert not LutBSm107Experts(cfg, layer, "cpu").uses_dense_weights(1 << 30)  # never the packed prefill path
    ok, reason = LutBSm107Experts.supports(cfg, torch.device("cpu"))
    assert not ok


def test_packed_keeps_the_kernel_layout_without_touching_the_callers_tiles() -> None:
    """LutBPackedExperts holds its tiles in the kernel layout (``kernel_layout``) on a copy: the layer it was built
    from still holds the checkpoint's bytes (on the CPU ``.to(device)`` would otherwise alias them)."""
    from lutb_kernels.tiles import to_kernel_layout

    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2, activation="silu", dtype="float32")
    layer = make_layer(cfg, [0, 1], seed=5)
    w13, w2 = layer.w13.clone(), layer.w2.clone()
    experts = LutBPackedExperts(cfg, layer, "cpu")
    assert torch.equal(layer.w13, w13) and torch.equal(layer.w2, w2)
    assert torch.equal(experts.w13, to_kernel_layout(w13)) and torch.equal(experts.w2, to_kernel_layout(w2))
    assert not LutBSm107Experts.kernel_layout
