"""The verdict of a check, its rows, and how they are printed, saved (JSON) and drawn (PNG).

Judging (spec section 6; see docs/checking.md):

- the tolerance is the relative L2 error allowed for the model dtype
  (:data:`TOLERANCE`: 1e-2 for bfloat16 and float16, 2e-3 for float32);
- a row with at least :data:`MIN_TOKENS` tokens (layer rows) or routed tokens
  (expert rows) is judged against the tolerance ("strict"); a smaller row is judged
  only against ``GROSS_FACTOR`` x the tolerance ("gross"), because a handful of
  tokens can legitimately exceed the tolerance through a few MXFP8 rounding flips;
  its tokens still count in the layer's ``pooled`` row (every standard-normal batch
  of the layer pooled), which is judged strictly once it reaches 64 tokens; the
  small-request suites (``single_token``: 64 requests of one token; ``small_batches``:
  requests of 2 to 63 tokens) hold at least 64 tokens each, so their own rows are
  judged strictly, undiluted by the large batches of the pooled row;
- every row fails on any NaN/Inf the judge does not have (or the reverse), on a
  shape mismatch, on a request that failed on either side, and on an output row
  (a token, or a route of a route-major output) that is not zero where the judge's
  is exactly zero;
- in the parts whose rows differ in magnitude by orders (``ROW_JUDGED_PARTS``:
  heavy-tailed, tiny and huge inputs), where the pooled error is the largest rows'
  alone, every row whose reference is well above the subnormal range must also be
  within ``GROSS_FACTOR`` x the tolerance on its own (``ErrorStats.worst_row``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lutb_client.check.compare import ErrorStats
from lutb_client.check.suites import ROW_JUDGED_PARTS

SCHEMA = "lutb-check-report/1"
TOLERANCE = {"bfloat16": 1e-2, "float16": 1e-2, "float32": 2e-3}
"""Relative L2 error allowed by spec section 6, per model dtype."""
MIN_TOKENS = 64
"""Tokens over which spec section 6 states its tolerance."""
GROSS_FACTOR = 10.0
"""Rows smaller than MIN_TOKENS fail beyond this multiple of the tolerance."""
POOLED = "pooled"
"""Suite name of a layer's row that pools every standard-normal batch of the layer."""


@dataclass
class Row:
    """One line of the report: a (suite part, layer) or a (suite part, layer, expert)."""

    suite: str
    layer: int
    stats: ErrorStats
    tokens: int
    expert: int | None = None
    held: bool | None = None
    errors: list[str] = field(default_factory=list)
    judged: str = "strict"
    limit: float = 0.0
    ok: bool = True
    reasons: list[str] = field(default_factory=list)

    def judge(self, tolerance: float) -> None:
        """Set :attr:`judged`, :attr:`limit`, :attr:`ok` and :attr:`reasons`."""
        self.judged = "strict" if self.tokens >= MIN_TOKENS else "gross"
        self.limit = tolerance if self.judged == "strict" else tolerance * GROSS_FACTOR
        reasons = []
        if self.errors:
            reasons.append(f"{len(self.errors)} request(s) failed: {self.errors[0]}")
        if self.stats.nonfinite_mismatch:
            reasons.append(f"{self.stats.nonfinite_mismatch} NaN/Inf element(s) not matching the judge's")
        if self.stats.nan_ref or self.stats.inf_ref:  # spec section 6: no NaN; matching ones would prove nothing
            reasons.append(f"the judge's output holds {self.stats.nan_ref + self.stats.inf_ref} NaN/Inf element(s)")
        if self.stats.zero_rows_wrong:
            reasons.append(f"{self.stats.zero_rows_wrong} output row(s) not zero where the judge's is exactly zero")
        rel = self.stats.rel_l2
        if not rel <= self.limit:
            reasons.append(f"rel L2 {rel:.3e} > {self.limit:g} ({self.judged})")
        row_limit = tolerance * GROSS_FACTOR
        if self.suite in ROW_JUDGED_PARTS and not self.stats.worst_row <= row_limit:
            reasons.append(f"an output row's rel L2 {self.stats.worst_row:.3e} > {row_limit:g} (each row)")
        self.reasons = reasons
        self.ok = not reasons

    @property
    def badness(self) -> tuple[bool, float]:
        """Sort key, larger is worse: ``(failing, rel L2 over its limit)`` (NaN counts as infinite), so that
        failures come first and, among them as among the rest, the furthest beyond its limit first."""
        rel = self.stats.rel_l2
        ratio = rel / self.limit if self.limit > 0 else rel
        return (not self.ok, math.inf if math.isnan(ratio) else ratio)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"suite": self.suite, "layer": self.layer}
        if self.expert is not None:
            out["expert"] = self.expert
            out["held"] = self.held
            out["routes"] = self.tokens
        else:
            out["tokens"] = self.tokens
        out.update(self.stats.to_dict())
        out.update({"judged": self.judged, "limit": self.limit, "ok": self.ok, "reasons": self.reasons,
                    "errors": self.errors})
        return out


