#!/usr/bin/env python
"""What building and serializing one ``ForwardResponse`` costs, whole or spliced, by output size (CPU, no server).

Whole: the output's bytes copied into the message (``encode_tensor``), then ``SerializeToString`` (what the servicer
does below ``SPLICE_OUTPUT_BYTES``). Spliced: the message without its output serialized, and the output field's parts
(``codec.tensor_field_parts``) joined to it (:class:`~lutb_server.servicer.SplicedResponse`,
:func:`~lutb_server.servicer.serialize_response`). Both start from the output's bytes as a compute process's answer
leaves them (a ``bytes`` copy out of shared memory) and end with the wire bytes; both results parse as the same message
(checked). The malloc thresholds are set as the server sets them (``tune_malloc``).

    python bench/response_splice.py                 # bf16 outputs of [T, 2048], T = 1, 16, 128, 1024
"""

from __future__ import annotations

import argparse
import time

import torch

from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.allocator import tune_malloc
from lutb_client.codec import WireTensor, encode_tensor
from lutb_server.servicer import SPLICE_OUTPUT_BYTES, SplicedResponse, serialize_response


def _response() -> pb.ForwardResponse:
    response = pb.ForwardResponse(request_id=5, status=pb.Status(code=0))
    response.timing.compute_us, response.timing.total_us = 300, 900
    return response


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", default="1,16,128,1024")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--calls", type=int, default=2000)
    args = p.parse_args(argv)
    print(tune_malloc())
    source = bytearray(torch.randn(max(int(t) for t in args.tokens.split(",")), args.hidden).to(torch.bfloat16)
                       .view(torch.uint8).numpy().tobytes())  # stands for the shared arena
    print(f"| T | output KB | whole us | spliced us | the servicer sends (threshold {SPLICE_OUTPUT_BYTES // 1024} KB) |")
    print("|---|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        nbytes = tokens * args.hidden * 2

        def whole() -> bytes:
            response = _response()
            encode_tensor(WireTensor(torch.bfloat16, (tokens, args.hidden), bytes(source[:nbytes])), out=response.output)
            return response.SerializeToString()

        def spliced() -> bytes:
            output = WireTensor(torch.bfloat16, (tokens, args.hidden), bytes(source[:nbytes]))
            return serialize_response(SplicedResponse(_response(), output))

        assert pb.ForwardResponse.FromString(whole()) == pb.ForwardResponse.FromString(spliced())
        us = {}
        for name, fn in (("whole", whole), ("spliced", spliced)):
            for _ in range(min(200, args.calls)):
                fn()
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            us[name] = (time.perf_counter() - start) / args.calls * 1e6
        sent = "spliced" if nbytes >= SPLICE_OUTPUT_BYTES else "whole"
        print(f"| {tokens} | {nbytes / 1024:.0f} | {us['whole']:.1f} | {us['spliced']:.1f} | {sent} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
