"""Split a checkpoint's experts over expert-parallel shards (spec section 5: a shard is a
checkpoint whose ``expert_ids`` are a subset).

Placement is decided per layer:

- ``contiguous``: shard ``s`` holds the ``s``-th run of ascending expert ids (sizes differ by
  at most one).
- ``balanced``: uses measured load (tokens per expert, see :func:`read_load_file`) to spread
  hot experts: experts are taken hottest first and each goes to the least-loaded shard that
  still has room, so shards hold equal expert counts (equal memory) and near-equal load.
  With ``replicas = R`` the ``R`` hottest experts of each layer get a second copy on another
  shard; each copy is counted with half the load, since clients spread an expert's tokens
  over its replicas.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any, Literal

import torch

from lutb_kernels.checkpoint import Checkpoint, CheckpointWriter, LayerWeights, StagedDirectory, is_checkpoint_file

Placement = Literal["contiguous", "balanced"]
LOAD_FORMAT = "lutb-load-v1"
SHARD_MANIFEST = "shards.json"


def shard_dir_name(shard: int) -> str:
    """Directory of shard ``shard`` under the output directory (``shard-0``, ``shard-1``, ...)."""
    return f"shard-{shard}"


def contiguous_placement(expert_ids: Sequence[int], shards: int) -> list[list[int]]:
    """Split ascending ``expert_ids`` into ``shards`` contiguous runs whose sizes differ by at most one."""
    if shards < 1 or shards > len(expert_ids):
        raise ValueError(f"cannot split {len(expert_ids)} experts into {shards} shards (each shard needs at least one)")
    base, extra = divmod(len(expert_ids), shards)
    out, start = [], 0
    for s in range(shards):
        size = base + (1 if s < extra else 0)
        out.append(list(expert_ids[start : start + size]))
        start += size
    return out


def balanced_placement(load: Mapping[int, float], shards: int, replicas: int = 0) -> list[list[int]]:
    """Place experts so shards carry near-equal load and equal expert counts.

    Args:
        load: tokens (or any load measure >= 0) per global expert id to place.
        shards: number of shards.
        replicas: how many of the hottest experts get a second copy on another shard.

    Returns:
        Per shard, its expert ids ascending.
    """
    experts = sorted(load, key=lambda e: (-load[e], e))
    if shards < 1 or shards > len(experts):
        raise ValueError(f"cannot split {len(experts)} experts into {shards} shards (each shard needs at least one)")
    if not 0 <= replicas <= len(experts):
        raise ValueError(f"replicas must lie in [0, {len(experts)}], got {replicas}")
    if replicas and shards < 2:
        raise ValueError("replicas need at least 2 shards (a copy must live on another shard)")
    copies: list[tuple[float, int]] = []
    for rank, e in enumerate(experts):
        n = 2 if rank < replicas else 1
        copies += [(load[e] / n, e)] * n
    copies.sort(key=lambda c: (-c[0], c[1]))
    # Equal counts: every shard ends with `base` copies, `extra` of them with one more. (A cap of
    # ceil(copies / shards) alone let a shard that took a hot expert stay short: 1/3/3 for 7 over 3.)
    base, extra = divmod(len(copies), shards)
    held: list[set[int]] = [set() for _ in range(shards)]
    total = [0.0] * shards
    for weight, e in copies:
        over = sum(len(h) > base for h in held)
        candidates = [s for s in range(shards) if e not in held[s]
                      and (len(held[s]) < base or (len(held[s]) == base and over < extra))]
        if not candidates:  # only when the room left is on shards holding e already; relax the counts
            candidates = [s for s in range(shards) if e not in held[s]]
        s = min(candidates, key=lambda s: (total[s], len(held[s]), s))
        held[s].add(e)
        total[s] += weight
    # The relaxed step above can leave counts apart by 2 or more (many replicas, one hot expert). Even them out: move
    # the lightest copy the smaller shard does not hold yet from the fullest shard (one exists: it holds more).
    share = {e: weight for weight, e in copies}
    while True:
        big = max(range(shards), key=lambda s: (len(held[s]), s))
        small = min(range(shards), key=lambda s: (len(held[s]), s))
        if len(held[big]) - len(held[small]) <= 1:
            break
        e = min(held[big] - held[small], key=lambda e: (share[e], e))
        held[big].remove(e)
        held[small].add(e)
        total[big] -= share[e]
        total[small] += share[e]
    return [sorted(h) for h in held]


def read_load_file(path: str | Path) -> dict[int, list[float]]:
    """Read a load file written by ``lutb load``: tokens per expert, per layer.

    Format (JSON)::

        {"format": "lutb-load-v1", "num_experts": E, "layers": {"<layer>": [tokens of expert 0, ...]}}

    Returns:
        ``{layer: [load of global expert e for e in range(E)]}``.
    """
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != LOAD_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a load file (format {found!r}, expected {LOAD_FORMAT!r})")
    num_experts, layers = data.get("num_experts"), data.get("layers")
    if not isinstance(num_experts, int) or num_experts < 1 or not isinstance(layers, dict):
        raise ValueError(f"{path}: needs a positive integer 'num_experts' and a 'layers' object")
    out = {}
    for layer, counts in layers.items():
        if not layer.isdigit():
            raise ValueError(f"{path}: layer {layer!r} is not a layer index")
        if not isinstance(counts, list) or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts):
            raise ValueError(f"{path}: layer {layer} must hold a list of numbers")
        if len(counts) != num_experts:
            raise ValueError(f"{path}: layer {layer} has {len(counts)} counts, expected num_experts = {num_experts}")
        if any(not c >= 0 for c in counts):  # (NaN too)
            raise ValueError(f"{path}: layer {layer} has negative or NaN counts")
        out[int(layer)] = [float(c) for c in counts]
    return out


def write_load_file(path: str | Path, num_experts: int, layers: Mapping[int, Sequence[float]]) -> None:
    """Write ``{layer: tokens per global expert}`` in the format :func:`read_load_file` reads."""
    payload = {"format": LOAD_FORMAT, "num_experts": num_experts, "layers": {str(k): list(v) for k, v in sorted(layers.items())}}
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def plan_placement(
    checkpoint: Checkpoint,
    shards: int,
    *,
    placement: Placement = "contiguous",
    replicas: int = 0,
    load: Mapping[int, Sequence[float]] | None = None,
) -> dict[int, list[list[int]]]:
    """Decide, per layer, which global experts each shard holds."""
    if placement not in ("contiguous", "balanced"):
        raise ValueError(f"placement must be 'contiguous' or 'balanced', got {placement!r}")
    if placement == "contiguous" and (replicas or load is not None):
        raise ValueError("--replicas and --load go with --placement balanced")
    if placement == "balanced" and load is None:
        raise ValueError("--placement balanced needs a load file (--load FILE, written by `lutb load`)")
    plan = {}
    for layer in checkpoint.layers:
        ids = checkpoint.expert_ids(layer).tolist()
        if placement == "contiguous":
            plan[layer] = contiguous_placement(ids, shards)
        else:
            assert load is not None
            if layer not in load:
                raise ValueError(f"the load file has no counts for layer {layer}")
            if len(load[layer]) != checkpoint.config.num_experts:
                raise ValueError(f"the load file counts {len(load[layer])} experts for layer {layer}; "
                                 f"the checkpoint's model has {checkpoint.config.num_experts}")
            plan[layer] = balanced_placement({e: load[layer][e] for e in ids}, shards, replicas)
    return plan


def select_experts(weights: LayerWeights, keep: Iterable[int]) -> LayerWeights:
    """The experts ``keep`` (global ids, a subset of ``weights.expert_ids``) of one layer."""
    local = {int(e): i for i, e in enumerate(weights.expert_ids.tolist())}
    keep = sorted(keep)
    missing = [e for e in keep if e not in local]
    if missing:
        raise ValueError(f"experts {missing} are not in this checkpoint layer")
    rows = torch.tensor([local[e] for e in keep], dtype=torch.long)
    return LayerWeights(weights.w13[rows], weights.w2[rows], torch.tensor(keep, dtype=torch.int32))


def write_shards(
    checkpoint: Checkpoint,
    out_dir: str | Path,
    plan: Mapping[int, Sequence[Sequence[int]]],
    *,
    overwrite: bool = False,
    progress: Callable[[Iterable[int]], Iterable[int]] | None = None,
    hash_progress: Callable[[int], AbstractContextManager[Any]] | None = None,
) -> list[Path]:
    """Write one checkpoint per shard (``out_dir/shard-N``) plus ``out_dir/shards.json``, all or nothing.

    Streams one layer at a time: memory stays near one layer's size. Everything is written into a
    hidden sibling of ``out_dir``, which then replaces ``out_dir`` whole (:class:`StagedDirectory`):
    an interrupted run leaves ``out_dir`` as it was, and an overwrite leaves no shard of the earlier
    placement (e.g. ``shard-3`` of a 4-way split re-sharded 2 ways) beside the new ones.

    Args:
        overwrite: replace the shards ``out_dir`` holds. An ``out_dir`` holding anything but shard
            directories and ``shards.json`` is refused either way, as is one holding the source.
        progress: wraps the layers as they are written (e.g. a tqdm bar).
        hash_progress: a progress bar for hashing the source: its files against its ``SHA256SUMS`` first (where it
            has one), then its content hash, which ``shards.json`` records; see :meth:`Checkpoint.content_hash`.

    Returns:
        The shard directories, in shard order.

    Raises:
        FileExistsError: ``out_dir`` cannot be replaced (see above).
        LutBFormatError: a source file's bytes differ from its ``SHA256SUMS`` (nothing is written).
    """
    out = Path(out_dir)
    if not plan:
        raise ValueError("the placement holds no layers: nothing to shard")
    shards = len(next(iter(plan.values())))
    staged = StagedDirectory(out, owns=_is_shard_output, what="shard checkpoints", overwrite=overwrite,
                             sources=checkpoint.files)
    try:
        checkpoint.verify_files(hash_progress)  # shards of a damaged copy would carry checksums of its damage
        _write_shard_checkpoints(checkpoint, staged.staging, plan, progress)
        manifest = {
            "source": str(checkpoint.path),
            "source_content_hash": checkpoint.content_hash(progress=hash_progress),
            "shards": [shard_dir_name(s) for s in range(shards)],
            "layers": {str(layer): [list(map(int, ids)) for ids in plan[layer]] for layer in sorted(plan)},
        }
        (staged.staging / SHARD_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        staged.commit()
    except BaseException:
        staged.discard()
        raise
    return [out / shard_dir_name(s) for s in range(shards)]


def _write_shard_checkpoints(checkpoint: Checkpoint, root: Path, plan: Mapping[int, Sequence[Sequence[int]]],
                             progress: Callable[[Iterable[int]], Iterable[int]] | None) -> None:
    """Write shard ``s``'s checkpoint to ``root/shard-s`` for every shard of ``plan`` (``root`` is new)."""
    shards = len(next(iter(plan.values())))
    layers = sorted(plan)
    with ExitStack() as stack:
        writers = [stack.enter_context(CheckpointWriter(root / shard_dir_name(s), checkpoint.config)) for s in range(shards)]
        for layer in progress(layers) if progress else layers:
            weights = checkpoint.layer(layer)
            for writer, keep in zip(writers, plan[layer]):
                writer.write_layer(layer, select_experts(weights, keep))


_SHARD_DIR = re.compile(r"shard-(0|[1-9][0-9]*)", re.ASCII)


def _is_shard_output(entry: Path) -> bool:
    """Whether ``entry`` of an output directory is what :func:`write_shards` writes there (replaceable)."""
    if entry.name == SHARD_MANIFEST:
        return entry.is_file()
    return (bool(_SHARD_DIR.fullmatch(entry.name)) and entry.is_dir() and not entry.is_symlink()
            and all(is_checkpoint_file(f) for f in entry.iterdir()))
