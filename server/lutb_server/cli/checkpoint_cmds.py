"""``lutb synth``, ``lutb quantize`` and ``lutb inspect``: make, convert and check LUT-B checkpoints."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tqdm import tqdm

SCALE_MODES = ("rceil", "floor")


def register(subparsers: argparse._SubParsersAction) -> None:
    synth = subparsers.add_parser("synth", help="write a synthetic LUT-B checkpoint (random experts, really quantized)")
    synth.add_argument("--out", required=True, metavar="DIR", help="directory to create")
    synth.add_argument("--layers", type=int, default=2, help="MoE layers (default: 2)")
    synth.add_argument("--experts", type=int, default=8, help="experts per layer (default: 8)")
    synth.add_argument("--hidden", type=int, default=256, help="hidden size H, a multiple of 128 (default: 256)")
    synth.add_argument("--intermediate", type=int, default=256, help="intermediate size I, a multiple of 128 (default: 256)")
    synth.add_argument("--activation", default="silu", help="activation (default: silu)")
    synth.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="model dtype (default: bfloat16)")
    synth.add_argument("--scale-mode", default="rceil", choices=SCALE_MODES, help="MXFP8 scale mode recorded (default: rceil)")
    synth.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    synth.add_argument("--weight-std", type=float, default=0.02, help="std of the dense weights (default: 0.02)")
    synth.set_defaults(run=run_synth)

    quantize = subparsers.add_parser("quantize", help="convert a Hugging Face MoE checkpoint (safetensors) to LUT-B")
    quantize.add_argument("src", metavar="SRC", help="directory with config.json and *.safetensors")
    quantize.add_argument("--out", required=True, metavar="DIR", help="LUT-B checkpoint directory to write")
    quantize.add_argument("--device", default=None,
                          help="cpu, cuda or cuda:N (default: cuda when available, else cpu); one this host lacks is refused")
    quantize.add_argument("--seed", type=int, default=0, help="quantizer seed (default: 0)")
    quantize.add_argument("--scale-mode", default="rceil", choices=SCALE_MODES, help="MXFP8 scale mode recorded (default: rceil)")
    quantize.add_argument("--overwrite", action="store_true", help="replace safetensors files already in --out")
    quantize.add_argument("--no-progress", action="store_true", help="no progress bar")
    quantize.set_defaults(run=run_quantize)

    inspect = subparsers.add_parser("inspect", help="describe a LUT-B checkpoint and validate every tile")
    inspect.add_argument("dir", metavar="DIR", help="LUT-B checkpoint directory")
    inspect.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    inspect.add_argument("--no-progress", action="store_true", help="no progress bar")
    inspect.set_defaults(run=run_inspect)


def run_synth(args: argparse.Namespace) -> int:
    """``lutb synth``: write a synthetic checkpoint to ``args.out``; 0, or 1 with one line on stderr.

    Bad sizes or arguments and an ``OUT`` already holding a checkpoint print ``lutb synth: <error>``; any other
    OSError (synth reads no file, so it is the output's: a read-only directory, a full disk) prints
    ``lutb synth: cannot write OUT: <reason>``, as ``lutb quantize`` does, instead of a traceback.
    """
    from lutb_kernels.errors import LutBError
    from lutb_kernels.synth import make_synthetic_checkpoint

    try:
        path = make_synthetic_checkpoint(
            args.out,
            layers=args.layers,
            experts=args.experts,
            hidden=args.hidden,
            intermediate=args.intermediate,
            activation=args.activation,
            dtype=args.dtype,
            scale_mode=args.scale_mode,
            seed=args.seed,
            weight_std=args.weight_std,
        )
    except (LutBError, ValueError, FileExistsError) as exc:
        print(f"lutb synth: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # nothing is read: this is the output's (read-only directory, full disk)
        print(f"lutb synth: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.layers} layer(s) x {args.experts} experts (H={args.hidden}, I={args.intermediate}, {args.activation}) to {path}")
    return 0


def run_quantize(args: argparse.Namespace) -> int:
    from lutb_kernels.errors import LutBError
    from lutb_kernels.hf_import import import_hf_checkpoint

    try:
        report = import_hf_checkpoint(
            args.src,
            args.out,
            scale_mode=args.scale_mode,
            device=args.device,
            seed=args.seed,
            progress=not args.no_progress,
            overwrite=args.overwrite,
        )
    except (LutBError, ValueError, FileExistsError) as exc:  # (ValueError: weights the quantizer cannot encode, a bad --device)
        print(f"lutb quantize: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the source's read errors are LutBFormatErrors naming the file: this is the output's
        print(f"lutb quantize: cannot write {args.out}: {exc}", file=sys.stderr)
        return 1
    cfg = report.config
    print(
        f"wrote {len(report.layers)} MoE layer(s) to {report.out_dir}: H={cfg.hidden_size} I={cfg.intermediate_size} "
        f"experts={cfg.num_experts} activation={cfg.activation} dtype={cfg.dtype} scale_mode={cfg.mxfp8_scale_mode}"
    )
    print(report.table())
    for note in report.notes:
        print(f"note: {note}")
    return 0


def hash_bar(total: int, desc: str = "hash") -> tqdm:
    """The progress bar of a pass that reads every byte (``Checkpoint.content_hash(progress=hash_bar)``,
    ``Checkpoint.verify_files(progress=sha256_bar)``): ``total`` bytes, on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr)


