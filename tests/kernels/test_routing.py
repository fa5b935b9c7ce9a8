"""The torch ``moe_align_block_size`` stays capturable in a CUDA graph: it never reads a value to the host nor copies one
in from it (checked on the CPU by watching the aten ops it dispatches; the GPU capture itself is
tests/kernels/test_routing_triton.py's ``test_torch_routing_in_a_cuda_graph_gpu``)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lutb_kernels.routing import max_padded_routes, moe_align_block_size

# A capture fails on a host-to-device copy (``lift_fresh``: a tensor made from Python data, e.g. by `t[i] = 0`), on a
# device-to-host read (``_local_scalar_dense``: `.item()`, `int(t)`, a tensor used as a Python bool) and on an op
# whose output size depends on the data, which reads it back on CUDA (on the CPU these dispatch no read of their own).
# Indexing by a boolean mask is such an op too, but dispatches as plain ``index`` (as with integer indexes): it is
# left to the GPU capture test.
HOST_OPS = {"lift_fresh", "_local_scalar_dense", "nonzero", "masked_select", "_unique2", "unique_dim",
            "unique_consecutive", "repeat_interleave"}


class HostTraffic(TorchDispatchMode):
    """Records every aten op, by name, that moves a value between the host and a tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in HOST_OPS:
            self.seen.append(name)
        return func(*args, **(kwargs or {}))


def test_the_watch_sees_a_host_scalar_written_in() -> None:
    """The check can fail: the pattern that broke the op's capture (a Python scalar stored into one element)."""
    t = torch.ones(4, dtype=torch.long)
    with HostTraffic() as watch:
        t[3] = 0
        _ = int(t.sum())
        _ = torch.unique(t)  # its size is the data's
    assert watch.seen == ["lift_fresh", "_local_scalar_dense", "_unique2"]


# (tokens, top_k, experts, block_m, sharded): zero, odd and even sizes, no experts at all, a shard's expert map.
CASES = [(0, 2, 8, 16, False), (1, 8, 256, 16, True), (7, 2, 3, 4, False), (33, 2, 8, 16, True),
         (64, 8, 128, 64, False), (5, 2, 0, 16, False)]


@pytest.mark.parametrize("tokens,top_k,experts,block_m,sharded", CASES)
@pytest.mark.parametrize("with_out", [False, True])
def test_no_host_traffic(tokens: int, top_k: int, experts: int, block_m: int, sharded: bool, with_out: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * 131 + experts)
    ids = torch.randint(-1, max(experts, 1), (tokens, top_k), generator=gen, dtype=torch.int32)
    emap = None
    if sharded:
        emap = torch.full((experts,), -1, dtype=torch.int32)
        held = torch.randperm(experts, generator=gen)[: experts // 2]
        emap[held] = torch.arange(held.numel(), dtype=torch.int32)
    n = max_padded_routes(ids.numel(), block_m, experts)
    out = None
    if with_out:
        out = (torch.empty(n, dtype=torch.int32), torch.empty(-(-n // block_m), dtype=torch.int32),
               torch.empty(1, dtype=torch.int32))
    held_out = torch.empty(tokens, top_k, dtype=torch.bool)
    with HostTraffic() as watch:
        got = moe_align_block_size(ids, block_m, experts, emap, out=out, held_out=held_out)
    assert watch.seen == []
    # and it still routes: every held route appears once, the sentinel fills the rest
    total = int(got[2])
    placed = got[0][:total]
    routes = placed[placed < ids.numel()]
    assert routes.numel() == int(held_out.sum()) == routes.unique().numel()
