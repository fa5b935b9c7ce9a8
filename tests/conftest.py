"""Suite-wide test configuration: GPU tests skip themselves where there is no CUDA device; shared fixtures."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device: bench/device_check.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def stderr_while_hashing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What stderr received during each ``Checkpoint.content_hash`` call the test makes (one string per call)."""
    from lutb_kernels.checkpoint import Checkpoint

    during: list[str] = []
    real = Checkpoint.content_hash

    def spy(self: Checkpoint, *args: object, **kwargs: object) -> str:
        capsys.readouterr()
        result = real(self, *args, **kwargs)
        during.append(capsys.readouterr().err)
        return result

    monkeypatch.setattr(Checkpoint, "content_hash", spy)
    return during