def sha256_bar(total: int) -> tqdm:
    """:func:`hash_bar` of the pass that checks the files against the checkpoint's ``SHA256SUMS``."""
    return hash_bar(total, "SHA256SUMS")


def describe(path: str, *, progress: bool = False) -> dict[str, Any]:
    """Everything ``lutb inspect`` reports, as a JSON-ready dict (``valid``/``error`` included).

    Args:
        progress: show progress bars on stderr for the passes that read every byte (hash, validate).

    Raises:
        LutBFormatError: the checkpoint cannot even be opened (metadata, tensor names) or described (an
            ``expert_ids`` tensor that is not 1-D int32).
    """
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.errors import LutBFormatError
    from lutb_kernels.hf_import import compact_ids
    from lutb_kernels.tiles import TILE_BYTES

    ckpt = Checkpoint(path)
    cfg = ckpt.config
    layers = []
    weights = 0
    for layer in ckpt.layers:
        ids = [int(v) for v in ckpt.expert_ids(layer).tolist()]
        layers.append({"layer": layer, "experts": len(ids), "expert_ids": compact_ids(ids) if ids == sorted(set(ids)) else str(ids)})
        weights += len(ids) * (cfg.w13_rows * cfg.hidden_size + cfg.hidden_size * cfg.intermediate_size)
    weight_bytes = ckpt.weight_bytes
    info: dict[str, Any] = {
        "path": str(ckpt.path),
        "files": len(ckpt.files),
        "file_bytes": sum(f.stat().st_size for f in ckpt.files),
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_experts": cfg.num_experts,
        "activation": cfg.activation,
        "dtype": cfg.dtype,
        "mxfp8_scale_mode": cfg.mxfp8_scale_mode,
        "layers": layers,
        "weights": weights,
        "weight_bytes": weight_bytes,
        "bits_per_weight": weight_bytes * 8 / weights if weights else 0.0,
        "tile_bytes": TILE_BYTES,
        "content_hash": ckpt.content_hash(progress=hash_bar if progress else None),
        "checksums": ckpt.checksums is not None,
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = lambda it: tqdm(it, desc="validate", unit="layer", file=sys.stderr)  # noqa: E731
    try:
        ckpt.validate(progress=bar, file_progress=sha256_bar if progress else None)
        info["valid"] = True
        info["error"] = None
    except LutBFormatError as exc:
        info["valid"] = False
        info["error"] = str(exc)
    return info


def _text(info: dict[str, Any]) -> str:
    lines = [
        f"checkpoint  {info['path']} ({info['files']} file(s), {info['file_bytes']:,} bytes)",
        f"sizes       hidden {info['hidden_size']}, intermediate {info['intermediate_size']}, {info['num_experts']} experts (global)",
        f"activation  {info['activation']}",
        f"dtype       {info['dtype']}",
        f"scale mode  {info['mxfp8_scale_mode']}",
        f"layers      {len(info['layers'])}",
    ]
    for layer in info["layers"]:
        lines.append(f"  layer {layer['layer']:>5}: {layer['experts']} experts, ids {layer['expert_ids']}")
    lines += [
        f"weights     {info['weights']:,} in {info['weight_bytes']:,} bytes = {info['bits_per_weight']:.4f} bits per weight",
        f"hash        {info['content_hash']}",
        f"checksums   {'SHA256SUMS: every file checked' if info['checksums'] else 'none (no SHA256SUMS): file bytes not checked'}",
        f"valid       {'yes' if info['valid'] else 'NO: ' + info['error']}",
    ]
    return "\n".join(lines)


def run_inspect(args: argparse.Namespace) -> int:
    from lutb_kernels.errors import LutBFormatError

    try:
        info = describe(args.dir, progress=not args.no_progress and not args.json)
    except LutBFormatError as exc:
        if args.json:
            print(json.dumps({"path": args.dir, "valid": False, "error": str(exc)}))
        print(f"lutb inspect: invalid checkpoint: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(info, indent=2) if args.json else _text(info))
    if not info["valid"]:
        print(f"lutb inspect: invalid checkpoint: {info['error']}", file=sys.stderr)
        return 1
    return 0
