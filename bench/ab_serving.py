#!/usr/bin/env python3
"""Serving A/B of two source trees: ``bench/serving.py`` of this tree (new) and of another whole
tree (old), run alternately on one machine, then one table of latency and tokens/s per cell.

For a change to the server itself (scheduler, worker, CUDA graphs) that cannot be switched at run
time. Each tree runs its own ``bench/serving.py`` from its own directory with its own packages first
on ``PYTHONPATH``; runs are interleaved (new, old, new, old, ...) so that clock or machine drift
cannot pose as a gain; the table gives each pair's tokens/s ratio (new run i over old run i, back to
back), the figure to read when machines or runs drift. Only the server's own figures are compared
(p50, tokens/s, the batch formed, the worker's compute, its CPU per request and its compute thread's busy
share): the two trees' benches may measure their echo floor differently.
The old tree is made on the development machine and carried to the device::

    rm -rf ab_old && mkdir ab_old && git archive <rev> | tar -x -C ab_old   # ab_old/ is git-ignored locally
    # device call, carry [".whl", "ab_old"]:
    python3 bench/ab_serving.py --old ab_old --out $OUT/ab --pairs 2 -- --work-dir /tmp/ckpt --shapes qwen3-30b-a3b \\
        --wires bf16 --concurrency 1,8,64 --tokens 16 --duration-s 1.5 --warmup-s 0.3 --inproc-s 0.3

A setting's A/B in one tree (a server setting read from ``LUTB_*``, which the bench does not set itself)::

    python3 bench/ab_serving.py --old . --new-env LUTB_COMPUTE_CPU=auto --out $OUT/ab --pairs 2 -- ...

``--new-env`` / ``--old-env KEY=VALUE`` (repeatable) add environment variables to one side's runs; a tree
whose settings lack the variable ignores it, so the same flag also A/Bs a setting against a tree without it.

Give both trees one ``--work-dir`` so that the checkpoint is made once. Every run's ``serving.json``
lands in ``OUT/new1``, ``OUT/old1``, ...; ``OUT/ab_serving.json`` holds the table's numbers. A run
that fails or overruns ``--budget-s`` ends the series (pairs already complete are reported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_trees import run_ab  # noqa: E402 - the sibling script's interleaved new/old series

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernels", "client", "server")

Cell = tuple[str, str, str, int, int]  # shape, wire, api, concurrency, tokens


class Side(NamedTuple):
    """One side of the A/B: a whole tree, and environment variables its runs get on top of this process's."""

    tree: Path
    env: dict[str, str]

    def __str__(self) -> str:
        return " ".join([str(self.tree), *(f"{k}={v}" for k, v in self.env.items())])


def run_once(side: Side, out: Path, bench_args: list[str], timeout_s: float) -> dict | None:
    """``side.tree``'s ``bench/serving.py --out out *bench_args``, run from that tree with its packages first and
    ``side.env`` in its environment; its report or None."""
    tree = side.tree
    env = {**os.environ, **side.env}
    ours = {(ROOT / p).resolve() for p in PACKAGES}
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() not in ours and p not in PACKAGES]
    env["PYTHONPATH"] = os.pathsep.join([str(tree / p) for p in PACKAGES] + rest)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ab_run.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, str(tree / "bench" / "serving.py"), "--out", str(out.resolve()), *bench_args],
                                cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"[ab_serving] {out.name}: over {timeout_s:.0f} s, stopped (log: {log})")
            return None
    report = out / "serving.json"
    if rc != 0 or not report.exists():
        print(f"[ab_serving] {out.name}: exit {rc} (log: {log})")
        return None
    return json.loads(report.read_text())


def cells(report: dict) -> dict[Cell, dict]:
    """The server's figures of each cell of one run, with ``ratio``: its tokens/s over the in-process tokens/s at the
    batch it formed (issue 5's C=64 figure), ``cpu_us_per_request``: the server's CPU (all its processes) per answered
    request, ``compute_busy``: the CPU over wall time of the thread that runs the experts calls, and ``in_calls``: the
    compute process's share of its loop's time in experts calls (``server.compute_loop``) (None where the report lacks
    the figure: older trees, a thread worker)."""
    out = {}
    for r in report["rows"]:
        inproc = (r.get("inproc") or {}).get("tokens_per_s")
        ratio = r["server"]["tokens_per_s"] / inproc if inproc else None
        cpu = r["server"].get("cpu") or {}
        compute_thread = (report.get("servers", {}).get(r["shape"]) or {}).get("compute_thread")
        out[(r["shape"], r["wire"], r["api"], r["concurrency"], r["tokens"])] = {
            **r["server"], "ratio": ratio, "cpu_us_per_request": cpu.get("cpu_us_per_request"),
            "compute_busy": (cpu.get("thread_busy") or {}).get(compute_thread) if compute_thread else None,
            "in_calls": ((r["server"].get("compute_loop") or {}).get("shares") or {}).get("calls")}
    return out


