"""Triton kernels on the CPU interpreter (``TRITON_INTERPRET=1``), at tiny sizes.

Triton decides between interpreting and compiling when a kernel is *decorated*, i.e. when
its ``_*_details`` module is first imported; the ops import those lazily at their first
launch, after collection. So setting the variable here, at collection, is enough, and it
only happens where no CUDA device exists (where nothing could be compiled anyway). On a
GPU machine these tests skip unless the process already runs under the interpreter
(``bench/device_check.sh`` runs them in a separate process with ``CUDA_VISIBLE_DEVICES=``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # lutb_gpu_testdata

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
_HAVE_TRITON = importlib.util.find_spec("triton") is not None


@pytest.fixture(autouse=True)
def _interpreter_only() -> None:
    if not _HAVE_TRITON:
        pytest.skip("triton is not installed")
    if not _INTERPRETING:
        pytest.skip("interpreter tests run where no CUDA device is visible (the GPU tests cover this machine)")
