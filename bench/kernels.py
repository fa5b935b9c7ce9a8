#!/usr/bin/env python3
"""GPU experts benchmark: emulated and packed LUT-B backends against two bf16 peers, one device call.

For each MoE shape and batch size T, with uniform random top-k routing shared by every
backend, times one whole experts forward (CUDA-graph replay of ``forward_unchecked``; falls
back to ``triton.testing.do_bench`` and says so when capture fails):

- ``packed``: LUT-B tiles decoded in registers (``lut_b_moe_gemm``), MXFP8 activations;
- ``emulated``: weights dequantized to bf16 at load, MXFP8 QDQ, Triton grouped GEMM;
- ``bf16_grouped_mm``: ``torch._grouped_mm`` on the same bf16 weights (sort, gather, GEMM,
  activation, GEMM, weighted scatter-add), when this torch has it;
- ``bf16_triton``: our grouped GEMM on the same bf16 weights without the MXFP8 QDQ.

Also measures the HBM bandwidth (large device-to-device copy: bytes read + written over
time; and a read-only reduction), the LUT-B bytes the packed forward touches (only experts
that receive tokens), and the weight memory per backend. Prints met/not-met for the targets
and writes ``results.json`` and ``results.md`` to ``--out``; the short table comes last.

Correctness gates the targets: at the smallest T, at T=32 and at the largest T of the run, the
packed and emulated outputs are compared with the spec's reference (``lutb_kernels.reference``,
dense weights dequantized from the original tiles; at most ``CHECK_TOKENS`` rows of a large T);
a shape whose check fails (relative L2 over ``CHECK_TOL``, spec section 6) or could not run meets
none of its performance targets. Each cell (a backend's timing at one T, a check, a shape's
setup) that raises is recorded with its error and the run goes on. Exit status: 0, or 1 when a
cell failed or a correctness check failed (2: no GPU).

Usage::

    PYTHONPATH=kernels python3 bench/kernels.py --out bench/results/<date> [--quick] [--tune]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path
from collections.abc import Iterator
from typing import Any, Callable

import torch
from lutb_kernels.reference import rel_l2
from repo_state import git_state

SHAPES = {
    # name: (experts, hidden, intermediate, top_k)
    "qwen3-30b-a3b": (128, 2048, 768, 8),
    "mixtral-8x7b": (8, 4096, 14336, 2),
    "deepseek-v3": (256, 7168, 2048, 8),
}
TOKENS = (1, 8, 32, 128, 512, 2048, 8192)
QUICK_TOKENS = (1, 32, 8192)
BACKENDS = ("packed", "emulated", "bf16_grouped_mm", "bf16_triton")
PEERS = ("bf16_grouped_mm", "bf16_triton")


def log(msg: str) -> None:
    print(msg, flush=True)


# ----------------------------------------------------------------------------- cells, provenance, display (no GPU)


ERROR_CHARS = 300  # of an error's text kept in the results


def describe(exc: BaseException) -> str:
    """``"Type: message"`` of an exception, on one line, at most ERROR_CHARS characters."""
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:ERROR_CHARS]


def guarded(what: str, fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """``(fn(), None)``, or ``(None, error text)`` when ``fn`` raises (logged; CUDA's cache emptied after an OOM)."""
    try:
        return fn(), None
    except Exception as exc:  # noqa: BLE001 - one cell's failure must not end the run
        error = describe(exc)
        log(f"  FAILED {what}: {error}")
        if isinstance(exc, torch.cuda.OutOfMemoryError) and torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None, error


def timed_cell(what: str, fns: list) -> dict:
    """``{"us", "method"}`` of :func:`time_graph_rot`, or ``{"us": nan, "method": "failed", "error"}``."""
    got, error = guarded(what, lambda: time_graph_rot(fns))
    if error is not None:
        return {"us": float("nan"), "method": "failed", "error": error}
    return {"us": got[0], "method": got[1]}


def failed_cells(results: dict) -> list[dict]:
    """Every cell of ``results`` that raised: ``{"shape", "tokens", "cell", "error"}`` (shape/tokens None where n/a)."""
    out = []
    if "error" in results.get("hbm", {}):
        out.append({"shape": None, "tokens": None, "cell": "hbm", "error": results["hbm"]["error"]})
    if results.get("tune_error"):
        out.append({"shape": None, "tokens": None, "cell": "tune", "error": results["tune_error"]})
    for name, sh in results.get("shapes", {}).items():
        if "error" in sh:
            out.append({"shape": name, "tokens": None, "cell": "setup", "error": sh["error"]})
        for tokens, run in sh.get("runs", {}).items():
            cells = [("run", run)] + [(b, run.get(b)) for b in BACKENDS]
            cells += [("correctness", run.get("correctness")), ("packed_paths", run.get("packed_paths"))]
            cells += [(f"ab {k}", v) for k, v in run.get("ab", {}).items()]
            out += [{"shape": name, "tokens": int(tokens), "cell": cell, "error": rec["error"]}
                    for cell, rec in cells if isinstance(rec, dict) and rec.get("error")]
    return out


def provenance(repo: Path | None = None, argv: list[str] | None = None) -> dict:
    """When (UTC, ISO 8601), from which commit (dirty: tracked files changed; :func:`repo_state.git_state`: a
    ``git archive`` copy gives its archived commit and None), with which argv."""
    repo = Path(__file__).resolve().parent if repo is None else repo
    head, dirty = git_state(repo)
    try:
        import importlib.util

        spec = importlib.util.find_spec("lutb_kernels")
        kernels_from = str(Path(spec.origin).parent) if spec and spec.origin else None
    except (ImportError, ValueError):
        kernels_from = None
    return {"utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "git_head": head, "git_dirty": dirty, "argv": list(sys.argv if argv is None else argv),
            "lutb_kernels_from": kernels_from}


def judged(value: float, threshold: float, *, higher_is_better: bool, decimals: int) -> tuple[bool, str]:
    """``(met, value shown with decimals)``, the shown number never on the other side of ``threshold``.

    ``met`` is ``value >= threshold`` (``<=`` when lower is better; NaN: not met). Where plain rounding would
    cross the threshold (0.5997 of 0.6 shown as "0.60"), the value is rounded toward the side it lies on."""
    met = value >= threshold if higher_is_better else value <= threshold
    if not math.isfinite(value):
        return False if math.isnan(value) else met, f"{value}"
    text = f"{value:.{decimals}f}"

    def agrees(t: str) -> bool:
        shown = float(t)
        return (shown >= threshold if higher_is_better else shown <= threshold) == met

    if agrees(text):
        return met, text
    q = 10**decimals
    up = met == higher_is_better  # toward the passing side of a met value, the failing side of a missed one
    shown = (math.ceil(value * q) if up else math.floor(value * q)) / q
    text = f"{shown:.{decimals}f}"
    if not agrees(text):  # value * q rounded onto the boundary: one more step
        text = f"{shown + (1 if up else -1) / q:.{decimals}f}"
    return met, text


# ----------------------------------------------------------------------------- timing


def time_graph(fn, *, replays: int = 20, rounds: int = 7) -> tuple[float, str]:
    """Median microseconds per call: CUDA-graph replay, else do_bench. Returns (us, method).

    An error of ``fn`` itself (in the warm-up call) propagates: only a failed capture falls back."""
    torch.cuda.synchronize()
    fn()  # warm-up / compile outside the capture
    torch.cuda.synchronize()
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(rounds):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / replays)
        del graph
        return statistics.median(times), "cuda-graph"
    except Exception as exc:  # noqa: BLE001 - any capture failure falls back
        torch.cuda.synchronize()
        from triton.testing import do_bench

        ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
        return ms * 1e3, f"do_bench (graph capture failed: {type(exc).__name__}: {str(exc)[:80]})"


L2_BYTES = 60 * 1024**2  # H200 L2 (50 MB on H100): touched bytes below ~2x this partly stay in L2 between replays
ROTATIONS = 8  # routings per graph replay at small T (fresh weight bytes per call)


