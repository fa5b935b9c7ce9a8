"""What checking a checkpoint's files against its ``SHA256SUMS`` costs (``Checkpoint.verify_files``), in GB/s.

    python bench/checksum_cost.py [--files N] [--experts E] [--threads 1,2,8] [--repeats R] [--dir DIR]

Writes a checkpoint of N layer files (qwen3-30b-a3b's H = 2048 and I = 768, E experts each: 123 MB a file at the
default 64) and its ``SHA256SUMS`` into DIR (a temporary folder by default), then times ``verify_files`` with each
thread count, the files read from the page cache after a first untimed pass: what it costs the CPU (a cold read
from disk or network storage is bounded by that storage instead). The tiles are random bytes: opening a checkpoint
reads only its headers, and the hashing does not look at what the bytes mean. Prints GB/s for each thread count and
repeat.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lutb_kernels.checkpoint import Checkpoint, CheckpointConfig, write_checksums

CONFIG = CheckpointConfig(hidden_size=2048, intermediate_size=768, num_experts=128, activation="silu", dtype="bfloat16")


def write_files(folder: Path, count: int, experts: int) -> Checkpoint:
    """``count`` layers of ``experts`` experts of random tile bytes, with ``SHA256SUMS``; opened."""
    gen = torch.Generator().manual_seed(0)
    files = []
    for layer in range(count):
        tensors = {
            f"layers.{layer}.w13": torch.randint(0, 256, (experts, *CONFIG.w13_tiles_shape(1)[1:], 6672), generator=gen,
                                                 dtype=torch.uint8),
            f"layers.{layer}.w2": torch.randint(0, 256, (experts, *CONFIG.w2_tiles_shape(1)[1:], 6672), generator=gen,
                                                dtype=torch.uint8),
            f"layers.{layer}.expert_ids": torch.arange(experts, dtype=torch.int32),
        }
        files.append(folder / f"layer-{layer:05d}.safetensors")
        save_file(tensors, str(files[-1]), metadata=CONFIG.to_metadata())
    write_checksums(folder, files)
    return Checkpoint(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--experts", type=int, default=64, help="experts per layer file (at most 128)")
    parser.add_argument("--threads", default="1,2,8", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the files (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        ckpt = write_files(Path(tmp), args.files, args.experts)
        total = sum(f.stat().st_size for f in ckpt.files)
        ckpt.verify_files(threads=1)  # into the page cache
        print(f"{args.files} files, {total / 1e9:.2f} GB, {os.cpu_count()} CPUs")
        for threads in (int(t) for t in args.threads.split(",")):
            for _ in range(args.repeats):
                start = time.perf_counter()
                assert ckpt.verify_files(threads=threads)
                seconds = time.perf_counter() - start
                print(f"threads {threads}: {total / seconds / 1e9:.2f} GB/s ({seconds:.2f} s)")


if __name__ == "__main__":
    main()
