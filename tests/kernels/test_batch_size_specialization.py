"""No kernel specialises on a batch-size argument, so no batch size makes Triton compile again.

Triton compiles one variant of a kernel per class of each integer argument (equal to 1,
divisible by 16, other) unless told not to. An argument that follows the batch (rows, routes,
routing blocks) would then make a live server compile a new variant, for seconds, the first
time a batch of a new class arrives after its warm-up (seen on the H200:
bench/results/2026-12-04-eager-compiles-h200.md). Runs in a subprocess without
``TRITON_INTERPRET``: the interpreter tests set it for this process, and the interpreter's
functions do not keep the setting.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# (module, kernel) -> its arguments that follow the batch size
BATCH_SIZE_ARGS = {
    ("lutb_kernels._lut_b_gemm_details.kernels", "lut_b_moe_gemm_kernel"): {"num_valid", "num_programs", "num_route_blocks"},
    ("lutb_kernels._lut_b_gemm_details.kernels", "split_k_reduce_kernel"): {"num_valid"},
    ("lutb_kernels._grouped_gemm_details.kernels", "grouped_gemm_kernel"): {"num_valid"},
    ("lutb_kernels._grouped_gemm_details.kernels", "split_k_finalize_kernel"): {"num_valid"},
    ("lutb_kernels._routing_details.kernels", "moe_align_block_size_kernel"): {"R", "MAX_PADDED", "NUM_BLOCKS"},
    ("lutb_kernels._mxfp8_details.kernels", "mxfp8_quantize_kernel"): {"M"},
}

_SCRIPT = r'''
import importlib, json, sys
out = {}
for module, name in json.loads(sys.argv[1]):
    kernel = getattr(importlib.import_module(module), name)
    out[name] = {"unspecialised": sorted(p.name for p in kernel.params if p.do_not_specialize),
                 "params": [p.name for p in kernel.params]}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def kernel_params() -> dict:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root / "kernels"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(list(BATCH_SIZE_ARGS))], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize(("module", "name"), list(BATCH_SIZE_ARGS))
def test_batch_size_arguments_are_not_specialised(kernel_params: dict, module: str, name: str) -> None:
    expected = BATCH_SIZE_ARGS[(module, name)]
    info = kernel_params[name]
    assert expected <= set(info["params"]), f"{name} lost an argument the table names: {expected - set(info['params'])}"
    assert set(info["unspecialised"]) == expected
