"""Dense expert weights -> LUT-B v1 tiles (spec sections 1 and 2).

Per 128 x 128 tile the quantizer chooses an E8M0 exponent for every
(row, 32-column group) and one 8-entry bfloat16 lookup table:

1. **Initial scales.** Each group's exponent ``e`` is ``ceil(log2(amax))`` of
   the group, so the group's values divided by ``2**e`` lie in ``[-1, 1]``
   ("normalized values"). An all-zero group gets the smallest scale (byte 0).
2. **LUT fit.** Lloyd's algorithm (1-D k-means, 8 centroids) on a fixed random
   subsample of ``fit_samples`` positions of every tile, initialised at the
   subsample's octile midpoints. Each sample is weighted by ``4**e`` of its
   group, so the fit minimises the squared error of the *decoded* weights, not
   of the normalized ones. The LUT is fitted in float32, rounded to bfloat16 and
   kept sorted.
3. **Refinements** (``refinements`` rounds): for every group try the exponents
   ``e - 1``, ``e``, ``e + 1`` against the current (rounded) LUT, keep the one
   with the smallest squared error over the group's 32 values, then refit the
   LUT (step 2, warm-started from the current LUT). The last refit uses every
   position of the tile (``final_iterations`` Lloyd steps) instead of the subsample.
4. **Codes.** Every value gets the code of the nearest entry of the rounded
   LUT, found by comparing against the midpoints between sorted entries (ties
   go to the smaller entry).

All of it is batched over tiles (no Python loop per tile), runs on the device
given, and processes ``chunk_tiles`` tiles at a time so memory stays bounded.
Each tile is quantized independently of the others, so the result does not
depend on the chunk size or on how experts are batched; for a fixed ``seed``
(which picks the subsample positions) it is deterministic.

Quality is measured against the tiles as a reader decodes them
(:func:`lutb_kernels.tiles.decode_tiles`), per matrix: SQNR in dB,
``10 log10(sum w^2 / sum (w - dequant(w))^2)``, and the relative RMSE
``sqrt(sum (w - dequant(w))^2 / sum w^2)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from lutb_kernels.activations import is_gated
from lutb_kernels.checkpoint import LayerWeights
from lutb_kernels.errors import NonFiniteInputError
from lutb_kernels.tiles import GROUP, GROUPS_PER_ROW, LUT_ENTRIES, TILE, TILE_BYTES, decode_tiles, pack_tiles

DEFAULT_ITERATIONS = 6
"""Lloyd iterations per LUT fit."""
DEFAULT_REFINEMENTS = 3
"""Rounds of (choose scales among e-1, e, e+1; refit LUT)."""
DEFAULT_FINAL_ITERATIONS = 3
"""Lloyd iterations of the last refit, which uses every position of the tile."""
DEFAULT_FIT_SAMPLES = 4096
"""Positions per tile (of 16384) the LUT is fitted on."""
E_MIN = -127
"""Exponent of E8M0 byte 0."""
E_MAX = 127
"""Exponent of E8M0 byte 254 (255 is NaN)."""
LARGEST_WEIGHT = float(torch.finfo(torch.bfloat16).max)
"""The largest weight magnitude LUT-B encodes: bfloat16's largest finite value, ``(2 - 2**-7) * 2**127``
(about 3.3895e38). A tile decodes to bfloat16 numbers and a reader refuses one whose decoded magnitude
overflows bfloat16 (spec section 1), so no tile holds a larger weight; :func:`check_weights` refuses
any weight above it (docs/format.md (g): "weights of magnitude above about 3.39e38 cannot be encoded")."""
_TILE_ELEMS = TILE * TILE
_GROUPS = TILE * GROUPS_PER_ROW


class QuantizedMatrix(NamedTuple):
    """A stack of quantized matrices and how close they came.

    ``tiles``: uint8 ``[..., N/128, K/128, 6672]`` on the input's device.
    ``sqnr_db``: float64 ``[...]``, per matrix, ``inf`` for an exactly reproduced matrix.
    ``rel_rmse``: float64 ``[...]``, per matrix (0 for an all-zero matrix reproduced exactly).
    ``signal_energy``, ``noise_energy``: float64 ``[...]``, ``sum w^2`` and
    ``sum (w - dequant(w))^2`` per matrix, to combine statistics over matrices.
    """

    tiles: torch.Tensor
    sqnr_db: torch.Tensor
    rel_rmse: torch.Tensor
    signal_energy: torch.Tensor
    noise_energy: torch.Tensor


class QuantizedLayer(NamedTuple):
    """One layer's experts, packed (``weights``), and the statistics of ``w13`` and ``w2``."""

    weights: LayerWeights
    w13: QuantizedMatrix
    w2: QuantizedMatrix


