"""Compiling a Triton kernel for sm_90 on a machine without a GPU (triton's bundled ptxas), for the tests that check
that a kernel the interpreter accepts is one the compiler accepts too."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_compile_script(script: str, timeout_s: float = 300) -> str:
    """Run ``script`` (Python source that calls ``triton.compile`` for ``GPUTarget("cuda", 90, 32)``) in a
    subprocess without ``TRITON_INTERPRET`` (the interpreter tests set it in this process); returns its stdout.
    Skips the test where triton or its bundled ptxas is missing; fails it with the script's stderr where it fails."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    import triton

    if not (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("triton's bundled ptxas is missing")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout_s,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout
