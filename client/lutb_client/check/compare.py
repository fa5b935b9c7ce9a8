"""Error statistics of one output against the judge's, poolable over batches, layers or experts.

:class:`ErrorStats` keeps sums (not ratios), so that statistics of many batches
add up exactly: relative L2 error ``||got - ref|| / ||ref||``, cosine similarity,
the largest absolute error, the share of elements that match bit for bit, and
NaN/Inf counts on both sides. Elements that are not finite on either side are
left out of the sums and counted instead; an element whose class (finite, NaN,
+Inf, -Inf) differs between the sides is a ``nonfinite_mismatch``.

Two per-row figures (a row: one token, or one route of a route-major output) serve inputs whose rows differ in
magnitude by orders, where the pooled error is the largest rows' alone: ``worst_row``, the largest relative L2
error of a row whose reference reaches :data:`ROW_FLOOR_BINADES` binades above the dtype's smallest normal (below
that, a row's output is subnormal and holds too few bits for a relative error to mean anything), and
``zero_rows_wrong``, rows whose reference is exactly zero and the target's is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

MAX_SAMPLES = 4096
"""Per-row relative errors kept per statistic (for the plot)."""
ROW_FLOOR_BINADES = 10
"""A row counts in ``worst_row`` when its reference's largest magnitude is at least ``2**ROW_FLOOR_BINADES`` times the
smallest normal of the reference's dtype."""


@dataclass
class ErrorStats:
    """Pooled comparison of ``got`` (the node being checked) against ``ref`` (the judge)."""

    rows: int = 0
    elements: int = 0
    sum_sq_diff: float = 0.0
    sum_sq_ref: float = 0.0
    sum_sq_got: float = 0.0
    dot: float = 0.0
    max_abs: float = 0.0
    exact: int = 0
    nan_got: int = 0
    inf_got: int = 0
    nan_ref: int = 0
    inf_ref: int = 0
    nonfinite_mismatch: int = 0
    worst_row: float = 0.0
    zero_rows_wrong: int = 0
    samples: list[float] = field(default_factory=list)

    def add(self, got: torch.Tensor, ref: torch.Tensor) -> None:
        """Pool ``got`` and ``ref`` (same shape ``[rows, H]``, any float dtype) into the statistics."""
        if got.shape != ref.shape:
            raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(ref.shape)}")
        tiny = torch.finfo(ref.dtype).tiny if ref.dtype.is_floating_point else 0.0
        g = got.detach().to("cpu", torch.float64).reshape(-1, got.shape[-1] if got.dim() else 1)
        r = ref.detach().to("cpu", torch.float64).reshape(g.shape)
        self.rows += g.shape[0]
        self.elements += g.numel()
        if g.numel() == 0:
            return
        fin_g, fin_r = torch.isfinite(g), torch.isfinite(r)
        both = fin_g & fin_r
        self.nan_got += int(torch.isnan(g).sum())
        self.inf_got += int(torch.isinf(g).sum())
        self.nan_ref += int(torch.isnan(r).sum())
        self.inf_ref += int(torch.isinf(r).sum())
        same_class = (both) | (torch.isnan(g) & torch.isnan(r)) | (torch.isinf(g) & torch.isinf(r) & (g == r))
        self.nonfinite_mismatch += int((~same_class).sum())
        self.exact += int(((g == r) | (torch.isnan(g) & torch.isnan(r))).sum())
        gz = torch.where(both, g, torch.zeros_like(g))
        rz = torch.where(both, r, torch.zeros_like(r))
        diff = gz - rz
        self.sum_sq_diff += float(diff.pow(2).sum())
        self.sum_sq_ref += float(rz.pow(2).sum())
        self.sum_sq_got += float(gz.pow(2).sum())
        self.dot += float((gz * rz).sum())
        self.max_abs = max(self.max_abs, float(diff.abs().max()))
        row_diff = diff.pow(2).sum(-1).sqrt()
        row_ref = rz.pow(2).sum(-1).sqrt()
        row_rel = torch.where(row_ref > 0, row_diff / row_ref.clamp_min(1e-300),
                              torch.where(row_diff > 0, torch.full_like(row_diff, math.inf), torch.zeros_like(row_diff)))
        judged = rz.abs().amax(-1) >= tiny * 2.0**ROW_FLOOR_BINADES
        if bool(judged.any()):
            self.worst_row = max(self.worst_row, float(row_rel[judged].max()))
        self.zero_rows_wrong += int(((r == 0).all(-1) & (g != 0).any(-1)).sum())
        room = MAX_SAMPLES - len(self.samples)
        if room > 0:
            self.samples.extend(float(v) for v in row_rel[:room])

    def merge(self, other: ErrorStats) -> None:
        """Pool another statistic into this one."""
        for name in ("rows", "elements", "sum_sq_diff", "sum_sq_ref", "sum_sq_got", "dot", "exact", "nan_got", "inf_got",
                     "nan_ref", "inf_ref", "nonfinite_mismatch"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.max_abs = max(self.max_abs, other.max_abs)
        self.worst_row = max(self.worst_row, other.worst_row)
        self.zero_rows_wrong += other.zero_rows_wrong
        self.samples.extend(other.samples[: max(0, MAX_SAMPLES - len(self.samples))])

    @property
    def rel_l2(self) -> float:
        """``||got - ref|| / ||ref||`` over the finite elements; 0 when both are zero, inf when only ref is."""
        if self.sum_sq_ref > 0:
            return math.sqrt(self.sum_sq_diff / self.sum_sq_ref)
        return 0.0 if self.sum_sq_diff == 0 else math.inf

    @property
    def cosine(self) -> float:
        """Cosine similarity over the finite elements; 1 when both are zero, 0 when only one is."""
        denom = math.sqrt(self.sum_sq_got * self.sum_sq_ref)
        if denom > 0:
            return max(-1.0, min(1.0, self.dot / denom))
        return 1.0 if self.sum_sq_got == self.sum_sq_ref == 0 else 0.0

    @property
    def exact_share(self) -> float:
        """Share of elements equal on both sides (NaN = NaN counts as equal); 1 for no elements."""
        return self.exact / self.elements if self.elements else 1.0

    def to_dict(self) -> dict[str, object]:
        return {
            "rel_l2": _json_float(self.rel_l2),
            "max_abs": _json_float(self.max_abs),
            "cosine": _json_float(self.cosine),
            "exact_share": self.exact_share,
            "elements": self.elements,
            "nan": {"target": self.nan_got, "against": self.nan_ref},
            "inf": {"target": self.inf_got, "against": self.inf_ref},
            "nonfinite_mismatch": self.nonfinite_mismatch,
            "worst_row_rel_l2": _json_float(self.worst_row),
            "zero_rows_wrong": self.zero_rows_wrong,
        }


def _json_float(value: float) -> float | str:
    """JSON has no infinity: ``inf`` becomes the string ``"inf"``."""
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if math.isnan(value):
        return "nan"
    return value


def route_rows_by_expert(
    got: torch.Tensor, ref: torch.Tensor, topk_ids: torch.Tensor,
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Split route-major outputs ``[T, k, H]`` into each expert's route rows: ``expert -> (got [n, H], ref [n, H])``."""
    ids = topk_ids.reshape(-1).to(torch.int64)
    g = got.reshape(-1, got.shape[-1])
    r = ref.reshape(-1, ref.shape[-1])
    return {int(e): (g[ids == e], r[ids == e]) for e in torch.unique(ids).tolist()}


__all__ = ["MAX_SAMPLES", "ROW_FLOOR_BINADES", "ErrorStats", "route_rows_by_expert"]