def sqnr_db(signal_energy: torch.Tensor | float, noise_energy: torch.Tensor | float) -> torch.Tensor:
    """``10 log10(signal / noise)`` as float64; ``inf`` where the noise is 0."""
    s = torch.as_tensor(signal_energy, dtype=torch.float64)
    n = torch.as_tensor(noise_energy, dtype=torch.float64)
    out = 10 * torch.log10(s / n)
    return torch.where(n == 0, torch.full_like(out, math.inf), out)


def rel_rmse(signal_energy: torch.Tensor | float, noise_energy: torch.Tensor | float) -> torch.Tensor:
    """``sqrt(noise / signal)`` as float64; 0 where the noise is 0, ``inf`` where only the signal is."""
    s = torch.as_tensor(signal_energy, dtype=torch.float64)
    n = torch.as_tensor(noise_energy, dtype=torch.float64)
    out = torch.sqrt(n / s)
    return torch.where(n == 0, torch.zeros_like(out), out)


def _default_chunk_tiles(device: torch.device) -> int:
    return 4096 if device.type == "cuda" else 64


def fit_positions(fit_samples: int, seed: int) -> torch.Tensor:
    """The sorted tile positions (flat indices into 128 x 128, row-major) the LUT is fitted on."""
    if fit_samples >= _TILE_ELEMS:
        return torch.arange(_TILE_ELEMS)
    if fit_samples < LUT_ENTRIES:
        raise ValueError(f"fit_samples must be at least {LUT_ENTRIES}, got {fit_samples}")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(_TILE_ELEMS, generator=gen)[:fit_samples].sort().values


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """ceil(log2(v)) of positive finite float32 as int32 (exact)."""
    mant, exp = torch.frexp(v)
    return torch.where(mant == 0.5, exp - 1, exp)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """``2**e`` as float32 for integer ``e`` in [-149, 127] (exact, subnormals included)."""
    return torch.exp2(e.double()).float()


def _midpoints(lut: torch.Tensor) -> torch.Tensor:
    """Decision boundaries ``[T, 7]`` of a sorted LUT ``[T, 8]`` (float32)."""
    return 0.5 * (lut[:, 1:] + lut[:, :-1])


