"""Shared checks and launch helpers of the grouped-GEMM ops (imports no triton)."""

from __future__ import annotations

import functools
import os

import torch

ROUTE_BLOCKS = (16, 32, 64, 128, 256)
"""Routing block sizes (``moe_align_block_size``'s ``block_m``) the grouped GEMMs accept."""


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (132 on an H200); 8 on the CPU interpreter."""
    if device.type != "cuda":
        return 8
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _smem_optin(index: int) -> int:
    return int(getattr(torch.cuda.get_device_properties(index), "shared_memory_per_block_optin", 0))


def shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory one program may use on ``device`` (227 KiB on an H200); 0 off CUDA."""
    if device.type != "cuda" or interpreting():
        return 0
    return _smem_optin(device.index if device.index is not None else torch.cuda.current_device())


def is_nvidia(device: torch.device) -> bool:
    return device.type == "cuda" and torch.version.hip is None and not interpreting()


PDL = False
"""Launch our kernels with programmatic dependent launch where the GPU has it (sm90+). Off: on
the H200 it saved 1.6-3.7 us on the smallest forwards (qwen3 and mixtral T=1) but cost 3-11 us on
deepseek T=1 and every shape at T=32 (five interleaved on/off pairs, tight ranges:
bench/results/2026-12-03-pdl-h200.md). A module-level switch, so ``bench/kernels.py --pdl-ab``
can time the same code both ways when the kernels change."""


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_pdl(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL (``launch_pdl=True`` and ``PDL=True``).

    Hopper and newer NVIDIA GPUs: each kernel then starts launching while its predecessor
    finishes, saving part of the ~1-2 us gap between dependent kernels (also inside CUDA
    graphs). Every such kernel waits for its predecessor before touching memory
    (``lutb_kernels._pdl_details.pdl_prologue``), so results and ordering are unchanged.
    """
    if not PDL or not is_nvidia(device):
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= (9, 0)


def pdl_launch(device: torch.device) -> dict[str, bool]:
    """Launch keywords for a kernel with a ``PDL`` constexpr: ``PDL`` and, when on, ``launch_pdl``."""
    on = use_pdl(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_routing(
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_padded: torch.Tensor,
    block_m: int,
    device: torch.device,
) -> None:
    """Validate ``moe_align_block_size``'s outputs for ``block_m`` (shapes and dtypes only; no sync)."""
    if block_m not in ROUTE_BLOCKS:
        raise ValueError(f"block_m must be one of {ROUTE_BLOCKS}, got {block_m}")
    for name, t in (("sorted_token_ids", sorted_token_ids), ("expert_ids", expert_ids), ("num_tokens_post_padded", num_tokens_post_padded)):
        if t.dtype != torch.int32 or t.dim() != 1 or t.device != device:
            raise ValueError(f"{name} must be a 1-D int32 tensor on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}")
        if t.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if num_tokens_post_padded.numel() != 1:
        raise ValueError(f"num_tokens_post_padded must have one element, got {num_tokens_post_padded.numel()}")
    if expert_ids.numel() != cdiv(sorted_token_ids.numel(), block_m):
        raise ValueError(
            f"expert_ids has {expert_ids.numel()} blocks but sorted_token_ids ({sorted_token_ids.numel()} rows) "
            f"makes {cdiv(sorted_token_ids.numel(), block_m)} blocks of {block_m}: was the routing aligned to block_m={block_m}?"
        )


def check_out_and_weights(
    out: torch.Tensor, topk_weights: torch.Tensor | None, num_valid: int, n: int, device: torch.device
) -> None:
    if out.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"out must be bfloat16, float16 or float32, got {out.dtype}")
    if out.dim() != 2 or tuple(out.shape) != (num_valid, n) or out.stride(1) != 1 or out.device != device:
        raise ValueError(f"out must be [{num_valid}, {n}] with unit column stride on {device}, got {tuple(out.shape)} strides {out.stride()} on {out.device}")
    if topk_weights is not None:
        if topk_weights.dtype != torch.float32 or topk_weights.numel() != num_valid or not topk_weights.is_contiguous() or topk_weights.device != device:
            raise ValueError(
                f"topk_weights must be a contiguous float32 tensor with {num_valid} elements (one per route) on {device}, "
                f"got {topk_weights.dtype} {tuple(topk_weights.shape)} on {topk_weights.device}"
            )
