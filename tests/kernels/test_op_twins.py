"""Every fast op takes the parameters of its plain-PyTorch reference twin: the same names, order, kinds and defaults.

Callers swap one for the other (the tests, ``dequantize_into_op``, the experts backends off CUDA), so a keyword
that only one of them takes is a call that works on one path and raises ``TypeError`` on the other. The pairs are
found, not listed: each public module's ``X_reference`` and its ``X`` (or ``X_triton``), plus the torch-ops twin of
the Triton dequantization that :func:`lutb_kernels.mxfp8_triton.dequantize_into_op` picks off CUDA. Signatures only:
nothing here imports triton.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections.abc import Callable

import pytest

import lutb_kernels

REFERENCE = "_reference"

# Pairs that must be found (a renamed twin, or a discovery that finds nothing, fails the count test).
KNOWN = {
    "lutb_kernels.grouped_gemm.grouped_gemm",
    "lutb_kernels.grouped_gemm.moe_combine",
    "lutb_kernels.lut_b_dequant.lut_b_dequantize",
    "lutb_kernels.lut_b_gemm.lut_b_moe_gemm",
    "lutb_kernels.mxfp8_triton.act_mxfp8_qdq",
    "lutb_kernels.mxfp8_triton.act_mxfp8_quantize",
    "lutb_kernels.mxfp8_triton.act_rounded",
    "lutb_kernels.mxfp8_triton.mxfp8_dequantize_into",
    "lutb_kernels.mxfp8_triton.mxfp8_qdq",
    "lutb_kernels.mxfp8_triton.mxfp8_quantize",
    "lutb_kernels.routing_triton.moe_align_block_size_triton",
    "lutb_kernels.mxfp8_triton.mxfp8_dequantize_into vs lutb_kernels.mxfp8.mxfp8_dequantize_into",
}


def _name(f: Callable[..., object]) -> str:
    return f"{f.__module__}.{f.__qualname__}"


def _twins() -> dict[str, tuple[Callable[..., object], Callable[..., object]]]:
    pairs: dict[str, tuple[Callable[..., object], Callable[..., object]]] = {}
    for info in pkgutil.iter_modules(lutb_kernels.__path__):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"lutb_kernels.{info.name}")
        for name, ref in vars(module).items():
            if name.startswith("_") or not name.endswith(REFERENCE) or not inspect.isfunction(ref):
                continue
            base = name[: -len(REFERENCE)]
            fast = getattr(module, base, None) or getattr(module, f"{base}_triton", None)
            assert fast is not None, f"{module.__name__}.{name} has no fast twin {base} or {base}_triton"
            pairs[_name(fast)] = (fast, ref)
    from lutb_kernels import mxfp8, mxfp8_triton

    fast, ref = mxfp8_triton.mxfp8_dequantize_into, mxfp8.mxfp8_dequantize_into
    pairs[f"{_name(fast)} vs {_name(ref)}"] = (fast, ref)
    return pairs


TWINS = _twins()


def _parameters(f: Callable[..., object]) -> list[tuple[str, str, object]]:
    return [(p.name, p.kind.description, p.default) for p in inspect.signature(f).parameters.values()]


def test_every_known_pair_is_found() -> None:
    assert KNOWN <= set(TWINS), f"not found: {sorted(KNOWN - set(TWINS))}"


@pytest.mark.parametrize("fast,ref", list(TWINS.values()), ids=list(TWINS))
def test_fast_op_and_reference_take_the_same_parameters(fast: Callable[..., object], ref: Callable[..., object]) -> None:
    assert _parameters(fast) == _parameters(ref), f"{_name(fast)} and {_name(ref)} differ"
