#!/usr/bin/env python3
"""Warm per-call cost of the request path's own CPU steps (codec, validation) for one request.

    PYTHONPATH=kernels:client:server python bench/codec_cpu.py [--tokens 16] [--hidden 2048]

Times, in a tight loop on one thread (torch intra-op threads 1, as a CUDA server runs): the request's
hidden states as the server takes them (`WireTensor.from_message`, the message's bytes kept) and as a
client decodes them (`decode_tensor`, a writable tensor), the validation's finiteness pass
(`lutb_server.engine._nonfinite`, numpy on the bit patterns), and encoding the output into a fresh
response and serialising it. Warm numbers: a lower bound for
what the server pays per request, where the event loop often starts cold.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from lutb_client import codec
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_server.engine import _nonfinite


def per_call_us(fn: Callable[[], object], n: int = 2000) -> float:
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.tokens, args.hidden).to(torch.bfloat16)
    msg = codec.encode_tensor(x)

    def respond() -> bytes:
        response = pb.ForwardResponse()
        codec.encode_tensor(x, out=response.output)
        return response.SerializeToString()

    wire = codec.WireTensor.from_message(msg)
    rows = [
        ("WireTensor.from_message (the server's)", per_call_us(lambda: codec.WireTensor.from_message(msg))),
        ("decode_tensor (bytes -> writable tensor)", per_call_us(lambda: codec.decode_tensor(msg))),
        ("_nonfinite (validation pass)", per_call_us(lambda: _nonfinite(wire))),
        ("encode into a fresh response + serialise", per_call_us(respond)),
    ]
    print(f"{args.tokens} x {args.hidden} bfloat16 ({x.numel() * 2} bytes), warm, us per call")
    for name, us in rows:
        print(f"  {name:44s} {us:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
