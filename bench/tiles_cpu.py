"""Time the plain-PyTorch LUT-B tile codec on the CPU (issue 2: dequantize 14336 x 4096 in < 2 s).

    python bench/tiles_cpu.py [--threads 2] [--repeats 5] [--out bench/results/FILE.md]

Prints the median of each operation; with --out, writes a results file with the
date, machine, commit and command.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path

import torch

from lutb_kernels.tiles import pack_tiles, tiles_to_dense, unpack_tiles, validate_tiles


def _median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=14336)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nt, kt = args.n // 128, args.k // 128
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 8, (nt, kt, 128, 128), generator=gen, dtype=torch.uint8)
    scales = torch.randint(110, 130, (nt, kt, 128, 4), generator=gen, dtype=torch.uint8)
    lut = torch.randn(nt, kt, 8, generator=gen).bfloat16()
    tiles = pack_tiles(codes, scales, lut)

    rows = [
        ("pack", _median_seconds(lambda: pack_tiles(codes, scales, lut), args.repeats)),
        ("unpack", _median_seconds(lambda: unpack_tiles(tiles), args.repeats)),
        ("dequantize -> float32", _median_seconds(lambda: tiles_to_dense(tiles), args.repeats)),
        ("dequantize -> bfloat16", _median_seconds(lambda: tiles_to_dense(tiles, torch.bfloat16), args.repeats)),
        ("validate", _median_seconds(lambda: validate_tiles(tiles, "bench"), args.repeats)),
    ]
    table = [f"| operation ({args.n} x {args.k}, {args.threads} threads) | median s |", "| --- | --- |"]
    table += [f"| {name} | {sec:.3f} |" for name, sec in rows]
    text = "\n".join(table)
    if args.out:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        args.out.write_text(
            f"# LUT-B tile codec on the CPU\n\n- date: {date.today()}\n- machine: {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} torch threads, torch {torch.__version__}\n- commit: {commit}\n"
            f"- command: `python {' '.join(sys.argv)}`\n\n{text}\n"
        )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
