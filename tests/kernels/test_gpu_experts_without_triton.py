"""The GPU backends' modules import, and refuse politely, where triton is not installed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = r"""
import sys
sys.modules["triton"] = None  # as if not installed: `import triton` raises ImportError
import torch
import lutb_kernels, lutb_kernels.mxfp8_triton, lutb_kernels.lut_b_gemm, lutb_kernels.grouped_gemm
from lutb_kernels.checkpoint import CheckpointConfig
from lutb_kernels.experts.emulated import LutBEmulationTritonExperts
from lutb_kernels.experts.packed import LutBPackedExperts
from lutb_kernels.experts.sm107 import LutBSm107Experts
cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2)
for cls in (LutBPackedExperts, LutBEmulationTritonExperts, LutBSm107Experts):
    ok, reason = cls.supports(cfg, torch.device("cuda"))
    assert not ok and reason.startswith("triton is not installed"), (cls, reason)
assert not lutb_kernels.mxfp8_triton.triton_available()
print("ok")
"""


def test_backends_without_triton() -> None:
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_sm107_support_reasons() -> None:
    import torch

    from lutb_kernels.checkpoint import CheckpointConfig
    from lutb_kernels.experts.sm107 import LutBSm107Experts, native_op_registered

    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2)
    ok, reason = LutBSm107Experts.supports(cfg, torch.device("cpu"))
    assert not ok and reason
    if native_op_registered().ok is False:
        assert "not registered" in native_op_registered().reason


def test_a_triton_older_than_the_kernels_need_is_refused(monkeypatch) -> None:
    """The routing kernel's masked ``tl.histogram`` needs triton >= 3.4: an older one is refused with the reason (not
    left to fail at the first compile), and the Triton MXFP8 ops are not chosen either; a version that cannot be read
    passes."""
    import importlib.metadata

    import pytest

    from lutb_kernels import mxfp8_triton
    from lutb_kernels.experts import _triton_common as common

    if not common.triton_present().ok:
        pytest.skip("triton is not installed")

    def metadata(version: str | None):
        def read(package: str) -> str:
            assert package == "triton"
            if version is None:
                raise importlib.metadata.PackageNotFoundError(package)
            return version
        return read

    for version, ok in [("3.3.1", False), ("3.2.0", False), ("2.3.1", False), ("3.4.0", True), ("3.6.0", True),
                        ("3.10.0+git1a2b", True), ("4.0.0", True), (None, True), ("unknown", True)]:
        monkeypatch.setattr(importlib.metadata, "version", metadata(version))
        support = common.triton_present()
        assert support.ok is ok and mxfp8_triton.triton_available() is ok, (version, support)
        if not ok:
            assert support.reason.startswith(f"triton {version.rsplit('.', 1)[0]} is older than 3.4"), support.reason


def test_the_emulated_backend_needs_compute_capability_8(monkeypatch) -> None:
    """Its grouped GEMM multiplies bfloat16 on tensor cores: a T4 or V100 is refused with the reason, so `auto` falls
    back to the reference instead of picking a backend whose first compile fails."""
    import pytest
    import torch

    from lutb_kernels.checkpoint import CheckpointConfig
    from lutb_kernels.experts import _triton_common as common
    from lutb_kernels.experts.emulated import LutBEmulationTritonExperts

    if not common.triton_present().ok:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "a test GPU")
    cfg = CheckpointConfig(hidden_size=128, intermediate_size=128, num_experts=2)
    for cap, ok in [((7, 5), False), ((7, 0), False), ((8, 0), True), ((9, 0), True)]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cap=cap: cap)
        support = LutBEmulationTritonExperts.supports(cfg, torch.device("cuda"))
        assert support.ok == ok, support
        if not ok:
            assert "compute capability 8.0" in support.reason
