#!/usr/bin/env python
"""CPU cost of the sharded client's per-call planning, without any network.

:class:`~lutb_client.ShardedExpertClient` splits each forward over the expert shards; on a
GPU deployment that per-call CPU work (planning the sub-requests, taking their answers in,
combining the outputs) bounds the calls per second one client process can make. This
script runs exactly that work on made-up shards: a client core given hand-made
``ModelInfo`` messages (no server, no channel), and for each sub-request a response the
codec encodes outside the timed region (zeros of the right shape, in bfloat16). Per call it
times, in microseconds:

- ``init``: constructing the call (input checks, conversions);
- ``plan``: the route assignment and the encoded sub-requests (``build_request`` included);
- ``absorb``: taking each sub-request's response in (decoding included);
- ``result``: combining the outputs (float32 sum, one rounding to bfloat16);
- ``total``: the sum of the four (median of the per-call sums, so not the sum of the medians);
- ``codec``: the part of ``total`` spent in ``build_request`` and ``parse_response`` (encoding
  the requests, decoding the responses: the same protobuf work a single-server client does;
  timed by wrapping the two functions, which adds well under a microsecond per sub-request).

Each call's objects (requests, outputs) are released between calls, outside the timed phases.
With ``--repeat N`` every case is measured N times (after one another) and each column is
the median of the N medians, which steadies the numbers on a shared machine.

Cases: 64 experts, top-8, H = 2048 bfloat16, T = 1, 32, 256 tokens routed by a softmax top-k
over random logits, placed contiguously over S = 1, 2, 4 shards (``contig``), and over 4
shards with every expert on 2 of them (``replica2``: expert block ``b`` of 16 on shards
``b`` and ``b+1 mod 4``). ``subs`` is the mean number of sub-requests per call.

    PYTHONPATH=kernels:client:server python bench/sharded_client_cpu.py
    PYTHONPATH=kernels:client:server python bench/sharded_client_cpu.py --threads 1 --repeat 3 --json /tmp/cpu.json

It uses the client's private planning classes (``_ShardedCore``, ``_Call``), so it measures
whatever code is on ``PYTHONPATH``. The numbers depend on the machine and its load: record
the machine and the thread count with them.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from lutb_client import sharded
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.codec import encode_tensor
from lutb_client.routing import softmax_topk

EXPERTS, TOP_K, HIDDEN = 64, 8, 2048
PHASES = ("init", "plan", "absorb", "result")


def placement(kind: str, shards: int) -> list[list[int]]:
    """Experts held by each shard: ``contig`` (block ``s`` of ``64 / S``) or ``replica2`` (4 shards, each expert on 2)."""
    if kind == "contig":
        per = EXPERTS // shards
        return [list(range(s * per, (s + 1) * per)) for s in range(shards)]
    if kind == "replica2":
        if shards != 4:
            raise ValueError("replica2 is defined for 4 shards")
        block = EXPERTS // 4
        return [[e for e in range(EXPERTS) if e // block in (s, (s - 1) % 4)] for s in range(4)]
    raise ValueError(f"unknown placement {kind!r}")


def make_core(held: list[list[int]]) -> sharded._ShardedCore:
    """A client core with one layer (0) placed as ``held``, connected to nothing."""
    infos = []
    for experts in held:
        info = pb.ModelInfo(hidden_size=HIDDEN, num_experts=EXPERTS, dtype=pb.BFLOAT16, format="lut-b", format_version=1,
                            activation="silu", mxfp8_scale_mode="rceil")
        layer = info.layers.add()
        layer.layer = 0
        layer.expert_ids.extend(experts)
        infos.append(info)
    core = sharded._ShardedCore([f"shard-{s}:0" for s in range(len(held))], 10.0, None, 5.0, "native", "stream")
    core._set_infos(infos)
    return core


class FakeResponses:
    """Encoded zero outputs, one per output shape (encoding happens outside the timed region)."""

    def __init__(self, route_major: bool) -> None:
        self.route_major = route_major
        self._cache: dict[tuple[int, ...], pb.ForwardResponse] = {}

    def __call__(self, sub: object) -> pb.ForwardResponse:
        rows = len(sub.rows)  # type: ignore[attr-defined]
        shape = (rows, int(sub.ids.shape[1]), HIDDEN) if self.route_major else (rows, HIDDEN)  # type: ignore[attr-defined]
        response = self._cache.get(shape)
        if response is None:
            response = pb.ForwardResponse()
            encode_tensor(torch.zeros(shape, dtype=torch.bfloat16), out=response.output)
            self._cache[shape] = response
        return response


class CodecClock:
    """Seconds spent in ``build_request`` and ``parse_response`` (the codec), while installed in ``sharded``."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: dict[str, Callable[..., Any]] = {}

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += clock() - start

        return timed

    def __enter__(self) -> CodecClock:
        for name in ("build_request", "parse_response"):
            self._saved[name] = getattr(sharded, name)
            setattr(sharded, name, self._timed(self._saved[name]))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._saved.items():
            setattr(sharded, name, fn)


