"""Launch geometry of the Triton MXFP8 kernels (CPU; the kernels' bytes are tested in test_mxfp8_triton*.py)."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels import mxfp8_triton as mt

H200_SMS = 132


@pytest.mark.parametrize(
    "m,k_blocks,cap,want",
    [
        (1, 28, 16, 1),  # deepseek-v3 T=1, x: one row
        (2, 56, 16, 1),  # mixtral T=1, activation: 2 rows, 56 column blocks -> 112 programs of one row
        (64, 56, 16, 2),  # mixtral T=32, activation: 16 -> 224 programs, 2 -> 1792 (>= 8 per SM)
        (32, 16, 16, 1),  # mixtral T=32, x: 32 x 16 = 512 programs at one row, still under a wave
        (5, 3, 16, 1),  # odd rows
        (8192, 28, 16, 16),  # prefill keeps the cap: 512 x 28 programs
        (1000, 16, 16, 8),  # 63 x 16 = 1008 < 1056 programs at 16 rows, 2000 at 8
        (3, 1, 64, 1),
    ],
)
def test_rows_per_program_fills_the_gpu(monkeypatch: pytest.MonkeyPatch, m: int, k_blocks: int, cap: int, want: int) -> None:
    monkeypatch.setattr(mt, "sm_count", lambda device: H200_SMS)
    got = mt.rows_per_program(m, k_blocks, cap, torch.device("cuda"))
    assert got == want
    assert got & (got - 1) == 0 and 1 <= got <= cap


@pytest.mark.parametrize("m,want", [(1, 1), (2, 2), (3, 4), (16, 16), (17, 16), (1000, 16)])
def test_without_a_grid_target_blocks_only_shrink_to_the_batch(monkeypatch: pytest.MonkeyPatch, m: int, want: int) -> None:
    monkeypatch.setattr(mt, "sm_count", lambda device: H200_SMS)
    monkeypatch.setattr(mt, "QDQ_PROGRAMS_PER_SM", 0)
    assert mt.rows_per_program(m, 56, 16, torch.device("cuda")) == want
