"""lutb_kernels.devices.resolve_compute_device: the offline tools' and the local reference's reading of a device name."""

from __future__ import annotations

import pytest
import torch

from lutb_kernels.devices import resolve_compute_device

# (asked, host has CUDA, its device count, the device or the error's text)
CASES = [
    (None, False, 0, torch.device("cpu")),
    ("auto", False, 0, torch.device("cpu")),
    ("auto", True, 2, torch.device("cuda")),
    ("cpu", True, 2, torch.device("cpu")),
    (torch.device("cpu"), False, 0, torch.device("cpu")),
    ("cuda", True, 1, torch.device("cuda")),
    ("cuda:1", True, 2, torch.device("cuda", 1)),
    ("gpu", True, 1, "device 'gpu' is not a device name (expected cpu, cuda or cuda:N)"),
    ("", False, 0, "device '' is not a device name"),
    ("meta", True, 1, "device 'meta': the tool under test runs on cpu or cuda (cuda:N)"),
    ("cuda", False, 0, "device 'cuda': CUDA is not available on this host"),
    ("cuda:0", False, 0, "device 'cuda:0': CUDA is not available on this host"),
    ("cuda:2", True, 2, "device 'cuda:2': this host has 2 CUDA device(s) (cuda:0..cuda:1)"),
]


@pytest.mark.parametrize(("asked", "cuda", "count", "want"), CASES, ids=[str(c[0]) + "-" + str(c[2]) for c in CASES])
def test_resolve_compute_device(monkeypatch: pytest.MonkeyPatch, asked, cuda: bool, count: int, want) -> None:  # noqa: ANN001
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    if isinstance(want, torch.device):
        assert resolve_compute_device(asked, who="the tool under test") == want
    else:
        with pytest.raises(ValueError) as err:
            resolve_compute_device(asked, who="the tool under test")
        assert str(err.value).startswith(want), str(err.value)
