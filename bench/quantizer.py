"""Quality and speed of the LUT-B quantizer (lutb_kernels.quantizer).

Rows:

- ``gaussian``: SQNR on iid N(0, 1) weights (target >= 14.5 dB);
- ``student-t4``: SQNR on iid Student-t (nu = 4) weights (target >= 13.0 dB, and
  >= 1.0 dB above the uniform baseline);
- ``uniform-*``: the baseline: the same per-(row, 32-group) E8M0 scale layout,
  but the 8 LUT entries forced onto a uniform grid (midrise ``(j - 3.5) * step``
  or midtread ``(j - 4) * step``, whichever fits the tile better), the step fitted
  per tile by Lloyd-style updates from several starts, with the same e-1/e/e+1
  scale refinements as the quantizer;
- ``mixtral-expert`` (CPU): wall time of one Mixtral-8x7B expert,
  ``3 x 14336 x 4096`` weights (target < 60 s on 2 CPU threads);
- ``deepseek-v3-layer`` (``--device cuda``): wall time of one DeepSeek-V3 MoE layer,
  256 experts of ``3 x 2048 x 7168`` weights (goal < 30 s).

Usage::

    python bench/quantizer.py                       # CPU rows, 2 threads
    python bench/quantizer.py --device cuda         # quality rows on the GPU + the DeepSeek layer
    python bench/quantizer.py --out bench/results/2026-12-02-quantizer-cpu.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from lutb_kernels import quantizer as Q
from lutb_kernels.tiles import GROUP, GROUPS_PER_ROW, TILE, decode_tiles, dense_to_tiles, pack_tiles

MIDRISE = torch.arange(8, dtype=torch.float32) - 3.5
MIDTREAD = torch.arange(8, dtype=torch.float32) - 4.0


def _uniform_fit(xs: torch.Tensor, ws: torch.Tensor, grid: torch.Tensor, starts: torch.Tensor, iterations: int = 6) -> torch.Tensor:
    """Per-tile step of ``step * grid`` minimising the weighted squared error; xs, ws ``[T, S]`` -> ``[T]``."""
    best_step = None
    best_err = None
    g = grid.to(xs.device)
    for start in starts.tolist():
        step = torch.full((xs.shape[0],), start, device=xs.device)
        for _ in range(iterations):
            k = Q.nearest_codes(xs, step[:, None] * g).long()
            gk = g[k]
            step = ((ws * xs * gk).sum(1) / (ws * gk * gk).sum(1).clamp_min(1e-30)).clamp_min(1e-12)
        lut = step[:, None] * g
        err = (ws * (xs - Q._lookup(lut, Q.nearest_codes(xs, lut))).square()).sum(1)
        if best_err is None:
            best_err, best_step = err, step
        else:
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_step = torch.where(better, step, best_step)
    return best_step


def uniform_tile_fields(x: torch.Tensor, positions: torch.Tensor, refinements: int = Q.DEFAULT_REFINEMENTS) -> tuple[torch.Tensor, ...]:
    """The uniform-grid baseline for tiles ``x [T, 128, 128]`` -> (codes, scales, lut) like the quantizer."""
    t = x.shape[0]
    x = x.reshape(t, TILE, GROUPS_PER_ROW, GROUP)
    positions = positions.to(x.device)
    amax = x.abs().amax(dim=-1)
    e = torch.where(amax > 0, Q._ceil_log2(torch.where(amax > 0, amax, 1.0)), Q.E_MIN).clamp(Q.E_MIN, Q.E_MAX)
    starts = torch.tensor([0.08, 0.12, 0.17, 0.22, 0.28])

    def fit(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        xn = x * Q._pow2(-e).unsqueeze(-1)
        xs, ws = Q._samples(xn, e, positions)
        best_lut, best_err = None, None
        for grid in (MIDRISE, MIDTREAD):
            lut = Q._round_lut(_uniform_fit(xs, ws, grid, starts)[:, None] * grid.to(x.device))
            err = (ws * (xs - Q._lookup(lut, Q.nearest_codes(xs, lut))).square()).sum(1)
            if best_lut is None:
                best_lut, best_err = lut, err
            else:
                better = (err < best_err)[:, None]
                best_lut = torch.where(better, lut, best_lut)
                best_err = torch.minimum(err, best_err)
        return xn, best_lut

    xn, lut = fit(e)
    for _ in range(refinements):
        best_err, best_d = None, torch.zeros_like(e)
        for d in (0, -1, 1):
            err = Q._group_sq_error(xn, lut * 2.0**d)
            if d:
                err = torch.where((e + d >= Q.E_MIN) & (e + d <= Q.E_MAX), err, math.inf)
            if best_err is None:
                best_err = err
            else:
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_d = torch.where(better, d, best_d)
        e = e + best_d
        xn, lut = fit(e)
    codes = Q.nearest_codes(xn, lut).reshape(t, TILE, TILE)
    return codes, (e + 127).to(torch.uint8), lut.to(torch.bfloat16)


def uniform_sqnr(w: torch.Tensor, device: torch.device, seed: int = 0, chunk: int = 256) -> float:
    tiles = dense_to_tiles(w).reshape(-1, TILE, TILE)
    positions = Q.fit_positions(Q.DEFAULT_FIT_SAMPLES, seed)
    signal = noise = 0.0
    for a in range(0, tiles.shape[0], chunk):
        x = tiles[a : a + chunk].to(device=device, dtype=torch.float32)
        packed = pack_tiles(*uniform_tile_fields(x, positions))
        signal += float(x.double().square().sum())
        noise += float((decode_tiles(packed) - x).double().square().sum())
    return 10 * math.log10(signal / noise)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_quantize(w: torch.Tensor, device: torch.device, **kw: object) -> tuple[Q.QuantizedMatrix, float]:
    _sync(device)
    start = time.perf_counter()
    q = Q.quantize_matrix(w, device=device, **kw)  # type: ignore[arg-type]
    _sync(device)
    return q, time.perf_counter() - start


def run(args: argparse.Namespace) -> list[tuple[str, str, str, str, str]]:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    rows: list[tuple[str, str, str, str, str]] = []
    n = args.size
    print(f"quality rows: {n} x {n} matrices", file=sys.stderr)

    gauss = torch.randn(n, n, generator=gen)
    q, secs = _timed_quantize(gauss, device, seed=args.seed)
    g_sqnr = float(q.sqnr_db)
    rows.append(("gaussian", f"{g_sqnr:.2f} dB", ">= 14.5 dB", "pass" if g_sqnr >= 14.5 else "FAIL", f"{secs:.2f}"))
    u_g = uniform_sqnr(gauss, device, args.seed)
    rows.append(("uniform-gaussian (baseline)", f"{u_g:.2f} dB", "-", "-", "-"))

    chi2 = torch.distributions.Chi2(torch.tensor(4.0))
    torch.manual_seed(args.seed)
    student = torch.randn(n, n, generator=gen) / torch.sqrt(chi2.sample((n, n)) / 4.0)
    q, secs = _timed_quantize(student, device, seed=args.seed)
    t_sqnr = float(q.sqnr_db)
    rows.append(("student-t4", f"{t_sqnr:.2f} dB", ">= 13.0 dB", "pass" if t_sqnr >= 13.0 else "FAIL", f"{secs:.2f}"))
    u_t = uniform_sqnr(student, device, args.seed)
    gap = t_sqnr - u_t
    rows.append(("uniform-student-t4 (baseline)", f"{u_t:.2f} dB", "-", "-", "-"))
    rows.append(("student-t4 minus uniform", f"{gap:+.2f} dB", ">= +1.0 dB", "pass" if gap >= 1.0 else "FAIL", "-"))
    del gauss, student

    if device.type == "cpu" and not args.skip_large:
        i, h = 14336, 4096
        w13 = (torch.randn(1, 2 * i, h, generator=gen) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(1, h, i, generator=gen) * 0.02).to(torch.bfloat16)
        q13, s13 = _timed_quantize(w13, device, seed=args.seed)
        q2, s2 = _timed_quantize(w2, device, seed=args.seed)
        secs = s13 + s2
        sq = float(Q.sqnr_db(q13.signal_energy.sum() + q2.signal_energy.sum(), q13.noise_energy.sum() + q2.noise_energy.sum()))
        rows.append(("mixtral-expert 3x14336x4096", f"{secs:.1f} s ({sq:.2f} dB)", "< 60 s", "pass" if secs < 60 else "FAIL", f"{secs:.1f}"))
    if device.type == "cuda" and not args.skip_large:
        e, i, h = 256, 2048, 7168
        gdev = torch.Generator(device=device).manual_seed(args.seed)
        w13 = (torch.randn(e, 2 * i, h, generator=gdev, device=device) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, generator=gdev, device=device) * 0.02).to(torch.bfloat16)
        kw = {"seed": args.seed, "chunk_tiles": args.chunk_tiles} if args.chunk_tiles else {"seed": args.seed}
        _timed_quantize(w13[:1], device, **kw)  # warm-up
        q13, s13 = _timed_quantize(w13, device, **kw)
        del q13
        q2, s2 = _timed_quantize(w2, device, **kw)
        secs = s13 + s2
        rows.append(("deepseek-v3-layer 256x3x2048x7168", f"{secs:.1f} s", "< 30 s", "pass" if secs < 30 else "FAIL", f"{secs:.1f}"))
    return rows


def _table(rows: list[tuple[str, ...]]) -> str:
    header = ("case", "result", "target", "status", "seconds")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _device_words(device: torch.device, threads: int) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} (torch {torch.__version__})"
    return f"CPU {platform.processor() or platform.machine()}, {threads} torch threads (torch {torch.__version__})"


def _git_commit() -> str:
    try:
        root = Path(__file__).resolve().parents[1]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True, check=True).stdout.strip()
        return commit + (" (working tree has uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    parser.add_argument("--size", type=int, default=2048, help="side of the quality matrices (default: 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-tiles", type=int, default=None, help="tiles per batch (default: the quantizer's)")
    parser.add_argument("--skip-large", action="store_true", help="skip the Mixtral / DeepSeek timing rows")
    parser.add_argument("--machine", default=None, help="words describing the machine, for --out")
    parser.add_argument("--out", default=None, help="write a markdown result file here")
    args = parser.parse_args(argv)
    rows = run(args)
    table = _table(rows)
    print(table)
    if args.out:
        device = torch.device(args.device)
        text = "\n".join(
            [
                "# LUT-B quantizer benchmark",
                "",
                f"- date: {dt.date.today().isoformat()}",
                f"- machine: {args.machine or '-'}",
                f"- device: {_device_words(device, args.threads)}",
                f"- git commit: {_git_commit()}",
                f"- command: `python {' '.join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}`",
                f"- quantizer defaults: iterations={Q.DEFAULT_ITERATIONS}, refinements={Q.DEFAULT_REFINEMENTS}, "
                f"fit_samples={Q.DEFAULT_FIT_SAMPLES}, final_iterations={Q.DEFAULT_FINAL_ITERATIONS}",
                "",
                table,
                "",
            ]
        )
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