def time_graph_rot(fns: list, *, calls: int = 24, rounds: int = 5) -> tuple[float, str]:
    """Median microseconds per call of ``fns`` run back to back in one CUDA graph (one call each).

    Each fn reads other experts (another routing), so consecutive calls do not find their
    weights in L2: that is what makes a per-call time comparable with HBM bandwidth.
    """
    if len(fns) == 1:
        return time_graph(fns[0], replays=calls, rounds=rounds)
    us, method = time_graph(lambda: [f() for f in fns], replays=max(1, calls // len(fns)), rounds=rounds)
    return us / len(fns), method + f" x{len(fns)} rotated routings"


def rotated_ids(ids: torch.Tensor, experts: int, n: int, seed: int = 7) -> list[torch.Tensor]:
    """``ids`` and ``n - 1`` copies with the experts relabelled by random permutations (same load shape)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    out = [ids]
    for _ in range(n - 1):
        perm = torch.randperm(experts, generator=gen).to(device=ids.device, dtype=ids.dtype)
        out.append(perm[ids.long()])
    return out


def rotations_for(tokens: int) -> int:
    return ROTATIONS if tokens <= 128 else 1


def hbm_bandwidth() -> dict:
    n = 2 * 1024**3  # 2 GiB
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    src.random_(0, 255)
    dst = torch.empty_like(src)
    copy_us, _ = time_graph(lambda: dst.copy_(src), replays=5, rounds=5)
    x = src.view(torch.float32)
    acc = torch.empty((), device="cuda")
    read_us, _ = time_graph(lambda: torch.sum(x, dim=0, out=acc), replays=5, rounds=5)
    src = dst = x = None  # (not del: the timed lambdas name them) frees the 4 GiB before empty_cache
    torch.cuda.empty_cache()
    return {
        "copy_read_plus_write_TBps": 2 * n / copy_us / 1e6,
        "copy_read_TBps": n / copy_us / 1e6,
        "sum_read_TBps": n / read_us / 1e6,
    }


# ----------------------------------------------------------------------------- peers


class Bf16GroupedMm:
    """``torch._grouped_mm`` pipeline on dense bf16 weights ``[E, N, K]`` (transposed views, no copy)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, activation: str) -> None:
        self.w13t = w13.transpose(1, 2)  # [E, H, 2I], column-major in the last two dims
        self.w2t = w2.transpose(1, 2)  # [E, I, H]
        self.activation = activation
        self.experts = w13.shape[0]

    @staticmethod
    def available() -> bool:
        return hasattr(torch, "_grouped_mm") and torch.cuda.get_device_capability() >= (9, 0)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from lutb_kernels.mxfp8_triton import act_rounded

        tokens, top_k = ids.shape
        flat = ids.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(self.experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        a = x[order // top_k]
        h = torch._grouped_mm(a, self.w13t, offs=offs)
        g = act_rounded(h, self.activation)
        y = torch._grouped_mm(g, self.w2t, offs=offs)
        y = (y.float() * weights.reshape(-1)[order, None]).to(x.dtype)
        out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
        out.index_add_(0, order // top_k, y.float())
        return out.to(x.dtype)


class Bf16Triton:
    """Our grouped GEMM on dense bf16 weights, no MXFP8 QDQ (the emulated flow minus quantization)."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, activation: str, num_experts: int) -> None:
        self.w13, self.w2, self.activation, self.num_experts = w13, w2, activation, num_experts

    def __call__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        from lutb_kernels.experts._triton_common import choose_route_block
        from lutb_kernels.grouped_gemm import grouped_gemm, moe_combine
        from lutb_kernels.mxfp8_triton import act_rounded
        from lutb_kernels.routing import moe_align_block_size

        tokens, top_k = ids.shape
        block = choose_route_block(tokens * top_k, self.num_experts)
        sorted_ids, expert_ids, ntpp = moe_align_block_size(ids, block, self.num_experts)
        h = torch.empty((tokens * top_k, self.w13.shape[1]), dtype=x.dtype, device=x.device)
        grouped_gemm(x, self.w13, h, None, sorted_ids, expert_ids, ntpp, top_k, block_m=block)
        g = act_rounded(h, self.activation)
        y = torch.empty((tokens * top_k, self.w2.shape[1]), dtype=x.dtype, device=x.device)
        grouped_gemm(g, self.w2, y, weights.reshape(-1), sorted_ids, expert_ids, ntpp, 1, block_m=block)
        held = torch.ones(tokens * top_k, dtype=torch.bool, device=x.device)
        return moe_combine(y, held, top_k)


# ----------------------------------------------------------------------------- correctness (runs on any device)


CHECK_TOL = 1e-2  # spec section 6: relative L2 error in bfloat16
CHECK_TOKENS = 64  # rows compared at a larger T (evenly spaced; each token's answer is its own)
REF_DENSE_BYTES = 4 << 30  # dense reference weights held at once (a group of tokens' experts)


def check_tokens_of(tokens_list: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """The T checked against the reference: the smallest, 32 (when run) and the largest."""
    ts = sorted(set(int(t) for t in tokens_list))
    return tuple(sorted({ts[0], ts[-1]} | ({32} & set(ts)))) if ts else ()


def check_rows(tokens: int, limit: int = CHECK_TOKENS) -> torch.Tensor | None:
    """Row indices compared at ``tokens`` (CPU int64), None for all of them (``tokens <= limit``)."""
    if tokens <= limit:
        return None
    return torch.linspace(0, tokens - 1, limit, dtype=torch.float64).round().long().unique()


def token_groups(ids_rows: list[list[int]], max_experts: int) -> list[list[int]]:
    """Consecutive token indices grouped so that each group routes to at most ``max_experts`` experts
    (a token routing to more is a group of its own)."""
    groups: list[list[int]] = []
    experts: set[int] = set()
    for i, row in enumerate(ids_rows):
        if groups and len(experts | set(row)) <= max_experts:
            groups[-1].append(i)
            experts |= set(row)
        else:
            groups.append([i])
            experts = set(row)
    return groups


def reference_output(w13_tiles: torch.Tensor, w2_tiles: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                     weights: torch.Tensor, *, num_experts: int, activation: str = "silu", scale_mode: str = "rceil",
                     budget_bytes: int = REF_DENSE_BYTES) -> torch.Tensor:
    """The spec's reference forward (``lutb_kernels.reference``) of ``x`` on ``x.device``, in ``x.dtype``.

    ``w13_tiles`` / ``w2_tiles``: the original LUT-B tiles (checkpoint layout, any device) of every expert, indexed
    by global expert id. Only the experts the tokens route to are dequantized (``tiles_to_dense``; bfloat16 holds
    each decoded value exactly: a bfloat16 LUT entry times a power of two), a group of tokens at a time so that at
    most ``budget_bytes`` of dense weights exist at once; tokens are independent, so the groups' rows are the
    rows of one reference call over all of them."""
    from lutb_kernels.reference import reference_moe_forward
    from lutb_kernels.tiles import tiles_to_dense

    dev = x.device
    n13, k13 = w13_tiles.shape[1] * 128, w13_tiles.shape[2] * 128
    n2, k2 = w2_tiles.shape[1] * 128, w2_tiles.shape[2] * 128
    per_expert = (n13 * k13 + n2 * k2) * 2
    ids_cpu = ids.cpu()
    out = torch.empty_like(x)
    for rows in token_groups(ids_cpu.tolist(), max(1, budget_bytes // per_expert)):
        experts = sorted(set(ids_cpu[rows].reshape(-1).tolist()))
        w13 = torch.empty((len(experts), n13, k13), dtype=torch.bfloat16, device=dev)
        w2 = torch.empty((len(experts), n2, k2), dtype=torch.bfloat16, device=dev)
        for i, e in enumerate(experts):
            w13[i] = tiles_to_dense(w13_tiles[e].to(dev), torch.bfloat16)
            w2[i] = tiles_to_dense(w2_tiles[e].to(dev), torch.bfloat16)
        r = torch.tensor(rows, dtype=torch.long, device=dev)
        out[r] = reference_moe_forward(x[r], ids[r], weights[r], w13, w2, torch.tensor(experts, dtype=torch.int32),
                                       num_experts=num_experts, activation=activation, scale_mode=scale_mode)
        del w13, w2
    return out


def correctness_record(outputs: dict[str, torch.Tensor], want: torch.Tensor, tol: float = CHECK_TOL) -> dict:
    """``{"<name>_rel_l2": ..., "<name>_nonfinite": n, "ok": every output finite and within ``tol`` of ``want``}``,
    plus ``packed_vs_emulated_rel_l2`` where both are given."""
    rec: dict = {"tokens_checked": int(want.shape[0]), "tolerance": tol,
                 "reference_nonfinite": int((~torch.isfinite(want)).sum())}
    ok = rec["reference_nonfinite"] == 0
    for name, got in outputs.items():
        if got.shape != want.shape:
            rec[f"{name}_rel_l2"], ok = float("nan"), False
            rec[f"{name}_shape"] = list(got.shape)
            continue
        rec[f"{name}_rel_l2"] = rel_l2(got, want)
        rec[f"{name}_nonfinite"] = int((~torch.isfinite(got)).sum())
        ok = ok and rec[f"{name}_nonfinite"] == 0 and rec[f"{name}_rel_l2"] <= tol  # NaN: not ok
    if "packed" in outputs and "emulated" in outputs and outputs["packed"].shape == outputs["emulated"].shape:
        rec["packed_vs_emulated_rel_l2"] = rel_l2(outputs["packed"], outputs["emulated"])
    rec["ok"] = bool(ok)
    return rec


def sci(value: float, tol: float) -> str:
    """``value`` in 3 significant digits, more where those would put it on the other side of ``tol``."""
    for digits in (2, 6, 16):
        text = f"{value:.{digits}e}"
        if not math.isfinite(value) or (float(text) <= tol) == (value <= tol):
            return text
    return repr(value)


def _run_at(sh: dict, tokens: int) -> dict | None:
    runs = sh.get("runs", {})
    return runs.get(tokens, runs.get(str(tokens)))  # int keys in the run, str after a JSON round trip


def correctness_gate(sh: dict) -> tuple[bool, str]:
    """``(ok, why)`` of a shape's correctness checks: every T in ``correctness_tokens`` checked and within tolerance."""
    planned = sh.get("correctness_tokens") or []
    if not planned:
        return False, "no correctness check ran"
    bad = []
    for t in planned:
        rec = (_run_at(sh, t) or {}).get("correctness")
        if rec is None:
            bad.append(f"T={t} not checked")
        elif rec.get("error"):
            bad.append(f"T={t} check failed: {rec['error'][:80]}")
        elif not rec.get("ok"):
            tol = rec.get("tolerance", CHECK_TOL)
            worst = [f"{b} rel-L2 {sci(rec[f'{b}_rel_l2'], tol)}" for b in ("packed", "emulated")
                     if f"{b}_rel_l2" in rec and not rec[f"{b}_rel_l2"] <= tol]
            worst += [f"{b} {rec[f'{b}_nonfinite']} non-finite" for b in ("packed", "emulated", "reference")
                      if rec.get(f"{b}_nonfinite")]
            bad.append(f"T={t} " + (", ".join(worst) or "not ok") + f" (tol {tol:g})")
    return not bad, "; ".join(bad) or "ok"


# ----------------------------------------------------------------------------- per shape


def make_backends(name: str, experts: int, hidden: int, inter: int) -> tuple[dict, dict, object]:
    from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
    from lutb_kernels.experts.emulated import LutBEmulationTritonExperts
    from lutb_kernels.experts.packed import LutBPackedExperts
    from lutb_kernels.lut_b_gemm import random_tiles

    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, activation="silu", dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    t0 = time.time()
    layer = LayerWeights(
        random_tiles(cfg.w13_tiles_shape(experts), k=hidden, device="cuda", generator=gen),
        random_tiles(cfg.w2_tiles_shape(experts), k=inter, device="cuda", generator=gen),
        torch.arange(experts, dtype=torch.int32),
    )
    packed = LutBPackedExperts(cfg, layer, "cuda")
    emulated = LutBEmulationTritonExperts(cfg, layer, "cuda")
    # The original tiles, on the host, for the reference the outputs are checked against (packed's are converted).
    tiles = {"w13": layer.w13.cpu(), "w2": layer.w2.cpu(), "scale_mode": cfg.mxfp8_scale_mode}
    del layer
    log(f"[{name}] weights ready in {time.time() - t0:.1f} s")
    n_weights = experts * (cfg.w13_rows * hidden + hidden * inter)
    memory = {
        "packed": packed.weight_bytes,
        "emulated": emulated.weight_bytes,
        "bf16_grouped_mm": emulated.weight_bytes,
        "bf16_triton": emulated.weight_bytes,
    }
    bits = {k: v * 8 / n_weights for k, v in memory.items()}
    fns: dict = {
        "packed": lambda x, i, w: packed.forward_unchecked(x, i, w),
        "emulated": lambda x, i, w: emulated.forward_unchecked(x, i, w),
        "bf16_triton": Bf16Triton(emulated.w13, emulated.w2, "silu", experts),
    }
    if Bf16GroupedMm.available():
        fns["bf16_grouped_mm"] = Bf16GroupedMm(emulated.w13, emulated.w2, "silu")
    info = {"memory_bytes": memory, "bits_per_weight": bits, "per_expert_packed_bytes": packed.weight_bytes // experts}
    return fns, info, (packed, emulated, tiles)


PREFILL_AB_FROM = 2048


def prefill_paths(packed, x: torch.Tensor, rot: list, weights: torch.Tensor) -> dict:  # noqa: ANN001
    """us per packed forward with tiles decoded in the GEMM ("in_kernel") and dequantized first ("dense")."""
    import copy

    times: dict = {}
    outs = []
    for label, rows in (("in_kernel", None), ("dense", 0)):
        variant = copy.copy(packed)  # shares the weights
        variant.dense_from_rows_per_expert = rows
        variant.dense_scratch_bytes = 1 << 62  # "dense" even where the default's scratch limit says no
        outs.append(variant.forward_unchecked(x, rot[0], weights).float())
        times[label], times[f"{label}_method"] = time_graph_rot(
            [lambda r=r, v=variant: v.forward_unchecked(x, r, weights) for r in rot])
    times["default"] = "dense" if packed.uses_dense_weights(rot[0].numel()) else "in_kernel"
    times["dense_vs_in_kernel_rel_l2"] = rel_l2(outs[1], outs[0])
    return times


AB_REPEATS = 5  # on/off pairs, interleaved, so clock drift between the two cannot pose as a gain
# --ab NAME...: the same packed forward timed with one module-level switch on and off:
# name -> (module, attribute, "on" value, "off" value)
AB_SWITCHES = {
    "pdl": ("lutb_kernels._grouped_gemm_details.launch", "PDL", True, False),
    "unroll": ("lutb_kernels.lut_b_gemm", "TILE_UNROLL", 2, 1),
    "stream_k": ("lutb_kernels.lut_b_gemm", "STREAM_K_PER_SM", 4, 0),
    "qdq_grid": ("lutb_kernels.mxfp8_triton", "QDQ_PROGRAMS_PER_SM", 8, 0),
    "stream_k_tiles": ("lutb_kernels.lut_b_gemm", "STREAM_K_BELOW_TILES", 32, 16),
    "min_split_waves": ("lutb_kernels.lut_b_gemm", "DECODE_MIN_SPLIT_BELOW_PROGRAMS_PER_SM", 24, 10**9),
    "wide_grid_maxnreg": ("lutb_kernels.lut_b_gemm", "DECODE_WIDE_GRID_PROGRAMS_PER_SM", 12, 10**9),
    "routing_chunk": ("lutb_kernels.routing_triton", "PAIRWISE_RANK_CHUNK", 32, 128),
}
AB = ()  # the switches to A/B (set from the command line)


def interleaved_ab(name: str, packed, x: torch.Tensor, rot: list, weights: torch.Tensor,  # noqa: ANN001
                   repeats: int = AB_REPEATS) -> dict:
    """us per packed forward with switch ``name`` (AB_SWITCHES) on and off, ``repeats`` interleaved pairs.

    Fresh CUDA graphs each time; the switch is restored afterwards. Returns
    ``{"on": [us...], "off": [us...], "method": str}``.
    """
    import importlib

    module_name, attr, on_value, off_value = AB_SWITCHES[name]
    module = importlib.import_module(module_name)
    saved = getattr(module, attr)
    runs: dict = {"on": [], "off": []}
    method = ""
    try:
        for _ in range(repeats):
            for label, value in (("on", on_value), ("off", off_value)):
                setattr(module, attr, value)
                us, method = time_graph_rot([lambda r=r: packed.forward_unchecked(x, r, weights) for r in rot])
                runs[label].append(us)
    finally:
        setattr(module, attr, saved)
    runs["method"] = method
    return runs


def ab_table(results: dict, name: str) -> str:
    """Median us of packed with switch ``name`` on and off over the interleaved pairs, and their spread."""
    _, attr, on_value, off_value = AB_SWITCHES[name]
    lines = [f"{name}: packed forward us (CUDA graph), {attr} = {on_value} (on) / {off_value} (off), "
             f"median of {AB_REPEATS} interleaved pairs [min-max]",
             f"{'shape':16s} {'T':>5s} {'on':>9s} {'on range':>15s} {'off':>9s} {'off range':>15s} {'saved':>7s}"]
    for shape, sres in results["shapes"].items():
        for t, run in sres["runs"].items():
            ab = run.get("ab", {}).get(name)
            if ab and ab.get("error"):
                lines.append(f"{shape:16s} {int(t):5d} error: {ab['error']}")
            elif ab:
                on, off = statistics.median(ab["on"]), statistics.median(ab["off"])
                on_r = f"{min(ab['on']):.1f}-{max(ab['on']):.1f}"
                off_r = f"{min(ab['off']):.1f}-{max(ab['off']):.1f}"
                lines.append(f"{shape:16s} {int(t):5d} {on:9.1f} {on_r:>15s} {off:9.1f} {off_r:>15s} {off - on:7.1f}")
    return "\n".join(lines)


def check_correctness(packed, emulated, tiles: dict, x: torch.Tensor, ids: torch.Tensor,  # noqa: ANN001
                      weights: torch.Tensor, experts: int) -> dict:
    """Packed and emulated forwards (the ones timed) against the reference on ``check_rows`` of the batch."""
    rows = check_rows(x.shape[0])

    def sel(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t[rows.to(t.device)]

    outs = {"packed": sel(packed.forward_unchecked(x, ids, weights)), "emulated": sel(emulated.forward_unchecked(x, ids, weights))}
    want = reference_output(tiles["w13"], tiles["w2"], sel(x), sel(ids), sel(weights), num_experts=experts,
                            scale_mode=tiles["scale_mode"])
    return correctness_record(outs, want, CHECK_TOL)


def bench_shape(name: str, tokens_list: tuple[int, ...], results: dict) -> None:
    """Every cell of one shape into ``results["shapes"][name]``; a cell that raises is recorded with its error."""
    experts, hidden, inter, top_k = SHAPES[name]
    shape_res: dict = {"experts": experts, "hidden": hidden, "intermediate": inter, "top_k": top_k,
                       "correctness_tokens": list(check_tokens_of(tokens_list)), "runs": {}}
    results["shapes"][name] = shape_res
    made, error = guarded(f"[{name}] setup", lambda: make_backends(name, experts, hidden, inter))
    if error is not None:
        shape_res["error"] = error
        return
    fns, info, (packed, emulated, tiles) = made
    shape_res.update(info)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for tokens in tokens_list:
        run: dict = {}
        shape_res["runs"][tokens] = run
        check = tokens in shape_res["correctness_tokens"]
        _, error = guarded(f"[{name}] T={tokens}", lambda: bench_tokens(name, tokens, gen, check, fns, info, packed, emulated,
                                                                        tiles, run))
        if error is not None:
            run["error"] = error
    fns = packed = emulated = tiles = None  # (not del: closures above name them) frees the weights
    guarded("empty_cache", torch.cuda.empty_cache)


def bench_tokens(name: str, tokens: int, gen: torch.Generator, check: bool, fns: dict, info: dict, packed,  # noqa: ANN001
                 emulated, tiles: dict, run: dict) -> None:  # noqa: ANN001
    """One (shape, T) into ``run``: the correctness check (``check``), each backend's time, the A/B switches, the
    prefill paths."""
    experts, hidden, _, top_k = SHAPES[name]
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), dim=1)
    touched_experts = int(torch.unique(ids).numel())
    rot = rotated_ids(ids, experts, rotations_for(tokens))
    union = int(torch.unique(torch.cat([r.reshape(-1) for r in rot])).numel()) * info["per_expert_packed_bytes"]
    run.update({"touched_experts": touched_experts, "touched_packed_bytes": touched_experts * info["per_expert_packed_bytes"],
                "rotations": len(rot), "rotation_union_packed_bytes": union, "l2_resident": union < 2 * L2_BYTES})
    if check:
        rec, error = guarded(f"[{name}] T={tokens} correctness",
                             lambda: check_correctness(packed, emulated, tiles, x, ids, weights, experts))
        run["correctness"] = {"error": error, "ok": False} if error is not None else rec
        if rec is not None and "packed_vs_emulated_rel_l2" in rec:
            run["packed_vs_emulated_rel_l2"] = rec["packed_vs_emulated_rel_l2"]
        if rec is not None:
            log(f"[{name}] T={tokens:5d} vs reference ({rec['tokens_checked']} rows): packed rel-L2 "
                f"{rec['packed_rel_l2']:.2e}, emulated {rec['emulated_rel_l2']:.2e}: {'ok' if rec['ok'] else 'FAILED'}")
    for backend, fn in fns.items():
        run[backend] = timed_cell(f"[{name}] T={tokens} {backend}", [lambda fn=fn, r=r: fn(x, r, weights) for r in rot])
    for switch in AB:
        ab, error = guarded(f"[{name}] T={tokens} ab {switch}", lambda: interleaved_ab(switch, packed, x, rot, weights))
        run.setdefault("ab", {})[switch] = ab if error is None else {"error": error}
        if error is None:
            log(f"[{name}] T={tokens:5d} packed {switch} on {ab['on']} off {ab['off']} us")
    if tokens >= PREFILL_AB_FROM:
        paths, error = guarded(f"[{name}] T={tokens} packed paths", lambda: prefill_paths(packed, x, rot, weights))
        run["packed_paths"] = paths if error is None else {"error": error}
        if error is None:
            log(f"[{name}] T={tokens:5d} packed paths: {paths}")
    run["packed_touched_TBps"] = ratio(run["touched_packed_bytes"], run["packed"]["us"]) / 1e6
    peers = [run[p]["us"] for p in PEERS if p in run and not math.isnan(run[p]["us"])]
    run["fastest_peer_us"] = min(peers) if peers else float("nan")
    log(f"[{name}] T={tokens:5d} " + " ".join(f"{b}={run[b]['us']:.1f}us" for b in fns) +
        f" touched={run['packed_touched_TBps']:.2f}TB/s" + (" (L2-resident)" if run["l2_resident"] else ""))


def ratio(a: float, b: float) -> float:
    """``a / b``; NaN where ``b`` is 0 or either is NaN."""
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else float("nan")


def _missing(results: dict, run: dict, needs: tuple[str, ...]) -> list[str]:
    """Why a target needing ``needs`` (backends, "peers", "hbm") cannot be judged at ``run``: its cells' errors."""
    if run.get("error"):  # the run stopped before (some of) its cells
        return [f"run: {run['error']}"]
    why = []
    for need in needs:
        if need == "hbm":
            if results["hbm"].get("error"):
                why.append(f"hbm: {results['hbm']['error']}")
        elif need == "peers":  # a failed peer might have been the fastest one: no verdict against the others
            why += [f"{p}: {run[p]['error']}" for p in PEERS if run.get(p, {}).get("error")]
            if not any(p in run and not math.isnan(run[p]["us"]) for p in PEERS):
                why.append("no bf16 peer timed")
        elif need not in run:
            why.append(f"{need}: not run")
        elif run[need].get("error"):
            why.append(f"{need}: {run[need]['error']}")
    return why


def evaluate_targets(results: dict) -> list[dict]:
    """The targets of ``results`` (no GPU needed): ``{"target", "value", "met", "shape", "tokens", ...}`` each.

    A performance target is not met where a cell it needs failed (value "error: ...") or where its shape failed
    its correctness gate (:func:`correctness_gate`; the value then says why). The bits-per-weight target counts
    bytes, so correctness does not gate it. Values are shown so that they never contradict the verdict
    (:func:`judged`)."""
    nan = float("nan")
    hbm = results["hbm"].get("sum_read_TBps", nan)  # "HBM read bandwidth": the read-only reduction
    copy = results["hbm"].get("copy_read_plus_write_TBps", nan)
    targets = []
    for name, sh in results["shapes"].items():
        if sh.get("error"):
            targets.append({"shape": name, "tokens": None, "target": f"{name}: benchmarked",
                            "value": f"error: {sh['error']}", "met": False})
            continue
        gate_ok, gate_why = correctness_gate(sh)
        for tokens, run in sh["runs"].items():
            tokens = int(tokens)
            packed = run.get("packed", {}).get("us", nan)
            peer = run.get("fastest_peer_us", nan)
            specs = []  # (target, needs, value, threshold, higher is better, decimals, shown -> value text)
            if name in ("mixtral-8x7b", "deepseek-v3") and tokens <= 32:
                touched = run.get("packed_touched_TBps", nan)
                l2 = " (L2-resident!)" if run.get("l2_resident") else ""
                specs.append((f"{name} T={tokens}: packed >= 60% HBM read BW on touched bytes", ("packed", "hbm"),
                              100 * ratio(touched, hbm), 60.0, True, 1,
                              lambda v, touched=touched, l2=l2: f"{v}% of read {hbm:.2f} TB/s "
                                                                f"({100 * ratio(touched, copy):.0f}% of copy){l2}"))
                specs.append((f"{name} T={tokens}: packed >= 2.5x faster than fastest bf16 peer", ("packed", "peers"),
                              ratio(peer, packed), 2.5, True, 2, lambda v: f"{v}x"))
            if tokens == 8192:
                specs.append((f"{name} T=8192: packed within 1.5x of fastest bf16 peer", ("packed", "peers"),
                              ratio(packed, peer), 1.5, False, 2, lambda v: f"{v}x"))
            specs.append((f"{name} T={tokens}: emulated within 1.25x of fastest bf16 peer", ("emulated", "peers"),
                          ratio(run.get("emulated", {}).get("us", nan), peer), 1.25, False, 2, lambda v: f"{v}x"))
            for target, needs, value, threshold, higher, decimals, show in specs:
                rec = {"shape": name, "tokens": tokens, "target": target, "number": value, "threshold": threshold,
                       "correctness_ok": gate_ok}
                why = _missing(results, run, needs)
                if why:
                    rec.update(value="error: " + "; ".join(why), met=False)
                else:
                    met, shown = judged(value, threshold, higher_is_better=higher, decimals=decimals)
                    rec.update(value=show(shown), met=met)
                    if not gate_ok:
                        rec.update(value=f"{rec['value']} [correctness FAILED: {gate_why}]", met=False)
                targets.append(rec)
        bits = sh["bits_per_weight"]["packed"]
        met, shown = judged(bits, 3.3, higher_is_better=False, decimals=3)
        targets.append({"shape": name, "tokens": None, "target": f"{name}: packed weights <= 3.3 bits/weight",
                        "value": shown, "met": met, "number": bits, "threshold": 3.3})
    return targets


# ----------------------------------------------------------------------------- tuning (optional)


BREAKDOWN_TOKENS = (1, 8, 32)
TUNE_SMALL_T = (1, 8, 32)
TUNE_LARGE_T = (2048, 8192)


def _packed_only(name: str):  # noqa: ANN202
    """The packed experts of a shape (no bf16 copy: deepseek's would be 22 GB)."""
    from lutb_kernels.checkpoint import CheckpointConfig, LayerWeights
    from lutb_kernels.experts.packed import LutBPackedExperts
    from lutb_kernels.lut_b_gemm import random_tiles

    experts, hidden, inter, _ = SHAPES[name]
    cfg = CheckpointConfig(hidden_size=hidden, intermediate_size=inter, num_experts=experts, activation="silu", dtype="bfloat16")
    gen = torch.Generator(device="cuda").manual_seed(0)
    layer = LayerWeights(random_tiles(cfg.w13_tiles_shape(experts), k=hidden, device="cuda", generator=gen),
                         random_tiles(cfg.w2_tiles_shape(experts), k=inter, device="cuda", generator=gen),
                         torch.arange(experts, dtype=torch.int32))
    return LutBPackedExperts(cfg, layer, "cuda")


# "held": every forward has the routing kernel write the held mask since 2026-12-06 (padding routes, id -1, are not
# held); "held (emap index)" is the three torch launches it replaced, kept for comparison.
STAGES_NOT_SUMMED = ("whole forward", "moe_align_block_size (triton)", "held (emap index)", "moe_align_block_size (triton) + held")


def _stage_label(name: str) -> str:
    """Short stage name for the log line: "gemm1 (w13)" -> "gemm1", "x (triton) + held" -> "x(triton)+held"."""
    head, _, rest = name.partition(" ")
    return head + rest.replace(" ", "") if rest.startswith("(triton)") else head


def breakdown(results: dict, shapes: list[str], only: tuple[str, ...] = ()) -> None:
    """Per-stage CUDA-graph time of the packed forward at decode sizes (rotated routings: fresh weights).

    ``only``: time just the GEMM configs whose name contains one of these strings (and "default")."""
    from lutb_kernels.experts._triton_common import choose_route_block
    from lutb_kernels.grouped_gemm import moe_combine
    import lutb_kernels.lut_b_gemm as lbg
    from lutb_kernels.lut_b_gemm import LutBGemmConfig, default_config, lut_b_moe_gemm
    from lutb_kernels.mxfp8_triton import act_mxfp8_qdq, mxfp8_qdq
    from lutb_kernels.routing import moe_align_block_size
    from lutb_kernels.tiles import to_kernel_layout
    from lutb_kernels.routing_triton import moe_align_block_size_triton

    out = results.setdefault("breakdown", {})
    dev = torch.device("cuda")
    for name in shapes:
        experts, hidden, inter, top_k = SHAPES[name]
        pk = _packed_only(name)
        assert pk.kernel_layout
        checkpoint_layout = {}  # the checkpoint-layout candidates' weights (to_kernel_layout inverse), made on first use
        per_expert = pk.weight_bytes // experts
        w13_bytes = pk.w13[0].numel()
        w2_bytes = pk.w2[0].numel()
        emap = pk._emap
        gen = torch.Generator(device="cuda").manual_seed(3)
        for tokens in BREAKDOWN_TOKENS:
            x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            ids0 = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
            weights = torch.softmax(torch.randn(tokens, top_k, device="cuda", generator=gen), dim=1)
            wflat = weights.reshape(-1).contiguous()
            rots = rotated_ids(ids0, experts, ROTATIONS)
            touched = [int(torch.unique(r).numel()) for r in rots]
            block = choose_route_block(tokens * top_k, experts)
            flag = torch.zeros(1, dtype=torch.int32, device="cuda")
            # precomputed inputs of every stage, per rotation
            st = []
            for ids in rots:
                routing = moe_align_block_size(ids, block, experts, expert_map=emap)
                held = emap[ids.long()] >= 0
                a1 = mxfp8_qdq(x, k_order="decoder", out_dtype=torch.bfloat16, nonfinite=flag)
                h = torch.empty((tokens * top_k, 2 * inter), dtype=torch.bfloat16, device="cuda")
                a2 = torch.empty((tokens * top_k, inter), dtype=torch.bfloat16, device="cuda")
                y = torch.empty((tokens * top_k, hidden), dtype=torch.bfloat16, device="cuda")
                st.append(dict(ids=ids, routing=routing, held=held, held_buf=torch.empty_like(held), a1=a1, h=h, a2=a2, y=y))

            def weights_for(w: torch.Tensor, kernel_layout: bool) -> torch.Tensor:
                if kernel_layout:
                    return w
                if id(w) not in checkpoint_layout:
                    checkpoint_layout[id(w)] = to_kernel_layout(w, inverse=True)
                return checkpoint_layout[id(w)]

            def g1(d, cfg=None, kernel_layout=True):  # noqa: ANN001, ANN202
                lut_b_moe_gemm(d["a1"], None, weights_for(pk.w13, kernel_layout), d["h"], None, *d["routing"], top_k,
                               block_m=block, a_k_order="decoder", config=cfg, kernel_layout=kernel_layout)

            def g2(d, cfg=None, kernel_layout=True):  # noqa: ANN001, ANN202
                lut_b_moe_gemm(d["a2"], None, weights_for(pk.w2, kernel_layout), d["y"], wflat, *d["routing"], 1,
                               block_m=block, a_k_order="decoder", config=cfg, kernel_layout=kernel_layout)

            stages = {
                # a shard's held mask as three torch launches (before 2026-12-04), and the routing kernel writing it
                "held (emap index)": lambda d: emap[d["ids"].long()] >= 0,
                "moe_align_block_size (triton) + held": lambda d: moe_align_block_size_triton(
                    d["ids"], block, experts, expert_map=emap, held_out=d["held_buf"]),
                "moe_align_block_size": lambda d: moe_align_block_size(d["ids"], block, experts, expert_map=emap),
                # what the forward runs at decode sizes (triton_routing_wins); an alternative, so not in the sum
                "moe_align_block_size (triton)": lambda d: moe_align_block_size_triton(d["ids"], block, experts, expert_map=emap),
                "mxfp8_qdq(x)": lambda d: mxfp8_qdq(x, k_order="decoder", out_dtype=torch.bfloat16, nonfinite=flag),
                "gemm1 (w13)": g1,
                "act+qdq": lambda d: act_mxfp8_qdq(d["h"], "silu", row_mask=d["held"].reshape(-1), k_order="decoder",
                                                   out_dtype=torch.bfloat16, nonfinite=flag),
                "gemm2 (w2)": g2,
                "combine": lambda d: moe_combine(d["y"], d["held"], top_k),
                "whole forward": lambda d: pk.forward_unchecked(x, d["ids"], weights, nonfinite=flag),
            }
            rec: dict = {"route_block": block, "touched_experts_mean": sum(touched) / len(touched), "stages_us": {},
                         "gemm_configs": {}}
            for sname, fn in stages.items():
                try:
                    us, method = time_graph_rot([lambda fn=fn, d=d: fn(d) for d in st])
                except Exception as exc:  # noqa: BLE001
                    us, method = float("nan"), f"{type(exc).__name__}: {str(exc)[:80]}"
                    log(f"  stage {sname} failed: {method}")
                rec["stages_us"][sname] = us
                rec.setdefault("stages_method", {})[sname] = method
            try:  # the Triton routing must equal the torch one before its time means anything
                same = all(all(torch.equal(a, b) for a, b in zip(
                    moe_align_block_size_triton(d["ids"], block, experts, expert_map=emap), d["routing"])) for d in st)
            except Exception as exc:  # noqa: BLE001
                same = f"{type(exc).__name__}: {str(exc)[:80]}"
            rec["triton_routing_equal"] = same
            if same is not True:
                log(f"  moe_align_block_size (triton) differs from the torch routing: {same}")
            te = rec["touched_experts_mean"]
            rec["sum_of_stages_us"] = sum(v for k, v in rec["stages_us"].items() if k not in STAGES_NOT_SUMMED)
            rec["gemm1_TBps"] = te * w13_bytes / rec["stages_us"]["gemm1 (w13)"] / 1e6
            rec["gemm2_TBps"] = te * w2_bytes / rec["stages_us"]["gemm2 (w2)"] / 1e6
            rec["forward_TBps"] = te * per_expert / rec["stages_us"]["whole forward"] / 1e6
            # the GEMMs alone under a few configs (defaults first)
            for gname, gfn, (n, k, tk) in (("gemm1", g1, (2 * inter, hidden, top_k)), ("gemm2", g2, (hidden, inter, 1))):
                base = default_config(tokens * top_k, n, k, experts, block, dev)
                saved, lbg.STREAM_K_PER_SM = lbg.STREAM_K_PER_SM, 0
                plain = default_config(tokens * top_k, n, k, experts, block, dev)
                lbg.STREAM_K_PER_SM = saved
                cands = {"default": base}
                if plain != base:
                    cands["plain grid"] = plain
                if base.stream_k:  # programs per SM with the register cap that fits them
                    cands["stream_k=3 no cap"] = LutBGemmConfig(**{**base.__dict__, "stream_k": 3, "maxnreg": None})
                    cands["stream_k=5 maxnreg=96"] = LutBGemmConfig(**{**base.__dict__, "stream_k": 5, "maxnreg": 96})
                for sk in (base.split_k // 2, base.split_k * 2, base.split_k * 4):
                    if sk >= 1:
                        cands[f"split_k={sk}"] = LutBGemmConfig(**{**base.__dict__, "split_k": sk})
                cands["block_n=64"] = LutBGemmConfig(**{**base.__dict__, "block_n": 64})
                cands["decoder=prmt"] = LutBGemmConfig(**{**base.__dict__, "decoder": "prmt"})
                # the same configs on the checkpoint's tile layout (the selector's shifts back, 48-byte rows)
                cands["checkpoint layout"] = base
                if plain != base:
                    cands["plain grid, checkpoint layout"] = plain
                cands["prefetch"] = LutBGemmConfig(**{**base.__dict__, "prefetch": True})
                cands["stages=4"] = LutBGemmConfig(**{**base.__dict__, "num_stages": 4})
                for regs in (None, 96, 80):  # the compiler's choice (127 at decode: 4 blocks per SM), 5 and 6 blocks
                    if regs != base.maxnreg:
                        cands[f"maxnreg={regs}"] = LutBGemmConfig(**{**base.__dict__, "maxnreg": regs})
                if only:
                    cands = {c: cfg for c, cfg in cands.items() if c == "default" or any(o in c for o in only)}
                tb = (w13_bytes if gname == "gemm1" else w2_bytes) * te
                for cname, cfg in cands.items():
                    try:
                        kl = "checkpoint layout" not in cname
                        us, method = time_graph_rot([lambda d=d, cfg=cfg, kl=kl: gfn(d, cfg, kl) for d in st])
                    except Exception as exc:  # noqa: BLE001
                        log(f"  {gname} {cname}: {type(exc).__name__}: {str(exc)[:100]}")
                        continue
                    rec["gemm_configs"][f"{gname} {cname}"] = {"us": us, "TBps": tb / us / 1e6, "config": str(cfg),
                                                               "method": method}
            out[f"{name} T={tokens}"] = rec
            log(f"[breakdown] {name} T={tokens} block={block} touched={te:.1f} experts: " +
                ", ".join(f"{k}={v:.1f}" for k, v in rec["stages_us"].items()) +
                f" | sum={rec['sum_of_stages_us']:.1f} us; gemm1 {rec['gemm1_TBps']:.2f} TB/s gemm2 {rec['gemm2_TBps']:.2f} TB/s")
            for k, v in rec["gemm_configs"].items():
                log(f"   {k:28s} {v['us']:8.1f} us {v['TBps']:5.2f} TB/s")
            del st
        routing_prefill(results, name, experts, top_k, emap)
        checkpoint_layout.clear()
        pk = None  # (not del: the stage closures name it) frees the weights
        torch.cuda.empty_cache()


ROUTING_PREFILL_TOKENS = (2048, 8192)


def routing_prefill(results: dict, name: str, experts: int, top_k: int, emap: torch.Tensor) -> None:
    """Torch vs one-launch Triton ``moe_align_block_size`` alone at prefill sizes (CUDA graph)."""
    from lutb_kernels.experts._triton_common import choose_route_block
    from lutb_kernels.routing import moe_align_block_size
    from lutb_kernels.routing_triton import moe_align_block_size_triton

    out = results.setdefault("routing_prefill", {})
    gen = torch.Generator(device="cuda").manual_seed(11)
    for tokens in ROUTING_PREFILL_TOKENS:
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
        block = choose_route_block(tokens * top_k, experts)
        rec: dict = {"route_block": block}
        for label, fn in (("torch_us", moe_align_block_size), ("triton_us", moe_align_block_size_triton)):
            try:
                rec[label], _ = time_graph(lambda fn=fn, ids=ids, block=block: fn(ids, block, experts, expert_map=emap))
            except Exception as exc:  # noqa: BLE001
                rec[label] = float("nan")
                log(f"  routing {label} {name} T={tokens} failed: {type(exc).__name__}: {str(exc)[:100]}")
        try:
            rec["equal"] = all(torch.equal(a, b) for a, b in zip(
                moe_align_block_size_triton(ids, block, experts, expert_map=emap),
                moe_align_block_size(ids, block, experts, expert_map=emap)))
        except Exception as exc:  # noqa: BLE001
            rec["equal"] = f"{type(exc).__name__}: {str(exc)[:80]}"
        out[f"{name} T={tokens}"] = rec
        log(f"[routing] {name} T={tokens} block={block}: torch {rec['torch_us']:.1f} us, triton {rec['triton_us']:.1f} us, "
            f"equal={rec['equal']}")


GROUPED_TUNE_SHAPES = (("mixtral-8x7b", 8192), ("mixtral-8x7b", 2048), ("qwen3-30b-a3b", 8192))


def grouped_candidates(block: int):  # noqa: ANN201
    """Dense grouped-GEMM tiles for large batches (block_m must divide the routing block)."""
    from lutb_kernels.grouped_gemm import GroupedGemmConfig

    c = []
    for bm, bn, bk, w, s in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4),
                             (128, 128, 64, 4, 4), (256, 128, 64, 8, 3), (128, 256, 32, 8, 4), (64, 256, 64, 4, 4)):
        if block % bm == 0:
            c.append(GroupedGemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s))
    return c


def tune_grouped(results: dict, budget_s: float = 1e9) -> None:
    """Sweep the dense grouped GEMM's tile at large T (the emulated backend and packed's prefill path)."""
    from lutb_kernels.experts._triton_common import choose_route_block
    from lutb_kernels.grouped_gemm import default_config, grouped_gemm
    from lutb_kernels.routing import moe_align_block_size

    t0 = time.time()
    recs = results.setdefault("tune_grouped", [])
    for name, tokens in GROUPED_TUNE_SHAPES:
        if time.time() - t0 > budget_s:
            log(f"[tune-grouped] budget {budget_s:.0f} s spent; stopping before {name} T={tokens}")
            break
        experts, hidden, inter, top_k = SHAPES[name]
        gen = torch.Generator(device="cuda").manual_seed(3)
        w13 = torch.randn((experts, 2 * inter, hidden), device="cuda", generator=gen, dtype=torch.bfloat16) * hidden**-0.5
        w2 = torch.randn((experts, hidden, inter), device="cuda", generator=gen, dtype=torch.bfloat16) * inter**-0.5
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
        g = torch.randn(tokens * top_k, inter, device="cuda", generator=gen).to(torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
        block = choose_route_block(tokens * top_k, experts)
        routing = moe_align_block_size(ids, block, experts)
        for label, a, w, out_n, k in (("w13", x, w13, 2 * inter, top_k), ("w2", g, w2, hidden, 1)):
            out = torch.empty((tokens * top_k, out_n), dtype=torch.bfloat16, device="cuda")
            base = default_config(tokens * top_k, out_n, a.shape[1], experts, block, torch.device("cuda"))
            for cfg in [base] + [c for c in grouped_candidates(block) if c != base]:
                try:
                    us, _ = time_graph(lambda cfg=cfg, a=a, w=w, out=out, k=k: grouped_gemm(
                        a, w, out, None, *routing, k, block_m=block, config=cfg), replays=3, rounds=3)
                except Exception as exc:  # noqa: BLE001 - a tile that does not compile (shared memory) is skipped
                    us = float("nan")
                    log(f"[tune-grouped] {cfg}: {type(exc).__name__}: {str(exc)[:80]}")
                flops = 2 * tokens * top_k * out_n * a.shape[1]
                recs.append({"shape": name, "tokens": tokens, "gemm": label, "route_block": block, "default": cfg == base,
                             "config": {f: getattr(cfg, f) for f in ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages")},
                             "us": us, "tflops": flops / us / 1e6})
                log(f"[tune-grouped] {name} T={tokens} {label} {'DEFAULT ' if cfg == base else ''}{cfg}: {us:.1f} us "
                    f"{flops / us / 1e6:.0f} TFLOP/s")
        del w13, w2
        torch.cuda.empty_cache()


def tune_grouped_table(results: dict) -> str:
    lines = ["tune-grouped: us (TFLOP/s) per dense grouped GEMM, default first"]
    for r in results.get("tune_grouped", []):
        c = r["config"]
        lines.append(f"  {r['shape']:14s} T={r['tokens']:5d} {r['gemm']:3s} rb{r['route_block']} {'*' if r['default'] else ' '}"
                     f" bm{c['block_m']} bn{c['block_n']} bk{c['block_k']} w{c['num_warps']} s{c['num_stages']}"
                     f" {r['us']:9.1f} us ({r['tflops']:.0f})")
    return "\n".join(lines)


def tune_candidates(block: int, tokens: int):  # noqa: ANN201
    """The sweep: small T varies the grid (block_n, split-K), large T the tile (block_m/n, warps, stages)."""
    from lutb_kernels.lut_b_gemm import LutBGemmConfig

    c = []
    if tokens <= 128:
        for bn in (64, 128):
            for sk in (1, 2, 4, 8, 16):
                c.append(LutBGemmConfig(block_m=min(16, block), block_n=bn, split_k=sk, swap_ab=True, num_warps=4,
                                        num_stages=3, groups_per_step=1, tile_loop=True))
        c.append(LutBGemmConfig(block_m=min(16, block), block_n=128, split_k=4, swap_ab=True, num_warps=4, num_stages=3,
                                groups_per_step=1, tile_loop=True, prefetch=True))
        c.append(LutBGemmConfig(block_m=min(16, block), block_n=32, split_k=4, swap_ab=True, num_warps=2, num_stages=3,
                                groups_per_step=1, tile_loop=True))
        for sk in (2, 4, 8):  # register caps (Nsight Compute: 127 registers cap occupancy; the loop above: none)
            for regs in (96, 80):
                c.append(LutBGemmConfig(block_m=min(16, block), block_n=128, split_k=sk, swap_ab=True, num_warps=4,
                                        num_stages=3, groups_per_step=1, tile_loop=True, maxnreg=regs))
    else:
        for bm, bn, w, s in ((128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 4, 3),
                             (64, 64, 4, 3), (64, 128, 4, 4)):
            if block % bm == 0:
                c.append(LutBGemmConfig(block_m=bm, block_n=bn, split_k=1, swap_ab=True, num_warps=w, num_stages=s,
                                        groups_per_step=1, tile_loop=True))
        c.append(LutBGemmConfig(block_m=min(128, block), block_n=128, split_k=1, swap_ab=False, num_warps=8, num_stages=3,
                                groups_per_step=1, tile_loop=True))
    return c


def tune(results: dict, quick: bool, out_dir: Path, budget_s: float = 1e9) -> None:
    """Sweep lut_b_moe_gemm configs (GEMM alone, CUDA-graph, rotated routings at small T) on mixtral/deepseek."""
    from lutb_kernels import mxfp8_triton as mt
    from lutb_kernels.experts._triton_common import choose_route_block
    from lutb_kernels.lut_b_gemm import default_config, lut_b_moe_gemm, random_tiles
    from lutb_kernels.routing import moe_align_block_size
    from lutb_kernels.tiles import to_kernel_layout

    t0 = time.time()
    recs = results.setdefault("tune", [])
    for name in ("mixtral-8x7b", "deepseek-v3"):
        experts, hidden, inter, top_k = SHAPES[name]
        for which, (n, k) in (("w13", (2 * inter, hidden)), ("w2", (hidden, inter))):
            w = to_kernel_layout(random_tiles((experts, n // 128, k // 128), k=k, device="cuda"))  # as packed keeps them
            per_expert = w[0].numel()
            for tokens in ((1, 32) if quick else TUNE_SMALL_T + TUNE_LARGE_T):
                if time.time() - t0 > budget_s:
                    log(f"[tune] budget of {budget_s:.0f} s spent: skipping {name} {which} T={tokens}")
                    continue
                tk = top_k if which == "w13" else 1
                m_rows = tokens if which == "w13" else tokens * top_k
                ids0 = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=1).indices.to(torch.int32)
                rots = rotated_ids(ids0, experts, rotations_for(tokens))
                te = sum(int(torch.unique(r).numel()) for r in rots) / len(rots)
                block = choose_route_block(tokens * top_k, experts)
                routings = [moe_align_block_size(r, block, experts) for r in rots]
                q = mt.mxfp8_qdq(torch.randn(m_rows, k, device="cuda", dtype=torch.bfloat16), k_order="decoder",
                                 out_dtype=torch.bfloat16)
                tw = torch.rand(tokens * top_k, device="cuda") if which == "w2" else None
                outt = torch.empty(tokens * top_k, n, device="cuda", dtype=torch.bfloat16)
                base = default_config(tokens * top_k, n, k, experts, block, torch.device("cuda"))
                cands = [base] + [c for c in tune_candidates(block, tokens) if c != base]
                res = []
                eager: list[str] = []  # candidates timed without a graph (its capture failed), with why
                for cfg in cands:
                    try:
                        fns = [lambda rt=rt, cfg=cfg: lut_b_moe_gemm(q, None, w, outt, tw, *rt, tk, block_m=block,
                                                                      a_k_order="decoder", config=cfg, kernel_layout=True)
                               for rt in routings]
                        us, method = time_graph_rot(fns, calls=8 if tokens >= 2048 else 24, rounds=3)
                    except Exception as exc:  # noqa: BLE001
                        log(f"  tune {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
                        continue
                    res.append((us, cfg))
                    if not method.startswith("cuda-graph"):
                        eager.append(f"{cfg}: {method}")
                res.sort(key=lambda t: t[0])
                base_us = next((us for us, c in res if c == base), float("nan"))
                best_us, best = res[0]
                rec = {"shape": name, "gemm": which, "tokens": tokens, "route_block": block, "n": n, "k": k,
                       "default_us": base_us, "default": str(base), "best_us": best_us, "best": str(best),
                       "best_fields": {f: getattr(best, f) for f in ("block_m", "block_n", "split_k", "num_warps", "num_stages",
                                                                      "tile_loop", "prefetch", "swap_ab", "maxnreg")},
                       "best_TBps": te * per_expert / best_us / 1e6 if tokens <= 128 else None,
                       "top": [(round(us, 2), str(c)) for us, c in res[:5]]}
                if eager:
                    rec["not_in_a_graph"] = eager
                recs.append(rec)
                log(f"[tune] {name} {which} T={tokens} block={block}: default {base_us:.1f} us; best {best_us:.1f} us "
                    f"{best}" + (f" ({rec['best_TBps']:.2f} TB/s)" if rec["best_TBps"] else ""))
                (out_dir / "tune.json").write_text(json.dumps({"tune": recs, "table_suggestion": table_suggestion(recs)},
                                                              indent=1, default=str))
            w = None  # (not del: the timed lambdas name it) frees the weights
            torch.cuda.empty_cache()


def table_suggestion(recs: list[dict]) -> dict:
    """TUNED entries for lut_b_gemm.py: (route_block, n, k) -> best fields, where best beats the default by > 3%."""
    sug = {}
    for r in recs:
        if r["best_us"] < 0.97 * r["default_us"]:
            sug[str((r["route_block"], r["n"], r["k"]))] = r["best_fields"]
    return sug


# ----------------------------------------------------------------------------- output


def _us(run: dict, backend: str) -> str:
    """A backend's time at a run: "n/a" (not run), "error" (failed) or its us."""
    cell = run.get(backend)
    return "n/a" if cell is None else "error" if cell.get("error") else f"{cell['us']:.1f}"


def _rel(run: dict, backend: str) -> str:
    """A backend's rel-L2 against the reference at a run ("-": not checked), "!" where over the tolerance."""
    rec = run.get("correctness")
    if rec is None:
        return "-"
    if rec.get("error"):
        return "error"
    value = rec.get(f"{backend}_rel_l2", float("nan"))
    tol = rec.get("tolerance", CHECK_TOL)
    return sci(value, tol) + ("" if value <= tol else "!")


def _speedup(run: dict) -> float:
    return ratio(run.get("fastest_peer_us", float("nan")), run.get("packed", {}).get("us", float("nan")))


def _table_rows(results: dict) -> Iterator[tuple[str, str, list[str] | None, str | None, bool]]:
    """The main table's rows, for either format: ``(shape, T, cells, error, L2-resident)``; ``cells`` (packed,
    emulated, the two peers in us, packed touched TB/s, packed vs fastest peer, the two rel-L2) None where the
    shape's setup or the run failed, ``error`` then saying how."""
    for name, sh in results["shapes"].items():
        if sh.get("error"):
            yield name, "-", None, f"setup error: {sh['error']}", False
        for tokens, run in sh.get("runs", {}).items():
            if run.get("error") and "packed" not in run:
                yield name, str(int(tokens)), None, f"error: {run['error']}", False
                continue
            cells = [_us(run, "packed"), _us(run, "emulated"), _us(run, "bf16_grouped_mm"), _us(run, "bf16_triton"),
                     f"{run.get('packed_touched_TBps', float('nan')):.2f}", f"{_speedup(run):.2f}x",
                     _rel(run, "packed"), _rel(run, "emulated")]
            yield name, str(int(tokens)), cells, None, bool(run.get("l2_resident"))


def markdown(results: dict, targets: list[dict]) -> str:
    prov = results.get("provenance", {})
    lines = [f"# GPU experts benchmark ({results['device']})", "",
             f"{prov.get('utc', '?')}, commit {prov.get('git_head') or 'unknown'}"
             f"{' (dirty tree)' if prov.get('git_dirty') else ''}: `{' '.join(prov.get('argv', []))}`", "",
             f"torch {results['torch']}, triton {results['triton']}; HBM (2 GiB D2D copy, read+write): "
             f"{results['hbm'].get('copy_read_plus_write_TBps', float('nan')):.2f} TB/s; read-only sum: "
             f"{results['hbm'].get('sum_read_TBps', float('nan')):.2f} TB/s", "",
             "Median microseconds per whole experts forward (bf16, silu, uniform random routing); rel-L2 of packed "
             f"and emulated against the spec's reference where checked (tolerance {CHECK_TOL:g}; `!`: over it).", "",
             "| shape | T | packed | emulated | bf16 _grouped_mm | bf16 triton | packed touched TB/s | packed vs fastest peer "
             "| rel-L2 packed | rel-L2 emulated |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, tokens, cells, error, l2 in _table_rows(results):
        if cells is None:
            lines.append(f"| {name} | {tokens} | {error} | | | | | | | |")
            continue
        cells[4] += " (L2)" if l2 else ""
        lines.append(f"| {name} | {tokens} | " + " | ".join(cells) + " |")
    paths = [(name, tokens, run["packed_paths"]) for name, sh in results["shapes"].items()
             for tokens, run in sh.get("runs", {}).items() if "packed_paths" in run]
    if paths:
        lines += ["", "Packed prefill paths (us per forward): tiles decoded in every GEMM block vs dequantized once per "
                  "forward into a bf16 scratch, then the dense grouped GEMM (`LutBPackedExperts.dense_from_rows_per_expert`).",
                  "", "| shape | T | in-kernel decode | dense | default picks | rel-L2 dense vs in-kernel |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {n} | {t} | error: {p['error']} | | | |" if p.get("error") else
                  f"| {n} | {t} | {p['in_kernel']:.1f} | {p['dense']:.1f} | {p['default']} | {p['dense_vs_in_kernel_rel_l2']:.1e} |"
                  for n, t, p in paths]
    lines += ["", "| shape | backend | weight GB | bits/weight |", "| --- | --- | --- | --- |"]
    for name, sh in results["shapes"].items():
        for b, v in sh.get("memory_bytes", {}).items():
            lines.append(f"| {name} | {b} | {v / 1e9:.2f} | {sh['bits_per_weight'][b]:.3f} |")
    lines += ["", "| shape | correctness (gates its performance targets) |", "| --- | --- |"]
    for name, sh in results["shapes"].items():
        ok, why = correctness_gate(sh)
        verdict = "setup failed" if sh.get("error") else "ok" if ok else f"FAILED: {why}"
        lines.append(f"| {name} | {verdict} (checked at T {', '.join(str(t) for t in sh.get('correctness_tokens') or [])}) |")
    lines += ["", "| target | value | met |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['value']} | {'met' if t['met'] else 'NOT MET'} |" for t in targets]
    methods = {run[b]["method"] for sh in results["shapes"].values() for run in sh.get("runs", {}).values()
               for b in BACKENDS if b in run and not run[b]["method"].startswith(("cuda-graph", "failed"))}
    if methods:
        lines += ["", "Timing fallbacks: " + "; ".join(sorted(methods))]
    failed = failed_cells(results)
    if failed:
        lines += ["", f"Failed cells ({len(failed)}):", ""]
        lines += [f"- {_where(f)}: {f['error']}" for f in failed]
    return "\n".join(lines) + "\n"


def _where(f: dict) -> str:
    """"shape T=t cell" of a failed cell."""
    return " ".join(str(x) for x in (f["shape"], None if f["tokens"] is None else f"T={f['tokens']}", f["cell"]) if x is not None)


def breakdown_table(results: dict) -> str:
    lines = ["breakdown: us per stage (CUDA graph, rotated routings), GEMM TB/s on touched LUT-B bytes"]
    for key, r in results.get("routing_prefill", {}).items():
        lines.append(f"{key:22s} blk{r['route_block']:3d} moe_align_block_size torch={r['torch_us']:.1f} "
                     f"triton={r['triton_us']:.1f} equal={r['equal']}")
    for key, r in results.get("breakdown", {}).items():
        s = r["stages_us"]
        lines.append(f"{key:22s} blk{r['route_block']:3d} " + " ".join(f"{_stage_label(k)}={v:.1f}" for k, v in s.items())
                     + f" sum={r['sum_of_stages_us']:.1f} g1={r['gemm1_TBps']:.2f}TB/s g2={r['gemm2_TBps']:.2f}TB/s")
        best = {}
        for k, v in r["gemm_configs"].items():
            g = k.split(" ")[0]
            if g not in best or v["us"] < best[g][1]["us"]:
                best[g] = (k, v)
        for g, (k, v) in best.items():
            d = r["gemm_configs"].get(f"{g} default", {"us": float("nan")})
            o = r["gemm_configs"].get(f"{g} old per-group loop", {"us": float("nan")})
            lines.append(f"    {g}: default {d['us']:.1f} us, old loop {o['us']:.1f} us, best '{k}' {v['us']:.1f} us ({v['TBps']:.2f} TB/s)")
    return "\n".join(lines)


def tune_table(results: dict) -> str:
    lines = ["tune: best config per (shape, GEMM, T) [GEMM alone, CUDA graph]"]
    for r in results.get("tune", []):
        bw = f" {r['best_TBps']:.2f}TB/s" if r.get("best_TBps") else ""
        f = r["best_fields"]
        lines.append(f"{r['shape']:13s} {r['gemm']:3s} T={r['tokens']:5d} blk{r['route_block']:3d} default {r['default_us']:8.1f} best {r['best_us']:8.1f}{bw}"
                     f"  bm{f['block_m']} bn{f['block_n']} sk{f['split_k']} w{f['num_warps']} s{f['num_stages']}"
                     f"{' pf' if f['prefetch'] else ''}{'' if f['tile_loop'] else ' oldloop'}{'' if f['swap_ab'] else ' noswap'}")
    return "\n".join(lines)


def short_table(results: dict, targets: list[dict]) -> str:
    hbm = results["hbm"]
    lines = [f"HBM read (sum) {hbm.get('sum_read_TBps', float('nan')):.2f} TB/s, copy (read+write) "
             f"{hbm.get('copy_read_plus_write_TBps', float('nan')):.2f} TB/s;"
             f" small-T rows time {ROTATIONS} rotated routings per graph replay; L2 = rotation union < {2 * L2_BYTES / 1e6:.0f} MB;"
             f" rel-L2 vs the reference (tolerance {CHECK_TOL:g}, ! over it)",
             f"{'shape':15s} {'T':>5s} {'packed':>9s} {'emul':>9s} {'gmm':>9s} {'bf16tri':>9s} {'pk TB/s':>7s} {'pk/peer':>7s}"
             f" {'pk relL2':>10s} {'em relL2':>10s}"]
    for name, tokens, cells, error, l2 in _table_rows(results):
        if cells is None:
            lines.append(f"{name:15s} {tokens:>5s} {error}")
            continue
        lines.append(f"{name:15s} {tokens:>5s} " + " ".join(f"{c:>{w}s}" for c, w in zip(cells, (9, 9, 9, 9, 7, 7, 10, 10)))
                     + (" L2" if l2 else ""))
    for name, sh in results["shapes"].items():
        for tokens, run in sh.get("runs", {}).items():
            p = run.get("packed_paths")
            if p and not p.get("error"):
                lines.append(f"  packed paths {name} T={tokens}: in-kernel {p['in_kernel']:.1f} us, dense {p['dense']:.1f} us"
                             f" (default: {p['default']}; rel-L2 between them {p['dense_vs_in_kernel_rel_l2']:.1e})")
    for name, sh in results["shapes"].items():
        ok, why = correctness_gate(sh)
        if not ok and not sh.get("error"):
            lines.append(f"  correctness FAILED {name}: {why} (its performance targets count as not met)")
    failed = failed_cells(results)
    lines += [f"  FAILED cell {_where(f)}: {f['error']}" for f in failed]
    lines += _uncaptured_line(results)
    met = sum(t["met"] for t in targets)
    lines.append(f"targets met: {met}/{len(targets)}" + (f"; {len(failed)} failed cell(s)" if failed else ""))
    lines += [f"  NOT MET: {t['target']} ({t['value']})" for t in targets if not t["met"]]
    return "\n".join(lines)


def _uncaptured_cells(results: dict) -> list[str]:
    """Every timing whose CUDA graph capture failed (a capture-safe op that stopped being one), from the timing
    methods ``results`` records (a ``method`` or ``*_method`` key, a breakdown's ``stages_method``, a tune record's
    ``not_in_a_graph``; an ``error`` that mentions a capture is not one): "shape T=t backend" for a cell of the main
    table, "tune shape gemm T=t config" for a tune candidate, else the path of keys to the method (a packed-path
    timing, a breakdown stage or GEMM config, an A/B)."""
    found: list[str] = []

    def walk(node: object, path: tuple[str, ...]) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, (*path, str(i)))
        elif isinstance(node, str) and "capture failed" in node and _is_timing_method(path):
            if len(path) == 6 and path[0] == "shapes" and path[2] == "runs" and path[4] in BACKENDS:
                found.append(f"{path[1]} T={path[3]} {path[4]}")
            elif path[0] == "tune" and len(path) == 4:
                rec = results["tune"][int(path[1])]
                found.append(f"tune {rec.get('shape')} {rec.get('gemm')} T={rec.get('tokens')} {node.split(': ', 1)[0]}")
            else:
                found.append("/".join(path))

    walk(results, ())
    return found


def _is_timing_method(path: tuple[str, ...]) -> bool:
    """Whether the string at ``path`` of the results is a timing method (see :func:`_uncaptured_cells`)."""
    return (path[-1] == "method" or path[-1].endswith("_method")
            or (len(path) >= 2 and path[-2] == "stages_method") or (len(path) >= 2 and path[-2] == "not_in_a_graph"))


def _uncaptured_line(results: dict) -> list[str]:
    """The short table's line naming every timing that is not a graph replay because its capture failed (none: [])."""
    uncaptured = _uncaptured_cells(results)
    return [f"  NOT IN A CUDA GRAPH (capture failed; timed eagerly by do_bench, launches included): {', '.join(uncaptured)}"
            ] if uncaptured else []


def run_failed(results: dict) -> bool:
    """Whether the run's exit status says failure: a cell raised or a shape's correctness check failed."""
    return bool(failed_cells(results)) or any(not correctness_gate(sh)[0] for sh in results["shapes"].values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for results.json and results.md")
    parser.add_argument("--quick", action="store_true", help=f"T in {QUICK_TOKENS} only")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="*", type=int, default=None)
    parser.add_argument("--tune", action="store_true", help="also sweep lut_b_moe_gemm configs (adds ~2-4 minutes)")
    parser.add_argument("--tune-only", action="store_true", help="only the tune sweep (writes tune.json)")
    parser.add_argument("--tune-budget", type=float, default=1e9, help="seconds after which the sweep stops starting shapes")
    parser.add_argument("--breakdown", action="store_true", help="only the per-stage breakdown of the packed forward (T 1/8/32)")
    parser.add_argument("--tune-grouped", action="store_true", help="only the dense grouped GEMM's tile sweep at large T")
    parser.add_argument("--breakdown-shapes", nargs="*", default=["mixtral-8x7b", "deepseek-v3"], choices=list(SHAPES))
    parser.add_argument("--breakdown-configs", nargs="*", default=[],
                        help="time only the GEMM configs whose name contains one of these (and the default)")
    parser.add_argument("--ab", nargs="*", default=[], choices=list(AB_SWITCHES),
                        help="also time packed with each of these switches on and off (interleaved pairs): pdl "
                             "(programmatic dependent launch), unroll (TILE_UNROLL 2 vs 1), stream_k (STREAM_K_PER_SM 4 vs 0), "
                             "qdq_grid (the MXFP8 kernels' QDQ_PROGRAMS_PER_SM 8 vs 0), stream_k_tiles (stream-K for programs of up to "
                             "31 K tiles, STREAM_K_BELOW_TILES 32 vs 16)")
    args = parser.parse_args()
    global AB
    AB = tuple(args.ab)
    if not torch.cuda.is_available():
        print("bench/kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    tokens = tuple(args.tokens) if args.tokens else (QUICK_TOKENS if args.quick else TOKENS)
    results: dict = {
        "provenance": provenance(), "settings": settings_of(args, tokens),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
        "python": platform.python_version(), "capability": list(torch.cuda.get_device_capability()),
        "grouped_mm": Bf16GroupedMm.available(), "shapes": {},
    }
    hbm, error = guarded("HBM bandwidth", hbm_bandwidth)
    nan = float("nan")
    results["hbm"] = hbm if error is None else {"copy_read_plus_write_TBps": nan, "copy_read_TBps": nan, "sum_read_TBps": nan,
                                                "error": error}
    log(f"HBM: {results['hbm']}")
    if args.tune_grouped:
        tune_grouped(results, args.tune_budget)
        (args.out / "tune_grouped.json").write_text(json.dumps(results, indent=1, default=str))
        print(tune_grouped_table(results))
        return 0
    if args.breakdown or args.tune_only:
        if args.breakdown:
            breakdown(results, args.breakdown_shapes, tuple(args.breakdown_configs))
        else:
            tune(results, args.quick, args.out, args.tune_budget)
        fname = "breakdown.json" if args.breakdown else "tune_results.json"
        (args.out / fname).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwrote {args.out}/{fname} in {time.time() - t_start:.0f} s")
        if args.breakdown:
            print(breakdown_table(results))
        else:
            print(tune_table(results))
        for line in _uncaptured_line(results):
            print(line)
        return 0
    for name in args.shapes:
        _, error = guarded(f"[{name}]", lambda: bench_shape(name, tokens, results))
        if error is not None:  # bench_shape records its cells' errors; this is one outside them
            results["shapes"].setdefault(name, {"runs": {}})["error"] = error
        # Partial results after each shape, so a run cut short by a time limit keeps what it measured.
        (args.out / "results.partial.json").write_text(json.dumps(results, indent=1, default=str))
    if args.tune:
        _, error = guarded("tune", lambda: tune(results, args.quick, args.out, args.tune_budget))
        if error is not None:
            results["tune_error"] = error
    targets = evaluate_targets(results)
    results["targets"] = targets
    results["failed_cells"] = failed_cells(results)
    results["wall_s"] = time.time() - t_start
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (args.out / "results.md").write_text(markdown(results, targets))
    print(f"\nwrote {args.out}/results.json and results.md in {results['wall_s']:.0f} s\n")
    print(short_table(results, targets))
    for switch in AB:
        print("\n" + ab_table(results, switch))
    if run_failed(results):
        print("\nexit 1: a cell failed or a correctness check failed (see above)", file=sys.stderr)
        return 1
    return 0


def settings_of(args: argparse.Namespace, tokens: tuple[int, ...]) -> dict:
    """The run's settings for the results: every option (paths as text), ``tokens`` as resolved, the check's limits."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings.update(tokens_arg=args.tokens, tokens=list(tokens), correctness_tolerance=CHECK_TOL,
                    correctness_rows_at_most=CHECK_TOKENS)
    return settings


if __name__ == "__main__":
    sys.exit(main())
