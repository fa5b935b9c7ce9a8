"""The LUT-B quantizer: valid tiles, deterministic, close to the dense weights, sane on edge cases."""

from __future__ import annotations

import math

import pytest
import torch

from lutb_kernels.checkpoint import CheckpointConfig, check_layer
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.quantizer import (
    QuantizedMatrix,
    fit_positions,
    nearest_codes,
    quantize_layer,
    quantize_matrix,
    quantize_tile_fields,
    stack_w13,
)
from lutb_kernels.tiles import tiles_to_dense, unpack_tiles, validate_tiles


def _fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def _check_stats(w: torch.Tensor, q: QuantizedMatrix) -> None:
    """The reported statistics are those of the tiles as a reader decodes them."""
    dense = tiles_to_dense(q.tiles).double()
    noise = (dense - w.double()).square().sum(dim=(-2, -1))
    signal = w.double().square().sum(dim=(-2, -1))
    torch.testing.assert_close(q.noise_energy, noise, rtol=1e-9, atol=0)
    torch.testing.assert_close(q.signal_energy, signal, rtol=1e-9, atol=0)
    torch.testing.assert_close(q.sqnr_db, 10 * torch.log10(signal / noise), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(q.rel_rmse, torch.sqrt(noise / signal), rtol=1e-9, atol=0)


@pytest.mark.parametrize("shape", [(128, 128), (256, 384), (3, 128, 256), (2, 2, 128, 128)])
def test_gaussian_tiles_valid_and_close(shape: tuple[int, ...]) -> None:
    std = float(torch.empty(()).uniform_(1e-3, 10.0))
    w = torch.randn(shape) * std
    q = quantize_matrix(w, seed=_fresh_seed())
    *lead, n, k = shape
    assert q.tiles.shape == (*lead, n // 128, k // 128, 6672) and q.tiles.dtype == torch.uint8
    validate_tiles(q.tiles, "w")
    assert q.sqnr_db.shape == tuple(lead)
    assert bool((q.sqnr_db >= 14.0).all()), q.sqnr_db
    _check_stats(w, q)


def test_deterministic_for_a_seed_and_independent_of_chunking() -> None:
    w = torch.randn(2, 256, 384)
    seed = _fresh_seed()
    a = quantize_matrix(w, seed=seed)
    b = quantize_matrix(w, seed=seed, chunk_tiles=1)
    c = quantize_matrix(w[1], seed=seed)
    assert torch.equal(a.tiles, b.tiles)
    assert torch.equal(a.tiles[1], c.tiles)
    other = quantize_matrix(w, seed=seed + 1)
    assert other.tiles.shape == a.tiles.shape  # another subsample: a valid, possibly different, answer
    validate_tiles(other.tiles, "w")


def test_bfloat16_input_and_device_argument() -> None:
    w = (torch.randn(128, 256) * 0.02).to(torch.bfloat16)
    q = quantize_matrix(w, device="cpu")
    assert q.tiles.device == w.device
    _check_stats(w.float(), q)
    assert float(q.sqnr_db) >= 14.0


def test_refinement_does_not_reduce_sqnr() -> None:
    w = torch.distributions.StudentT(4.0).sample((256, 256))
    plain = quantize_matrix(w, refinements=0)
    refined = quantize_matrix(w, refinements=2)
    assert float(refined.sqnr_db) >= float(plain.sqnr_db) - 0.02
    assert float(refined.sqnr_db) > 12.0


def test_codes_are_nearest_entry_of_the_stored_lut() -> None:
    w = torch.randn(128, 256)
    q = quantize_matrix(w)
    codes, scales, lut = unpack_tiles(q.tiles.reshape(-1, 6672))
    lut32 = lut.float()
    assert bool((lut32[:, 1:] >= lut32[:, :-1]).all())
    # Normalized values, from the dense weights laid out in tiles.
    x = w.reshape(1, 128, 2, 128).transpose(1, 2).reshape(2, 128, 4, 32)
    xn = x * torch.exp2(127 - scales.double()).float().unsqueeze(-1)
    dist = (xn.unsqueeze(-1) - lut32.view(2, 1, 1, 1, 8)).abs()
    chosen = dist.gather(-1, codes.reshape(2, 128, 4, 32, 1).long()).squeeze(-1)
    assert bool((chosen <= dist.min(dim=-1).values * (1 + 1e-6) + 1e-30).all())


def test_nearest_codes_boundaries() -> None:
    lut = torch.tensor([[-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0]])
    x = torch.tensor([[-10.0, -2.5, -2.4, 0.5, 0.51, 3.49, 3.5, 3.51, 100.0]])
    assert nearest_codes(x, lut).tolist() == [[0, 0, 1, 3, 4, 6, 6, 7, 7]]


def test_zero_matrix() -> None:
    w = torch.zeros(128, 256)
    q = quantize_matrix(w)
    validate_tiles(q.tiles, "w")
    assert bool((tiles_to_dense(q.tiles) == 0).all())
    assert math.isinf(float(q.sqnr_db)) and float(q.rel_rmse) == 0.0


@pytest.mark.parametrize("value", [1.0, -0.0173, 3.0e5, 1.0e-30])
def test_constant_matrix(value: float) -> None:
    w = torch.full((128, 128), value)
    q = quantize_matrix(w)
    validate_tiles(q.tiles, "w")
    dense = tiles_to_dense(q.tiles)
    # Only the bfloat16 rounding of the one LUT entry in use remains.
    torch.testing.assert_close(dense, w, rtol=2**-8, atol=0)
    assert float(q.sqnr_db) > 45


def test_zero_groups_inside_a_tile_decode_to_zero_or_negligible() -> None:
    w = torch.randn(128, 128)
    w[:, :32] = 0
    w[5] = 0
    q = quantize_matrix(w)
    dense = tiles_to_dense(q.tiles)
    assert float(dense[:, :32].abs().max()) < 1e-30 and float(dense[5].abs().max()) < 1e-30
    assert float(q.sqnr_db) >= 14.0


def test_mixed_magnitudes_keep_small_rows_accurate() -> None:
    # Rows differing by 2**40 share tiles; each (row, group) scale keeps its own precision.
    w = torch.randn(256, 128)
    w[::2] *= 2.0**20
    w[1::2] *= 2.0**-20
    q = quantize_matrix(w)
    dense = tiles_to_dense(q.tiles)
    small = w[1::2]
    rel = float((dense[1::2] - small).square().sum() / small.square().sum())
    assert 10 * math.log10(1 / rel) > 10.0


def test_extreme_but_finite_magnitudes() -> None:
    w = torch.randn(128, 128)
    w[:64] *= 1e30
    w[64:] *= 1e-38  # float32 subnormals and tiny normals
    q = quantize_matrix(w)
    validate_tiles(q.tiles, "w")
    assert bool(torch.isfinite(tiles_to_dense(q.tiles)).all())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_refused(bad: float) -> None:
    w = torch.randn(128, 128)
    w[17, 99] = bad
    with pytest.raises(NonFiniteInputError, match="layers.0.w13"):
        quantize_matrix(w, name="layers.0.w13")


@pytest.mark.parametrize("fill", [3.4e38, -3.4e38])
def test_finite_weights_beyond_bfloat16_refused(fill: float) -> None:
    """Finite float32 weights past bfloat16's largest value once came out as tiles that decode to inf."""
    w = torch.randn(128, 128)
    w[:3] = fill
    with pytest.raises(ValueError, match="layers.1.w2: weights too large for LUT-B"):
        quantize_matrix(w, name="layers.1.w2", iterations=1, refinements=0)


@pytest.mark.parametrize("shape", [(100, 128), (128, 96), (128,)])
def test_bad_shapes_refused(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_matrix(torch.randn(shape))


def test_integer_input_refused() -> None:
    with pytest.raises(ValueError, match="floating point"):
        quantize_matrix(torch.ones(128, 128, dtype=torch.int32))


def test_tile_fields_direct() -> None:
    x = torch.randn(3, 128, 128)
    codes, scales, lut = quantize_tile_fields(x)
    assert codes.shape == (3, 128, 128) and codes.dtype == torch.uint8 and int(codes.max()) <= 7
    assert scales.shape == (3, 128, 4) and scales.dtype == torch.uint8 and int(scales.max()) <= 254
    assert lut.shape == (3, 8) and lut.dtype == torch.bfloat16


@pytest.mark.parametrize("activation", ["silu", "silu_no_mul"])
def test_quantize_layer_stacks_gate_over_up(activation: str) -> None:
    e, i, h = 3, 128, 256
    gate = torch.randn(e, i, h) * 0.02
    up = torch.randn(e, i, h) * 0.05 if activation == "silu" else None
    down = torch.randn(e, h, i) * 0.02
    ids = torch.tensor([1, 4, 6])
    q = quantize_layer(gate, up, down, expert_ids=ids)
    cfg = CheckpointConfig(hidden_size=h, intermediate_size=i, num_experts=8, activation=activation)
    check_layer(cfg, 0, q.weights)
    assert q.weights.expert_ids.dtype == torch.int32 and q.weights.expert_ids.tolist() == [1, 4, 6]
    dense13 = tiles_to_dense(q.weights.w13)
    ref13 = stack_w13(gate, up)
    assert dense13.shape == ref13.shape
    # Gate rows first: the first I rows are close to gate, not to up.
    rel = lambda a, b: float((a - b).square().sum() / b.square().sum())  # noqa: E731
    assert rel(dense13[:, :i], gate) < 0.05
    if up is not None:
        assert rel(dense13[:, i:], up) < 0.05
    assert rel(tiles_to_dense(q.weights.w2), down) < 0.05
    assert q.w13.sqnr_db.shape == (e,) and q.w2.sqnr_db.shape == (e,)


def test_quantize_layer_shape_mismatch() -> None:
    with pytest.raises(ValueError):
        quantize_layer(torch.randn(2, 128, 256), torch.randn(2, 128, 256), torch.randn(2, 128, 256))


@pytest.mark.parametrize("part", ["gate", "up", "down"])
@pytest.mark.parametrize("bad", [float("nan"), 3.4e38], ids=["nan", "too-large"])
def test_quantize_layer_names_the_bad_tensor_expert_and_row(part: str, bad: float) -> None:
    """Gate and up are quantized stacked as W13 [E, 2I, H], and a bad value in either was reported as "w13" (a name
    the caller never wrote) with a row of the stacked matrix: up row 5 of expert 1 read as "row 133 of matrix [1]"."""
    e, i, h = 3, 128, 128
    ws = {"gate": torch.randn(e, i, h) * 0.02, "up": torch.randn(e, i, h) * 0.02, "down": torch.randn(e, h, i) * 0.02}
    ids = torch.tensor([2, 5, 7])
    slot, row = int(torch.randint(0, e, ())), int(torch.randint(0, i, ()))
    ws[part][slot, row, int(torch.randint(0, h, ()))] = bad
    with pytest.raises(ValueError) as info:
        quantize_layer(ws["gate"], ws["up"], ws["down"], expert_ids=ids, iterations=1, refinements=0)
    msg = str(info.value)
    what = "weights hold NaN or infinity" if bad != bad else "weights too large for LUT-B"
    assert msg.startswith(f"{part} of expert {int(ids[slot])}: {what}"), msg
    assert f"(row {row})" in msg or f"; row {row} holds" in msg, msg
    assert "w13" not in msg and "matrix" not in msg, msg
    assert isinstance(info.value, NonFiniteInputError) == (bad != bad)


def test_quantize_layer_refuses_expert_ids_of_another_length() -> None:
    with pytest.raises(ValueError, match=r"expert_ids: shape \(2,\), expected \(3,\)"):
        quantize_layer(torch.randn(3, 128, 128), None, torch.randn(3, 128, 128), expert_ids=torch.tensor([0, 1]))


def test_one_weight_beyond_bfloat16_is_refused_even_where_the_fit_misses_it() -> None:
    """Whether a finite float32 weight past bfloat16's range was refused depended on the LUT fit: one outlier at a
    position the fit's subsample skips (refinements=0) was clipped silently to ~8e37 and valid tiles came out."""
    seed = _fresh_seed()
    fitted = set(fit_positions(4096, seed).tolist())
    pos = next(p for p in torch.randperm(128 * 128).tolist() if p not in fitted)
    w = torch.randn(256, 128) * 0.02
    tile = int(torch.randint(0, 2, ()))
    row, col = tile * 128 + pos // 128, pos % 128
    w[row, col] = 3.4e38 * (1 if torch.rand(()) < 0.5 else -1)
    with pytest.raises(ValueError, match=rf"layers\.0\.w13: weights too large for LUT-B .*row {row} holds") as info:
        quantize_matrix(w, iterations=1, refinements=0, seed=seed, name="layers.0.w13")
    assert not isinstance(info.value, NonFiniteInputError)


def test_the_too_large_bound_is_bfloat16_max() -> None:
    """The bound docs/format.md (g) promises: bfloat16's largest finite value is accepted, the next float32 is not."""
    top = torch.finfo(torch.bfloat16).max
    w = torch.randn(128, 128) * 0.02
    w[5, 7] = -top
    q = quantize_matrix(w, iterations=1, refinements=0, seed=_fresh_seed())
    validate_tiles(q.tiles, "w")
    assert bool(torch.isfinite(tiles_to_dense(q.tiles)).all())
    w[5, 7] = torch.nextafter(torch.tensor(top), torch.tensor(math.inf))
    with pytest.raises(ValueError, match="too large.*row 5 holds"):
        quantize_matrix(w, iterations=1, refinements=0)


@pytest.mark.parametrize("big", [1e39, -1e300])
def test_float64_weights_beyond_float32_are_too_large_not_non_finite(big: float) -> None:
    """The check ran after the cast to float32, so a finite float64 1e39 (inf in float32) was called NaN or infinity."""
    w = torch.randn(2, 128, 128, dtype=torch.float64)
    row = int(torch.randint(0, 128, ()))
    w[1, row, int(torch.randint(0, 128, ()))] = big
    with pytest.raises(ValueError, match=rf"w2: weights too large for LUT-B .*row {row} of matrix \[1\] holds") as info:
        quantize_matrix(w, iterations=1, refinements=0, name="w2")
    assert not isinstance(info.value, NonFiniteInputError)
    w[1, row] = float("nan")  # NaN in float64 is still NaN
    with pytest.raises(NonFiniteInputError, match=rf"w2: weights hold NaN or infinity \(row {row} of matrix \[1\]\)"):
        quantize_matrix(w, iterations=1, refinements=0, name="w2")


def test_non_finite_refusal_names_the_first_bad_row() -> None:
    w = torch.randn(384, 128, dtype=torch.bfloat16)
    rows = sorted(torch.randperm(384)[:2].tolist())
    w[rows[1], 3] = float("inf")
    w[rows[0], 100] = float("nan")
    with pytest.raises(NonFiniteInputError, match=rf"\(row {rows[0]}\)"):
        quantize_matrix(w, iterations=1, refinements=0, chunk_tiles=1)
