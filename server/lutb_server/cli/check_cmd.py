"""``lutb check`` and ``lutb record``: judge a node against another node or the local reference; keep and replay evidence.

Exit codes: 0 every row within spec section 6; 1 something beyond it (rel L2, NaN/Inf
not in the judge's output, an output of the wrong shape or dtype, a request the target
failed or the judge refused as input); 2 the check could not run: a node unreachable, a
bad checkpoint or record file, a layer not held, a device the reference cannot use, the
judge failing on its own (a bad tile of its checkpoint, a node judge down), TARGET and
--against one node, checkpoints / scale modes that differ (without ``--force``), suites with no batch for the node,
a record wider than the judge node's max_top_k, or a report that cannot be written (checked before the check;
after it, a failing node stays exit 1). ``lutb record`` follows them: 0 every
request answered; 1 the node refused a request (the record is written all the same,
its refusals kept as errors); 2 nothing recorded (node unreachable, a layer not held,
an unknown suite, an unwritable ``--out``). The library is
:mod:`lutb_client.check`; docs/checking.md describes suites, report and record format.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

from lutb_server.cli._args import positive_float, positive_int

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_ERROR = 2


def _add_batch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, nargs="+", default=None, metavar="L", help="layers to check (default: all the node holds)")
    parser.add_argument("--suite", action="append", default=None, metavar="NAME",
                        help="input suite(s), repeatable or comma-separated: normal, heavy_tailed, magnitudes, coverage, "
                             "single_token, small_batches, max_tokens, weights_on_input, route_major, duplicates, all (default: all)")
    parser.add_argument("--tokens", type=positive_int, default=1024, metavar="N",
                        help="largest request in tokens: standard batches (64 tokens) go as requests of at most N, "
                             "the max_tokens batch is min(N, max_tokens_per_request); requests are also kept within "
                             "the client's message limit, and split when a node refuses one as too large (default: 1024)")
    parser.add_argument("--topk", type=positive_int, default=8, metavar="K", help="routes per token, capped at the expert count and the sides' max_top_k (default: 8)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the suites (default: 0)")
    parser.add_argument("--timeout", type=positive_float, default=120.0, metavar="S", help="deadline of each call in seconds (default: 120)")


def register(subparsers: argparse._SubParsersAction) -> None:
    check = subparsers.add_parser(
        "check", help="judge a node's outputs against another node or the local reference",
        description="Send the same batches (input suites) to TARGET and to the judge (--against reference: the "
                    "local reference on --checkpoint DIR; --against HOST:PORT: another node), compare per layer "
                    "and per expert, print the worst rows first. Exit 0 within spec section 6, 1 beyond it, "
                    "2 when the check cannot run (the judge failing on its own included) or the two sides serve "
                    "different checkpoints or scale modes (without --force). --replay FILE judges the answers kept by `lutb record` instead of TARGET.",
    )
    check.add_argument("target", metavar="TARGET", nargs="?", default=None, help="server address host:port (omit with --replay)")
    check.add_argument("--against", default="reference", metavar="reference|HOST:PORT",
                       help="the judge: the local reference (default) or another node")
    check.add_argument("--checkpoint", default=None, metavar="DIR", help="the local copy of the checkpoint (needed by --against reference)")
    check.add_argument("--replay", default=None, metavar="FILE", help="judge a record written by `lutb record` instead of a live TARGET")
    _add_batch_options(check)
    check.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON (schema lutb-check-report/1)")
    check.add_argument("--plot", default=None, metavar="FILE.png", help="draw the error distributions per layer and expert (needs matplotlib)")
    check.add_argument("--force", action="store_true", help="compare even when checkpoint hash or MXFP8 scale mode differ (flagged in the report)")
    check.add_argument("--device", default="auto", help="device of the local reference: auto (cuda if present), cpu, cuda[:N] (default: auto)")
    check.add_argument("--top", type=int, default=10, metavar="N", help="expert rows printed, worst first; every failing one even beyond N (default: 10)")
    check.set_defaults(run=run_check)

    record = subparsers.add_parser(
        "record", help="keep a node's answers to the check's batches in a file, to judge later",
        description="Send the check's batches to TARGET and write requests, responses and its ModelInfo "
                    "(checkpoint hash, backend, device, scale mode) to one file (format lutb-record v1, "
                    "safetensors). Judge it later with `lutb check --replay FILE --against reference|HOST:PORT`. "
                    "Exit 0 when every request was answered, 1 when TARGET refused some (the record is written "
                    "all the same, with their errors), 2 when nothing could be recorded.",
    )
    record.add_argument("target", metavar="TARGET", help="server address host:port")
    record.add_argument("--out", required=True, metavar="FILE", help="record file to write (e.g. node7.lutbrec.safetensors)")
    _add_batch_options(record)
    record.set_defaults(run=run_record)


def _fail(command: str, message: str) -> int:
    print(f"lutb {command}: {message}", file=sys.stderr)
    return EXIT_ERROR


def run_check(args: argparse.Namespace) -> int:
    from lutb_client.check.record import RecordError, check_writable
    from lutb_client.check.runner import (
        CheckError,
        IdentityMismatch,
        NodeSide,
        ReferenceSide,
        Side,
        open_recording,
        run_check as check,
        same_node,
    )

    if (args.target is None) == (args.replay is None):
        return _fail("check", "give either TARGET or --replay FILE")
    if args.against == "reference" and not args.checkpoint:
        return _fail("check", "--against reference needs --checkpoint DIR (the local copy of the node's checkpoint)")
    if args.target is not None and args.against != "reference" and same_node(args.target, args.against):
        return _fail("check", f"{args.target} judged against itself proves nothing ({args.against} leads to the same "
                              "address and port): give --against another node or reference")
    if args.against != "reference" and args.checkpoint:
        print(f"lutb check: --checkpoint is only read with --against reference; judging by {args.against}", file=sys.stderr)
    outputs = [os.path.realpath(path) for path in (args.json, args.plot) if path]
    if len(set(outputs)) < len(outputs) or (args.replay and os.path.realpath(args.replay) in outputs):
        return _fail("check", "--json, --plot and --replay must name three different files (one would overwrite another)")
    for path, example in ((args.json, "report.json"), (args.plot, "report.png")):  # before a node is asked anything:
        if path:                                                                # a check may take minutes
            try:
                check_writable(path, example)
            except OSError as exc:
                return _fail("check", f"cannot write {path}: {exc.strerror or exc}")
    if args.plot:
        try:
            figure = importlib.import_module("matplotlib.figure")
        except ImportError as exc:
            return _fail("check", f"cannot draw {args.plot}: {exc} (pip install 'lutb-moe[plot]')")
        formats = set(figure.Figure().canvas.get_supported_filetypes()) - {"pgf"}  # pgf needs a TeX install
        if Path(args.plot).suffix.lower().lstrip(".") not in formats:
            return _fail("check", f"cannot draw {args.plot}: give a file name ending in one of "
                                  f"{', '.join('.' + f for f in sorted(formats))}")
    sides: list[Side] = []
    try:
        target: Side = open_recording(args.replay) if args.replay else NodeSide(args.target, timeout=args.timeout)
        sides.append(target)
        against: Side = (ReferenceSide(args.checkpoint, device=args.device) if args.against == "reference"
                         else NodeSide(args.against, timeout=args.timeout))
        sides.append(against)
        report = check(target, against, suites=args.suite, layers=args.layers, tokens=args.tokens, seed=args.seed,
                       topk=args.topk, force=args.force)
    except IdentityMismatch as exc:
        return _fail("check", f"refusing to compare: {exc} (pass --force to compare anyway)")
    except (CheckError, RecordError, ValueError) as exc:
        return _fail("check", str(exc))
    finally:
        for side in sides:
            side.close()
    print(report.format_text(top=args.top))
    # A write that fails after the check ran (disk full, the folder gone meanwhile) turns a pass into exit 2; a node
    # that failed the check stays exit 1, whatever became of its report's files.
    written = True
    if args.json:
        try:
            report.write_json(args.json)
            print(f"report written to {args.json}")
        except OSError as exc:
            _fail("check", f"cannot write {args.json}: {exc.strerror or exc}")
            written = False
    if args.plot:
        try:
            report.plot(args.plot)
            print(f"plot written to {args.plot}")
        except (ImportError, OSError, ValueError, RuntimeError) as exc:  # RuntimeError: a backend's own failure
            _fail("check", f"cannot draw {args.plot}: {exc}")
            written = False
    if not report.ok:
        return EXIT_MISMATCH
    return EXIT_OK if written else EXIT_ERROR


def run_record(args: argparse.Namespace) -> int:
    """Record TARGET's answers to ``args.out``; exit 1 (record still written) when it refused a request."""
    from lutb_client.check.runner import CheckError, NodeSide, record_node

    try:
        target = NodeSide(args.target, timeout=args.timeout)
    except CheckError as exc:
        return _fail("record", str(exc))
    try:
        rec = record_node(target, args.out, suites=args.suite, layers=args.layers, tokens=args.tokens, seed=args.seed,
                          topk=args.topk)
    except (CheckError, ValueError, OSError) as exc:
        return _fail("record", str(exc))
    finally:
        target.close()
    info = rec.model_info
    print(f"recorded {len(rec.batches)} batches ({len(rec.errors)} refused) of {args.target} "
          f"({info['backend']} on {info['device']}, {info['content_hash'][:19]}, scale mode {info['mxfp8_scale_mode']}) "
          f"to {args.out}")
    if rec.errors:
        first = min(rec.errors)
        batch, err = rec.batches[first], rec.errors[first]
        print(f"lutb record: {args.target} refused {len(rec.errors)} of {len(rec.batches)} requests; first: batch {first} "
              f"({batch.part}, layer {batch.layer}): {err['code']}: {err['message']}", file=sys.stderr)
        return EXIT_MISMATCH
    return EXIT_OK