def time_calls(core: sharded._ShardedCore, batches: list[tuple[torch.Tensor, ...]], calls: int, warmup: int,
               output_mode: str) -> tuple[dict[str, float], float]:
    """Median microseconds per phase, of the per-call total and of its codec share; mean sub-requests per call."""
    responses = FakeResponses(output_mode == "route_major")
    clock = time.perf_counter
    samples: dict[str, list[float]] = {p: [] for p in (*PHASES, "total", "codec")}
    subs = 0
    with CodecClock() as codec:
        for n in range(warmup + calls):
            x, ids, weights = batches[n % len(batches)]
            codec.seconds = 0.0
            t0 = clock()
            call = sharded._Call(core, 0, x, ids, weights, False, output_mode)
            t1 = clock()
            round_ = call.plan()
            t2 = clock()
            answers = [responses(sub) for sub, _ in round_]  # not timed: the server's part
            t3 = clock()
            for (sub, _), answer in zip(round_, answers):
                call.absorb(sub, answer, float("inf"))
            t4 = clock()
            output = call.result().output
            t5 = clock()
            if not call.done:
                raise RuntimeError("a fake round left routes pending")
            if n >= warmup:
                for name, seconds in zip(PHASES, (t1 - t0, t2 - t1, t4 - t3, t5 - t4)):
                    samples[name].append(seconds)
                samples["total"].append((t2 - t0) + (t5 - t3))
                samples["codec"].append(codec.seconds)
                subs += len(round_)
            del call, round_, answers, output  # freed here, not inside the next call's timed phases
    medians = {name: 1e6 * statistics.median(values) for name, values in samples.items()}
    return medians, subs / calls


def make_batches(tokens: int, count: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """``count`` routed batches: bf16 hidden states ``[T, H]``, int32 ids and float32 weights ``[T, 8]``."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
        weights, ids = softmax_topk(torch.randn(tokens, EXPERTS, generator=gen), TOP_K)
        out.append((x, ids, weights))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--calls", type=int, default=300, help="timed calls per case (default 300)")
    p.add_argument("--warmup", type=int, default=30, help="untimed calls first (default 30)")
    p.add_argument("--repeat", type=int, default=1, help="measure each case this many times, report medians (default 1)")
    p.add_argument("--tokens", default="1,32,256", help="token counts, comma-separated (default 1,32,256)")
    p.add_argument("--output-mode", choices=("combined", "route_major"), default="combined")
    p.add_argument("--json", metavar="OUT", help="also write the table (and the settings) as JSON to OUT")
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tokens = [int(t) for t in args.tokens.split(",")]
    cases: list[tuple[str, int]] = [("contig", 1), ("contig", 2), ("contig", 4), ("replica2", 4)]
    rows = []
    columns = (*PHASES, "total", "codec")
    header = f"{'placement':<9} {'S':>2} {'T':>4} {'subs':>5} " + " ".join(f"{p:>8}" for p in columns)
    print(f"# median us per call; torch {torch.__version__} threads {torch.get_num_threads()}, numpy {np.__version__}, "
          f"{args.output_mode}, E={EXPERTS} k={TOP_K} H={HIDDEN} bf16, {args.calls} calls per case")
    print(header)
    for kind, shards in cases:
        core = make_core(placement(kind, shards))
        for t in tokens:
            batches = make_batches(t, 8, seed=t)
            runs = [time_calls(core, batches, args.calls, args.warmup, args.output_mode) for _ in range(args.repeat)]
            medians = {c: statistics.median(r[0][c] for r in runs) for c in columns}
            subs = runs[0][1]
            row = {"placement": kind, "shards": shards, "tokens": t, "subs": subs, **{f"{k}_us": v for k, v in medians.items()}}
            rows.append(row)
            print(f"{kind:<9} {shards:>2} {t:>4} {subs:>5.2f} " + " ".join(f"{medians[p]:>8.1f}" for p in columns),
                  flush=True)
    if args.json:
        meta = {
            "torch": torch.__version__, "numpy": np.__version__, "python": sys.version.split()[0],
            "machine": platform.machine(), "processor": platform.processor(), "threads": torch.get_num_threads(),
            "calls": args.calls, "warmup": args.warmup, "repeat": args.repeat, "output_mode": args.output_mode,
            "experts": EXPERTS, "top_k": TOP_K, "hidden": HIDDEN, "dtype": "bfloat16",
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
