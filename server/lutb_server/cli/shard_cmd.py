"""``lutb shard``: split a checkpoint's experts into expert-parallel shard checkpoints."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "shard",
        help="split a checkpoint's experts into N shard checkpoints",
        description=(
            "Write N shard checkpoints OUT/shard-0 .. OUT/shard-{N-1}, each holding a subset of every "
            "layer's experts (spec section 5), and OUT/shards.json describing the placement. "
            "Serve each with `lutb serve --checkpoint OUT/shard-i`. Without --replicas every expert is on exactly "
            "one shard, so the shards' outputs for a call add up to the whole layer; with --replicas R a replicated "
            "expert is on two shards, so each route must go to exactly one of its holders (as ShardedExpertClient does, "
            "from the experts each shard's ModelInfo lists; shards.json records them too): sending every route to "
            "every shard counts a replicated expert twice."
        ),
    )
    p.add_argument("checkpoint", type=Path, help="the LUT-B checkpoint directory to split")
    p.add_argument("--out", type=Path, required=True, help="output directory (gets shard-0, shard-1, ... and shards.json)")
    p.add_argument("--shards", type=int, required=True, help="number of shards N")
    p.add_argument(
        "--placement", choices=("contiguous", "balanced"), default="contiguous",
        help="contiguous: runs of ascending expert ids; balanced: spread hot experts using --load (default: contiguous)",
    )
    p.add_argument("--load", type=Path, help="load file from `lutb load` (tokens per layer and expert); needed by --placement balanced")
    p.add_argument("--replicas", type=int, default=0, help="per layer, give the R hottest experts a copy on a second shard (balanced only)")
    p.add_argument("--overwrite", action="store_true", help="replace shard checkpoints already in OUT")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.errors import LutBFormatError
    from lutb_kernels.sharding import plan_placement, read_load_file, write_shards
    from lutb_server.cli.checkpoint_cmds import hash_bar

    try:
        ckpt = Checkpoint(args.checkpoint)
        load = read_load_file(args.load) if args.load else None
        plan = plan_placement(ckpt, args.shards, placement=args.placement, replicas=args.replicas, load=load)
        dirs = write_shards(ckpt, args.out, plan, overwrite=args.overwrite, progress=lambda it: tqdm(it, desc="layers", unit="layer"),
                            hash_progress=hash_bar)
    except (LutBFormatError, ValueError, FileExistsError, OSError) as exc:
        print(f"lutb shard: error: {exc}", file=sys.stderr)
        return 1
    for s, d in enumerate(dirs):
        counts = sorted({len(plan[layer][s]) for layer in plan})
        print(f"{d}: {'/'.join(map(str, counts))} experts per layer")
    return 0
