"""What the stream budget (``lutb_server.byte_budget``) costs one ForwardStream request, timed alone.

    python bench/stream_budget_cost.py [--requests N] [--repeats R]

Each iteration is what ``ExpertServicer.ForwardStream`` does per request: ``BudgetShare.room()`` before the read,
``take()`` of the response's bytes, ``give_back()`` once gRPC took the response, on a 512 MiB budget with an
eighth per stream. Prints microseconds per request for each repeat. CPU only; no server.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from lutb_server.byte_budget import BudgetShare, ByteBudget


async def per_request_us(requests: int, response_bytes: int) -> float:
    shared = ByteBudget(512 << 20)
    share = BudgetShare(shared, shared.limit // 8)
    start = time.perf_counter()
    for _ in range(requests):
        await share.room()
        held = await share.take(response_bytes)
        share.give_back(held)
    return (time.perf_counter() - start) / requests * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--response-bytes", type=int, default=66_560, help="default: 16 tokens x 2048 bf16 + 1 KiB")
    args = parser.parse_args()
    for _ in range(args.repeats):
        print(f"room + take + give_back: {asyncio.run(per_request_us(args.requests, args.response_bytes)):.2f} us per request")


if __name__ == "__main__":
    main()