def table(new: list[dict], old: list[dict]) -> tuple[str, list[dict]]:
    """Markdown table per cell: each run's p50 and tokens/s, the means' ratios, tokens/s new / old of each pair
    (new run i against old run i: the two ran back to back, so machine drift between pairs cancels), batches,
    compute, the hand-off's wait (``timing.wait_us``), the ratio to the in-process rate, the server's CPU per request,
    how busy its compute thread was and the compute process's share of time in calls (medians; the JSON keeps each
    run's)."""
    new_cells, old_cells = [cells(r) for r in new], [cells(r) for r in old]
    keys = sorted(set.intersection(*(set(c) for c in new_cells + old_cells)))
    lines = ["| shape | wire | api | C | T | p50 us new (runs) | old (runs) | new / old | tok/s new (runs) | old (runs) | new / old "
             "| tok/s new / old by pair | batch new / old | compute us new / old | wait us new / old | ratio new / old "
             "| CPU us/req new / old | compute busy new / old | in calls new / old |",
             "|" + "|".join("---" for _ in range(19)) + "|"]
    data = []

    def runs(values: list[float]) -> str:
        return " / ".join(f"{v:.0f}" for v in values)

    def fig(values: list[float | None], digits: int = 0) -> str:
        known = [v for v in values if v is not None]
        return f"{statistics.median(known):.{digits}f}" if known else "-"

    for key in keys:
        n, o = [c[key] for c in new_cells], [c[key] for c in old_cells]
        p50 = ([s["p50_us"] for s in n], [s["p50_us"] for s in o])
        tps = ([s["tokens_per_s"] for s in n], [s["tokens_per_s"] for s in o])
        p50_ratio = statistics.mean(p50[0]) / statistics.mean(p50[1])
        tps_ratio = statistics.mean(tps[0]) / statistics.mean(tps[1])
        by_pair = [a / b for a, b in zip(*tps)]
        batch = (fig([s.get("batch_tokens_p50") for s in n]), fig([s.get("batch_tokens_p50") for s in o]))
        compute = (fig([s.get("server_compute_us_p50") for s in n]), fig([s.get("server_compute_us_p50") for s in o]))
        wait = (fig([s.get("server_wait_us_p50") for s in n]), fig([s.get("server_wait_us_p50") for s in o]))
        ratio = (fig([s["ratio"] for s in n], 2), fig([s["ratio"] for s in o], 2))
        cpu = (fig([s.get("cpu_us_per_request") for s in n]), fig([s.get("cpu_us_per_request") for s in o]))
        busy = (fig([s.get("compute_busy") for s in n], 2), fig([s.get("compute_busy") for s in o], 2))
        in_calls = (fig([s.get("in_calls") for s in n], 2), fig([s.get("in_calls") for s in o], 2))
        lines.append(f"| {' | '.join(str(k) for k in key)} | {runs(p50[0])} | {runs(p50[1])} | {p50_ratio:.2f} "
                     f"| {runs(tps[0])} | {runs(tps[1])} | {tps_ratio:.2f} | {' / '.join(f'{r:.2f}' for r in by_pair)} "
                     f"| {batch[0]} / {batch[1]} | {compute[0]} / {compute[1]} | {wait[0]} / {wait[1]} | {ratio[0]} / {ratio[1]} "
                     f"| {cpu[0]} / {cpu[1]} | {busy[0]} / {busy[1]} | {in_calls[0]} / {in_calls[1]} |")
        data.append({"cell": dict(zip(("shape", "wire", "api", "concurrency", "tokens"), key)),
                     "new_p50_us": p50[0], "old_p50_us": p50[1], "new_tokens_per_s": tps[0], "old_tokens_per_s": tps[1],
                     "p50_new_over_old": p50_ratio, "tokens_per_s_new_over_old": tps_ratio,
                     "tokens_per_s_new_over_old_by_pair": by_pair,
                     "new_batch_tokens_p50": [s.get("batch_tokens_p50") for s in n],
                     "old_batch_tokens_p50": [s.get("batch_tokens_p50") for s in o],
                     "new_ratio_to_in_process": [s["ratio"] for s in n], "old_ratio_to_in_process": [s["ratio"] for s in o],
                     **{f"{side}_{name}": [s.get(field) for s in runs_of] for side, runs_of in (("new", n), ("old", o))
                        for name, field in (("compute_us_p50", "server_compute_us_p50"), ("wait_us_p50", "server_wait_us_p50"),
                                            ("cpu_us_per_request", "cpu_us_per_request"), ("compute_busy", "compute_busy"),
                                            ("in_calls", "in_calls"))}})
    return "\n".join(lines), data


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="the other tree's root (holding bench/, kernels/, client/, server/)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pairs", type=int, default=2, help="new/old pairs, interleaved")
    p.add_argument("--budget-s", type=float, default=540.0, help="no run starts after this many seconds; a run is stopped there")
    p.add_argument("--new-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable of the new side's runs (repeatable)")
    p.add_argument("--old-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable of the old side's runs (repeatable)")
    p.add_argument("bench_args", nargs="*", help="arguments for both trees' bench/serving.py, after --")
    args = p.parse_args(argv)
    envs = {}
    for side in ("new", "old"):
        pairs = getattr(args, f"{side}_env")
        bad = [item for item in pairs if "=" not in item or not item.split("=", 1)[0]]
        if bad:
            p.error(f"--{side}-env takes KEY=VALUE, got {', '.join(bad)}")
        envs[side] = dict(item.split("=", 1) for item in pairs)
    old_tree = args.old.resolve()
    missing = [d for d in ("bench/serving.py", *PACKAGES) if not (old_tree / d).exists()]
    if missing:
        p.error(f"{args.old} is not a whole tree: no {', '.join(missing)}")
    if args.pairs < 1:
        p.error("--pairs must be >= 1")
    if old_tree == ROOT and envs["new"] == envs["old"]:
        p.error("--old is this tree: give the sides different --new-env / --old-env")
    sides = {"new": Side(ROOT, envs["new"]), "old": Side(old_tree, envs["old"])}
    return run_ab("ab_serving", sides, run_once, table, args, "server figures only")


if __name__ == "__main__":
    raise SystemExit(main())
