#!/usr/bin/env python3
"""Time the kernels of two source trees against each other on the GPU: ``bench/kernels.py`` run
alternately with ``kernels/`` (new) and another copy of it (old) first on ``PYTHONPATH``.

A change that cannot be switched at run time (a kernel rewritten, a launch removed) is A/B'd this
way: interleaved whole runs (new, old, new, old, ...) in one device call, so clock or machine drift
cannot pose as a gain, then one table of the packed forward (and the fastest bf16 peer) per shape
and T. The old tree is made on the development machine and carried to the device (git is not
reliable there)::

    rm -rf ab_old && mkdir ab_old && git archive <rev> kernels | tar -x -C ab_old   # ab_old/ is git-ignored locally
    # device call, carry [".whl", "ab_old"]:
    python3 bench/ab_trees.py --old ab_old/kernels --out $OUT --pairs 2 -- --tokens 1 8 32

Every run's ``results.json`` lands in ``OUT/new1``, ``OUT/old1``, ...; ``OUT/ab_trees.json`` holds
the table's numbers. A run that fails or overruns ``--budget-s`` ends the series (pairs already
complete are reported).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_once(tree: Path, out: Path, bench_args: list[str], timeout_s: float) -> dict | None:
    """One ``bench/kernels.py`` run with ``tree`` (a ``kernels/`` directory) first on the path; its results or None."""
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != (ROOT / "kernels").resolve()]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT / "client"), str(ROOT / "server"), *rest])
    log = out.with_suffix(".log")
    with log.open("w") as f:
        try:
            rc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--out", str(out), *bench_args],
                                env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            print(f"[ab_trees] {out.name}: over {timeout_s:.0f} s, stopped (log: {log})")
            return None
    if rc != 0 or not (out / "results.json").exists():
        print(f"[ab_trees] {out.name}: exit {rc} (log: {log})")
        return None
    return json.loads((out / "results.json").read_text())


def packed_rows(results: dict) -> dict[tuple[str, int], tuple[float, float]]:
    """``(shape, T) -> (packed us, fastest bf16 peer us)`` of one run."""
    rows = {}
    for shape, sres in results["shapes"].items():
        for t, run in sres["runs"].items():
            if "packed" in run:
                rows[(shape, int(t))] = (run["packed"]["us"], run.get("fastest_peer_us", float("nan")))
    return rows


def run_ab(tag: str, trees: dict[str, Any], run_once: Callable[[Any, Path, list[str], float], dict | None],
           table: Callable[[list[dict], list[dict]], tuple[str, list[dict]]], args: argparse.Namespace, title: str) -> int:
    """The interleaved series: ``run_once(trees[name], args.out / f"{name}{i}", args.bench_args, seconds_left)`` for
    name = new then old, ``args.pairs`` times while ``args.budget_s`` lasts (a run that returns None ends it); then
    ``table`` of the complete pairs, printed under ``title`` and saved (with its numbers) as ``OUT/<tag>.json``.
    ``trees[name]`` is whatever ``run_once`` takes (a path; ``ab_serving.py``: a tree and environment), shown with ``str``.

    A pair starts only if the budget left holds 1.1 times the longest pair so far: a pair cut short by the budget
    counts for nothing and would spend the device's time on a run the table leaves out."""
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    new: list[dict] = []
    old: list[dict] = []
    longest_pair = 0.0
    for i in range(1, args.pairs + 1):
        left = args.budget_s - (time.monotonic() - start)
        if left < 1.1 * longest_pair:
            print(f"[{tag}] pair {i} not started: {left:.0f} s of budget left, a pair took up to {longest_pair:.0f} s", flush=True)
            break
        pair_start = time.monotonic()
        pair = []
        for name in ("new", "old"):
            left = args.budget_s - (time.monotonic() - start)
            res = run_once(trees[name], args.out / f"{name}{i}", args.bench_args, left) if left > 10 else None
            print(f"[{tag}] {name}{i}: {'done' if res else 'no result'} at {time.monotonic() - start:.0f} s", flush=True)
            if res is None:
                break
            pair.append(res)
        if len(pair) < 2:
            break
        longest_pair = max(longest_pair, time.monotonic() - pair_start)
        new.append(pair[0])
        old.append(pair[1])
    if not new:
        print(f"[{tag}] no complete pair")
        return 1
    text, data = table(new, old)
    (args.out / f"{tag}.json").write_text(json.dumps({"old_tree": str(trees["old"]), "bench_args": args.bench_args,
                                                      "pairs": len(new), "rows": data}, indent=1))
    print(f"\n{tag}: {title}, {len(new)} interleaved pair(s), new = {trees['new']}, old = {trees['old']}\n")
    print(text)
    return 0


def table(new: list[dict], old: list[dict]) -> tuple[str, list[dict]]:
    """Markdown table of the packed forward per (shape, T): each run's us, the difference of means, the ratio to the peer."""
    new_rows, old_rows = [packed_rows(r) for r in new], [packed_rows(r) for r in old]
    keys = sorted(set.intersection(*(set(r) for r in new_rows + old_rows)))
    lines = ["| shape | T | new us (runs) | old us (runs) | new - old (means) | packed / fastest peer, new | old |",
             "|---|---|---|---|---|---|---|"]
    data = []
    for key in keys:
        n = [r[key] for r in new_rows]
        o = [r[key] for r in old_rows]
        diff = statistics.mean(x for x, _ in n) - statistics.mean(x for x, _ in o)
        fmt = " / ".join
        lines.append(f"| {key[0]} | {key[1]} | {fmt(f'{x:.1f}' for x, _ in n)} | {fmt(f'{x:.1f}' for x, _ in o)} | {diff:+.1f} | "
                     f"{fmt(f'{p / x:.2f}x' for x, p in n)} | {fmt(f'{p / x:.2f}x' for x, p in o)} |")
        data.append({"shape": key[0], "tokens": key[1], "new_us": [x for x, _ in n], "old_us": [x for x, _ in o],
                     "new_peer_us": [p for _, p in n], "old_peer_us": [p for _, p in o], "new_minus_old_us": diff})
    return "\n".join(lines), data


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", type=Path, required=True, help="the other tree's kernels/ directory (e.g. ab_old/kernels)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pairs", type=int, default=2, help="new/old pairs, interleaved")
    p.add_argument("--budget-s", type=float, default=480.0, help="no run starts after this many seconds; a run is stopped there")
    p.add_argument("bench_args", nargs="*", help="arguments for bench/kernels.py, after --")
    args = p.parse_args()
    if not (args.old / "lutb_kernels").is_dir():
        p.error(f"{args.old} holds no lutb_kernels package")
    return run_ab("ab_trees", {"new": ROOT / "kernels", "old": args.old}, run_once, table, args,
                  "packed forward us (CUDA graph)")


if __name__ == "__main__":
    raise SystemExit(main())