@dataclass
class CheckReport:
    """Everything a check found; :meth:`to_json` is the documented machine-readable form."""

    target: dict[str, Any]
    against: dict[str, Any]
    dtype: str
    suites: list[str]
    seed: int
    tokens: int
    topk: int
    layers_checked: list[int]
    layer_rows: list[Row]
    expert_rows: list[Row]
    differences: list[dict[str, Any]] = field(default_factory=list)
    forced: bool = False
    replay: dict[str, Any] | None = None
    headroom: dict[int, float] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)
    batches: int = 0

    def __post_init__(self) -> None:
        self.tolerance = TOLERANCE.get(self.dtype, 1e-2)
        for row in (*self.layer_rows, *self.expert_rows):
            row.judge(self.tolerance)
        self.layer_rows.sort(key=lambda r: (-r.badness[0], -r.badness[1], r.layer, r.suite))
        self.expert_rows.sort(key=lambda r: (-r.badness[0], -r.badness[1], r.layer, r.expert or 0, r.suite))

    @property
    def failing_layers(self) -> list[int]:
        return sorted({r.layer for r in self.layer_rows if not r.ok} | {r.layer for r in self.expert_rows if not r.ok})

    @property
    def failing_experts(self) -> list[tuple[int, int]]:
        return sorted({(r.layer, r.expert) for r in self.expert_rows if not r.ok and r.expert is not None})

    @property
    def ok(self) -> bool:
        return not self.errors and all(r.ok for r in self.layer_rows) and all(r.ok for r in self.expert_rows)

    @property
    def verdict(self) -> str:
        return "pass" if self.ok else "fail"

    @property
    def worst_rel_l2(self) -> float:
        return max((r.stats.rel_l2 for r in self.layer_rows), default=0.0)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-ready data (schema ``lutb-check-report/1``, documented in docs/checking.md)."""
        worst = self.worst_rel_l2
        return {
            "schema": SCHEMA,
            "verdict": self.verdict,
            "target": self.target,
            "against": self.against,
            "replay": self.replay,
            "identity": {"differences": self.differences, "forced": self.forced},
            "suites": self.suites,
            "seed": self.seed,
            "tokens": self.tokens,
            "topk": self.topk,
            "layers_checked": self.layers_checked,
            "tolerance": {"dtype": self.dtype, "rel_l2": self.tolerance, "min_tokens": MIN_TOKENS,
                          "gross_factor": GROSS_FACTOR},
            "headroom": {str(k): v for k, v in sorted(self.headroom.items())},
            "summary": {
                "batches": self.batches,
                "layer_rows": len(self.layer_rows),
                "expert_rows": len(self.expert_rows),
                "failing_layer_rows": sum(not r.ok for r in self.layer_rows),
                "failing_expert_rows": sum(not r.ok for r in self.expert_rows),
                "failing_layers": self.failing_layers,
                "failing_experts": [list(p) for p in self.failing_experts],
                "worst_rel_l2": "inf" if math.isinf(worst) else worst,
                "errors": len(self.errors),
            },
            "layers": [r.to_dict() for r in self.layer_rows],
            "experts": [r.to_dict() for r in self.expert_rows],
            "errors": self.errors,
        }

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n")

    def format_text(self, *, top: int = 10) -> str:
        """Human-readable report: identity, the worst layer and expert rows, the verdict line."""
        t, a = self.target, self.against
        lines = [
            f"target   {t['address']}: {_describe(t)}",
            f"against  {a['address']}: {_describe(a)}",
        ]
        if self.replay:
            lines.append(f"replay   {self.replay['file']} (recorded {self.replay.get('recorded_at', '?')})")
        for diff in self.differences:
            lines.append(f"FORCED   {diff['field']} differs: target {diff['target']}, against {diff['against']}")
        lines.append(f"suites   {', '.join(self.suites)}; seed {self.seed}; layers {self.layers_checked}; "
                     f"{self.batches} batches")
        lines.append(f"{self.dtype}: rel L2 tolerance {self.tolerance:g} over >= {MIN_TOKENS} tokens, "
                     f"{self.tolerance * GROSS_FACTOR:g} for smaller rows")
        header = (f"{'suite':<18} {'layer':>5} {'expert':>6} {'tokens':>6} {'rel_l2':>10} {'max_abs':>10} "
                  f"{'cosine':>9} {'exact':>6} {'nan':>4} {'inf':>4}  verdict")
        lines.append("")
        lines.append("layers (worst first):")
        lines.append(header)
        lines.extend(_format_row(r) for r in self.layer_rows)
        if self.expert_rows:
            failing = [r for r in self.expert_rows if not r.ok]
            shown = failing + [r for r in self.expert_rows if r.ok][: max(0, top - len(failing))]
            lines.append("")
            lines.append(f"experts (route-major suites, worst first; {len(shown)} of {len(self.expert_rows)} rows):")
            lines.append(header)
            lines.extend(_format_row(r) for r in shown)
        for err in self.errors[:10]:
            lines.append(f"error: layer {err['layer']} {err['suite']} batch {err['batch']} ({err['side']}): "
                         f"{err['code']}: {err['message']}")
        lines.append("")
        worst = self.worst_rel_l2
        if self.ok:
            lines.append(f"ok: worst rel L2 {worst:.3e} (tolerance {self.tolerance:g})")
        else:
            experts = ", ".join(f"layer {layer} expert {e}" for layer, e in self.failing_experts) or "none"
            lines.append(f"FAIL: {sum(not r.ok for r in self.layer_rows)} layer row(s), "
                         f"{sum(not r.ok for r in self.expert_rows)} expert row(s) beyond tolerance, "
                         f"{len(self.errors)} failed request(s); failing layers {self.failing_layers}; "
                         f"failing experts: {experts} (tolerance {self.tolerance:g})")
        return "\n".join(lines)

    def plot(self, path: str | Path) -> None:
        """Write a PNG: per layer, the per-route error distribution of each expert and the per-token one of each suite."""
        plot_report(self, path)


def _describe(info: dict[str, Any]) -> str:
    mi = info.get("model_info") or {}
    return (f"{info['kind']}, backend {mi.get('backend', '?')} on {mi.get('device', '?')}, "
            f"{mi.get('dtype', '?')}, scale mode {mi.get('mxfp8_scale_mode', '?')}, {str(mi.get('content_hash', '?'))[:19]}")


def _format_row(r: Row) -> str:
    s = r.stats
    expert = "" if r.expert is None else str(r.expert)
    verdict = "ok" if r.ok else "FAIL " + "; ".join(r.reasons)
    return (f"{r.suite:<18} {r.layer:>5} {expert:>6} {r.tokens:>6} {s.rel_l2:>10.3e} {s.max_abs:>10.3e} "
            f"{s.cosine:>9.6f} {s.exact_share:>6.1%} {s.nan_got:>4} {s.inf_got:>4}  {verdict}")


def plot_report(report: CheckReport, path: str | Path) -> None:
    """Draw the report's error distributions with matplotlib (Agg backend) into ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install 'lutb-moe[plot]'``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    floor = 1e-9
    layers = report.layers_checked or sorted({r.layer for r in report.layer_rows})
    fig, axes = plt.subplots(len(layers), 2, figsize=(14, 3.2 * len(layers)), squeeze=False)
    for axis_row, layer in zip(axes, layers):
        left, right = axis_row
        by_expert: dict[int, list[float]] = {}
        for r in report.expert_rows:
            if r.layer == layer and r.expert is not None:
                by_expert.setdefault(r.expert, []).extend(r.stats.samples)
        experts = sorted(by_expert)
        failing = {e for (layer_, e) in report.failing_experts if layer_ == layer}
        if experts:
            data = [[max(min(v, 1e3), floor) for v in by_expert[e]] or [floor] for e in experts]
            parts = left.boxplot(data, positions=list(range(1, len(experts) + 1)), showfliers=True, patch_artist=True)
            step = max(1, len(experts) // 32)
            left.set_xticks(list(range(1, len(experts) + 1))[::step], [str(e) for e in experts][::step])
            for patch, e in zip(parts["boxes"], experts):
                patch.set_facecolor("tab:red" if e in failing else "tab:blue")
                patch.set_alpha(0.6)
        left.set_yscale("log")
        left.axhline(report.tolerance, color="k", linestyle="--", linewidth=1, label="tolerance")
        left.set_title(f"layer {layer}: per-route rel L2 by expert (route-major suites)")
        left.set_xlabel("expert")
        left.set_ylabel("rel L2 per route")
        suites = [r for r in report.layer_rows if r.layer == layer and r.suite != POOLED]
        suites.sort(key=lambda r: r.suite)
        for r in suites:
            values = [max(min(v, 1e3), floor) for v in r.stats.samples]
            if values:
                bins = [10 ** (math.log10(floor) + i * (math.log10(1e3) - math.log10(floor)) / 60) for i in range(61)]
                right.hist(values, bins=bins, histtype="step", label=r.suite)
        right.set_xscale("log")
        right.axvline(report.tolerance, color="k", linestyle="--", linewidth=1)
        right.set_title(f"layer {layer}: per-row rel L2 by suite (floored at {floor:g})")
        right.set_xlabel("rel L2 per row")
        right.set_ylabel("rows")
        if suites:
            right.legend(fontsize=7, loc="upper right")
    fig.suptitle(f"lutb check {report.target['address']} against {report.against['address']}: {report.verdict.upper()}")
    fig.tight_layout()
    fig.savefig(str(path), dpi=90)
    plt.close(fig)


__all__ = ["GROSS_FACTOR", "MIN_TOKENS", "POOLED", "SCHEMA", "TOLERANCE", "CheckReport", "Row", "plot_report"]