def nearest_codes(xn: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Index of the nearest entry of a sorted LUT for every value.

    Args:
        xn: float32 ``[T, ...]``.
        lut: float32 ``[T, 8]``, ascending along the last dimension.

    Returns:
        uint8 codes, the shape of ``xn``; a value exactly on a midpoint gets the lower entry.
    """
    bounds = _midpoints(lut)
    view = (bounds.shape[0],) + (1,) * (xn.dim() - 1)
    codes = torch.zeros(xn.shape, dtype=torch.uint8, device=xn.device)
    for j in range(LUT_ENTRIES - 1):
        codes += xn > bounds[:, j].view(view)
    return codes


def _lookup(lut: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
    """``lut[t, codes[t, ...]]`` as float32, the shape of ``codes``."""
    flat = torch.gather(lut, 1, codes.reshape(codes.shape[0], -1).long())
    return flat.reshape(codes.shape)


def _group_sq_error(xn: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """Squared error of nearest-entry coding summed per group: xn ``[T,128,4,32]`` -> ``[T,128,4]``."""
    q = _lookup(lut, nearest_codes(xn, lut))
    return q.sub_(xn).square_().sum(dim=-1)


def _round_lut(lut: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 (as float32 values) and sort ascending."""
    return lut.to(torch.bfloat16).float().sort(dim=-1).values


def _fit_lut(xs: torch.Tensor, ws: torch.Tensor, lut: torch.Tensor, iterations: int) -> torch.Tensor:
    """Weighted Lloyd iterations on samples ``xs [T, S]`` with weights ``ws [T, S]``, from ``lut [T, 8]``."""
    wx = xs * ws
    for _ in range(iterations):
        codes = nearest_codes(xs, lut).long()
        sums = torch.zeros_like(lut).scatter_add_(1, codes, wx)
        mass = torch.zeros_like(lut).scatter_add_(1, codes, ws)
        lut = torch.where(mass > 0, sums / mass.clamp_min(torch.finfo(torch.float32).tiny), lut)
        lut = lut.sort(dim=-1).values
    return lut


def _samples(xn: torch.Tensor, e: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Subsample of normalized values ``[T, S]`` and their weights ``4**(e - max e of the tile)``."""
    t = xn.shape[0]
    xs = xn.reshape(t, _TILE_ELEMS)[:, positions]
    rel = e - e.reshape(t, -1).amax(dim=1).view(t, 1, 1)
    w = torch.exp2(2.0 * rel.float()).reshape(t, _GROUPS)  # underflows to 0 far below the tile's top
    ws = w[:, positions // GROUP]
    return xs, ws


def _initial_lut(xs: torch.Tensor) -> torch.Tensor:
    """Octile midpoints of each tile's samples ``[T, S]`` -> ``[T, 8]``."""
    s = xs.shape[1]
    ranks = ((torch.arange(LUT_ENTRIES, device=xs.device, dtype=torch.float64) + 0.5) * s / LUT_ENTRIES).long()
    return xs.sort(dim=1).values[:, ranks]


def _first_row(mask: torch.Tensor) -> int | None:
    """Index of the first row (last dimension = columns, all others flattened into rows) holding a True; None if none."""
    hit = mask.reshape(-1, mask.shape[-1]).any(dim=1).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def _row_label(row: int, shape: tuple[int, ...]) -> str:
    """``row`` of the rows of a ``[..., N, K]`` tensor, flattened: ``"row r"`` or ``"row r of matrix [i, j]"``."""
    *lead, n, _ = shape
    if not lead:
        return f"row {row}"
    index, rest = [], row // n
    for size in reversed(lead):
        index.append(rest % size)
        rest //= size
    return f"row {row % n} of matrix {list(reversed(index))}"


def check_weights(w: torch.Tensor, name: str = "w", *, row_offset: int = 0, shape: tuple[int, ...] | None = None) -> None:
    """Refuse dense weights LUT-B cannot encode, naming the tensor and the first offending row.

    Checked in ``w``'s own dtype (on its device), before any cast: NaN or infinity first, then any
    magnitude above :data:`LARGEST_WEIGHT` (bfloat16's largest finite value, about 3.3895e38, the largest a
    tile can decode to). So a float64 weight of 1e39 is "too large", not "NaN or infinity", and a float32
    weight of 3.4e38 is refused whatever LUT the fit would have found.

    Args:
        w: float ``[..., N, K]`` (at least 2-D); its rows are the vectors of the last dimension.
        name: the tensor's name, for the message.
        row_offset, shape: for a piece of a larger tensor (flattened to rows ``[R, K]``): the index of
            ``w``'s first row among them, and the whole tensor's shape ``[..., N, K]`` (default: ``w``'s).

    Raises:
        NonFiniteInputError: ``w`` holds NaN or infinity.
        ValueError: ``w`` holds a finite value of magnitude above :data:`LARGEST_WEIGHT`.
    """
    shape = tuple(w.shape) if shape is None else tuple(shape)
    if not bool(torch.isfinite(w).all()):
        row = _first_row(~torch.isfinite(w))
        raise NonFiniteInputError(f"{name}: weights hold NaN or infinity ({_row_label(row_offset + row, shape)})")
    if torch.finfo(w.dtype).max > LARGEST_WEIGHT:  # float32, float64: bfloat16 and float16 cannot exceed it
        big = w.abs() > LARGEST_WEIGHT
        if bool(big.any()):
            row = _first_row(big)
            value = float(w.reshape(-1, w.shape[-1])[row][big.reshape(-1, w.shape[-1])[row]][0])
            raise ValueError(f"{name}: weights too large for LUT-B (decoded weights are bfloat16, largest finite "
                             f"{LARGEST_WEIGHT:.4g}; {_row_label(row_offset + row, shape)} holds {value:.4g})")


def quantize_tile_fields(
    x: torch.Tensor,
    *,
    iterations: int = DEFAULT_ITERATIONS,
    refinements: int = DEFAULT_REFINEMENTS,
    positions: torch.Tensor | None = None,
    final_iterations: int = DEFAULT_FINAL_ITERATIONS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize a batch of tiles to their LUT-B fields (steps 1-4 of the module docstring).

    Args:
        x: float32 ``[T, 128, 128]``, finite, on the compute device.
        positions: int64 ``[S]`` fit positions (see :func:`fit_positions`); None fits on every position.
        final_iterations: Lloyd iterations of the last refit (on every position); 0 keeps the
            last refit on the subsample with ``iterations`` steps.

    Returns:
        ``(codes, scales, lut)``: uint8 ``[T, 128, 128]``, uint8 ``[T, 128, 4]``, bfloat16 ``[T, 8]``,
        ready for :func:`lutb_kernels.tiles.pack_tiles`.
    """
    t = x.shape[0]
    x = x.reshape(t, TILE, GROUPS_PER_ROW, GROUP)
    every = torch.arange(_TILE_ELEMS, device=x.device)
    positions = every if positions is None else positions.to(x.device)
    amax = x.abs().amax(dim=-1)
    e = torch.where(amax > 0, _ceil_log2(torch.where(amax > 0, amax, 1.0)), E_MIN).clamp(E_MIN, E_MAX)

    xn = x * _pow2(-e).unsqueeze(-1)
    xs, ws = _samples(xn, e, positions)
    lut = _round_lut(_fit_lut(xs, ws, _initial_lut(xs), iterations))
    for r in range(refinements):
        best_err = None
        best_d = torch.zeros_like(e)
        for d in (0, -1, 1):  # d = 0 first so ties keep the current exponent
            err = _group_sq_error(xn, lut * 2.0**d)
            if d:
                err = torch.where((e + d >= E_MIN) & (e + d <= E_MAX), err, math.inf)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_d = torch.where(better, d, best_d)
        e = e + best_d
        xn = x * _pow2(-e).unsqueeze(-1)
        last = r == refinements - 1 and final_iterations > 0
        xs, ws = _samples(xn, e, every if last else positions)
        lut = _round_lut(_fit_lut(xs, ws, lut, final_iterations if last else iterations))

    codes = nearest_codes(xn, lut).reshape(t, TILE, TILE)
    scales = (e + 127).to(torch.uint8)
    return codes, scales, lut.to(torch.bfloat16)


def quantize_matrix(
    w: torch.Tensor,
    *,
    iterations: int = DEFAULT_ITERATIONS,
    refinements: int = DEFAULT_REFINEMENTS,
    seed: int = 0,
    device: torch.device | str | None = None,
    fit_samples: int = DEFAULT_FIT_SAMPLES,
    final_iterations: int = DEFAULT_FINAL_ITERATIONS,
    chunk_tiles: int | None = None,
    progress: Callable[[int], None] | None = None,
    name: str = "w",
) -> QuantizedMatrix:
    """Quantize a stack of dense matrices to LUT-B tiles.

    Args:
        w: float ``[..., N, K]`` (any float dtype, any device), ``N % 128 == K % 128 == 0``, finite.
        iterations: Lloyd iterations per LUT fit.
        refinements: rounds of scale choice (e-1, e, e+1) and LUT refit.
        seed: picks the ``fit_samples`` positions the LUT is fitted on.
        device: where to compute (default: ``w``'s device); ``w`` moves there a chunk at a time.
        fit_samples: positions per tile used to fit the LUT (16384 = all).
        final_iterations: Lloyd iterations of the last refit, over every position.
        chunk_tiles: tiles per batch (default 64 on CPU, 4096 on CUDA).
        progress: called with the number of tiles finished after every chunk.
        name: the tensor's name, for error messages.

    Returns:
        :class:`QuantizedMatrix`; ``tiles`` on ``w``'s device.

    Raises:
        ValueError: bad shape or dtype; a weight of magnitude above :data:`LARGEST_WEIGHT` (bfloat16's
            largest finite value, about 3.3895e38), naming the first such row.
        NonFiniteInputError: ``w`` holds NaN or infinity (in its own dtype), naming the first such row.

    Every chunk is checked with :func:`check_weights` in ``w``'s dtype before it is cast to float32.
    """
    if not w.is_floating_point():
        raise ValueError(f"{name}: weights must be floating point, got {w.dtype}")
    if w.dim() < 2 or w.shape[-1] % TILE or w.shape[-2] % TILE:
        raise ValueError(f"{name}: weights must be [..., N, K] with N and K multiples of {TILE}, got {tuple(w.shape)}")
    if iterations < 0 or refinements < 0:
        raise ValueError("iterations and refinements must be non-negative")
    dev = torch.device(device) if device is not None else w.device
    chunk_tiles = chunk_tiles or _default_chunk_tiles(dev)
    *lead, n, k = w.shape
    nt, kt = n // TILE, k // TILE
    matrices = math.prod(lead)
    strips = w.reshape(matrices * nt, TILE, k)
    out = torch.empty((matrices * nt, kt, TILE_BYTES), dtype=torch.uint8, device=w.device)
    signal = torch.zeros(matrices * nt, dtype=torch.float64, device=dev)
    noise = torch.zeros(matrices * nt, dtype=torch.float64, device=dev)
    positions = fit_positions(fit_samples, seed).to(dev)
    per_chunk = max(1, chunk_tiles // kt)
    for a in range(0, matrices * nt, per_chunk):
        b = min(a + per_chunk, matrices * nt)
        x = strips[a:b].to(device=dev)
        check_weights(x, name, row_offset=a * TILE, shape=tuple(w.shape))  # in w's dtype: 1e39 in float64 is not inf
        x = x.float().reshape(b - a, TILE, kt, TILE).transpose(1, 2).reshape((b - a) * kt, TILE, TILE)
        codes, scales, lut = quantize_tile_fields(
            x, iterations=iterations, refinements=refinements, positions=positions, final_iterations=final_iterations
        )
        tiles = pack_tiles(codes, scales, lut)
        decoded = decode_tiles(tiles)
        if not bool(torch.isfinite(decoded).all()):  # a safeguard: check_weights refused anything beyond LARGEST_WEIGHT
            raise ValueError(f"{name}: weights too large for LUT-B (decoded weights are bfloat16, largest finite "
                             f"{torch.finfo(torch.bfloat16).max:.4g}; rows {a * TILE % n}..{b * TILE % n or n} of a matrix)")
        diff = decoded.sub_(x)
        signal[a:b] = x.double().square().reshape(b - a, -1).sum(dim=1)
        noise[a:b] = diff.double().square().reshape(b - a, -1).sum(dim=1)
        out[a:b] = tiles.reshape(b - a, kt, TILE_BYTES).to(out.device)
        if progress is not None:
            progress((b - a) * kt)
    signal = signal.reshape(matrices, nt).sum(dim=1).reshape(lead).cpu()
    noise = noise.reshape(matrices, nt).sum(dim=1).reshape(lead).cpu()
    return QuantizedMatrix(
        tiles=out.reshape(*lead, nt, kt, TILE_BYTES),
        sqnr_db=sqnr_db(signal, noise),
        rel_rmse=rel_rmse(signal, noise),
        signal_energy=signal,
        noise_energy=noise,
    )


def stack_w13(gate: torch.Tensor, up: torch.Tensor | None) -> torch.Tensor:
    """``W13`` of spec section 2: ``gate [..., I, H]`` stacked over ``up [..., I, H]`` (gate rows first).

    With ``up`` None (``*_no_mul`` activations) ``W13`` is ``gate`` itself.
    """
    if up is None:
        return gate
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} projections differ in shape")
    return torch.cat([gate, up], dim=-2)


def quantize_layer(
    gate: torch.Tensor,
    up: torch.Tensor | None,
    down: torch.Tensor,
    *,
    expert_ids: torch.Tensor | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    refinements: int = DEFAULT_REFINEMENTS,
    seed: int = 0,
    device: torch.device | str | None = None,
    fit_samples: int = DEFAULT_FIT_SAMPLES,
    final_iterations: int = DEFAULT_FINAL_ITERATIONS,
    chunk_tiles: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> QuantizedLayer:
    """Quantize one MoE layer's experts into :class:`~lutb_kernels.checkpoint.LayerWeights`.

    Args:
        gate: ``W1 [E, I, H]`` (gate projection), or the whole ``W13 [E, I, H]`` of a ``*_no_mul`` activation.
        up: ``W3 [E, I, H]`` (up projection), or None for ``*_no_mul`` activations.
        down: ``W2 [E, H, I]``.
        expert_ids: int ``[E]`` ascending global ids (default ``0..E-1``).
        Other arguments as in :func:`quantize_matrix`.

    Returns:
        :class:`QuantizedLayer`; its ``weights`` hold CPU tensors ready for a
        :class:`~lutb_kernels.checkpoint.CheckpointWriter`.

    Raises:
        ValueError: bad shapes; a weight of magnitude above :data:`LARGEST_WEIGHT`.
        NonFiniteInputError: a weight is NaN or infinity.

    Weights are checked with :func:`check_weights` expert by expert (gate, up, down) before ``gate`` and
    ``up`` are stacked, so an error names the tensor the caller passed, the expert (its global id) and the
    row in that expert's matrix: ``"up of expert 4: weights hold NaN or infinity (row 5)"``, never a row
    of the stacked ``W13``.
    """
    if gate.dim() != 3 or down.dim() != 3 or (up is not None and up.dim() != 3) or down.shape[0] != gate.shape[0]:
        up_shape = "" if up is None else f", up {tuple(up.shape)}"
        raise ValueError(f"expected gate and up [E, I, H] and down [E, H, I], got gate {tuple(gate.shape)}{up_shape} "
                         f"and down {tuple(down.shape)}")
    w13 = stack_w13(gate, up)
    if down.shape[1] != w13.shape[2] or down.shape[2] != gate.shape[1]:
        raise ValueError(f"down {tuple(down.shape)} does not match gate {tuple(gate.shape)}: expected [E, H, I]")
    experts = w13.shape[0]
    if expert_ids is None:
        expert_ids = torch.arange(experts, dtype=torch.int32)
    if tuple(expert_ids.shape) != (experts,):
        raise ValueError(f"expert_ids: shape {tuple(expert_ids.shape)}, expected ({experts},): one global id per expert of gate")
    for e, expert in enumerate(expert_ids.tolist()):
        for part, w in (("gate", gate), ("up", up), ("down", down)):
            if w is not None:
                check_weights(w[e], f"{part} of expert {expert}")
    kwargs = dict(
        iterations=iterations,
        refinements=refinements,
        seed=seed,
        device=device,
        fit_samples=fit_samples,
        final_iterations=final_iterations,
        chunk_tiles=chunk_tiles,
        progress=progress,
    )
    q13 = quantize_matrix(w13, name="gate/up (w13)", **kwargs)
    q2 = quantize_matrix(down, name="down (w2)", **kwargs)
    weights = LayerWeights(q13.tiles.cpu(), q2.tiles.cpu(), expert_ids.to(torch.int32).cpu().contiguous())
    return QuantizedLayer(weights, q13, q2)


def layer_tiles(activation: str, experts: int, hidden: int, intermediate: int) -> int:
    """Tiles in one layer of ``experts`` experts (for progress bars)."""
    rows13 = 2 * intermediate if is_gated(activation) else intermediate
    return experts * (rows13 * hidden + hidden * intermediate) // (TILE * TILE)


__all__ = [
    "DEFAULT_FINAL_ITERATIONS",
    "DEFAULT_FIT_SAMPLES",
    "DEFAULT_ITERATIONS",
    "DEFAULT_REFINEMENTS",
    "LARGEST_WEIGHT",
    "QuantizedLayer",
    "QuantizedMatrix",
    "check_weights",
    "fit_positions",
    "layer_tiles",
    "nearest_codes",
    "quantize_layer",
    "quantize_matrix",
    "quantize_tile_fields",
    "rel_rmse",
    "sqnr_db",
    "stack_w13",
]
