"""cpu_wakeup_latency_us: the CPU latency QoS request held on /dev/cpu_dma_latency (a file of the test's own here)."""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from lutb_server import cpu_wakeup
from lutb_server.cpu_wakeup import MAX_LATENCY_US, cpuidle_driver, hold_cpu_wakeup_latency






@pytest.mark.parametrize("limit", [0, 1, 250, MAX_LATENCY_US])
def test_the_bound_is_written_and_held_until_released(tmp_path: Path, limit: int, open_here: Callable[[Path], int]) -> None:
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    hold = hold_cpu_wakeup_latency(limit, device)
    assert hold.held and hold.limit_us == limit
    assert device.read_bytes() == struct.pack("=i", limit)  # the kernel's binary form: one native 32-bit int
    assert open_here(device) == 1  # the request lasts while the device is open
    assert f"bounded at {limit} us" in hold.note
    hold.release()
    hold.release()  # idempotent
    assert not hold.held and open_here(device) == 0


@pytest.mark.parametrize(("driver", "changes_nothing"), [("none\n", True), ("haltpoll\n", False), (None, False)])
def test_the_note_says_when_no_idle_driver_can_take_the_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               driver: str | None, changes_nothing: bool) -> None:
    sysfs = tmp_path / "current_driver"
    if driver is not None:
        sysfs.write_text(driver)
    monkeypatch.setattr(cpu_wakeup, "CPUIDLE_DRIVER", sysfs)
    assert cpuidle_driver() == (driver.strip() if driver else None)
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    hold = hold_cpu_wakeup_latency(0, device)
    assert hold.held and ("changes nothing" in hold.note) == changes_nothing
    hold.release()


def test_nothing_asked_opens_nothing(tmp_path: Path) -> None:
    device = tmp_path / "absent"
    hold = hold_cpu_wakeup_latency(None, device)
    assert not hold.held and hold.limit_us is None and not device.exists()
    assert "left to the machine" in hold.note
    hold.release()


@pytest.mark.parametrize("make", ["missing", "directory"])
def test_a_device_that_cannot_be_opened_is_reported_not_raised(tmp_path: Path, make: str) -> None:
    device = tmp_path / "cpu_dma_latency"
    if make == "directory":
        device.mkdir()
    hold = hold_cpu_wakeup_latency(0, device)
    assert not hold.held and hold.limit_us == 0
    assert "NOT bounded" in hold.note and str(device) in hold.note


@pytest.mark.parametrize("limit", [-1, MAX_LATENCY_US + 1])
def test_bounds_out_of_range_are_refused(tmp_path: Path, limit: int) -> None:
    with pytest.raises(ValueError, match="cpu_wakeup_latency_us must be 0 to"):
        hold_cpu_wakeup_latency(limit, tmp_path / "cpu_dma_latency")


def test_the_setting() -> None:
    from pydantic import ValidationError

    from lutb_server.settings import ServerSettings

    assert ServerSettings().cpu_wakeup_latency_us is None  # off by default: it binds the whole machine
    assert ServerSettings(cpu_wakeup_latency_us=0).cpu_wakeup_latency_us == 0
    for bad in (-1, MAX_LATENCY_US + 1, "soon"):
        with pytest.raises(ValidationError, match="cpu_wakeup_latency_us"):
            ServerSettings(cpu_wakeup_latency_us=bad)


def test_the_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from lutb_server.cli import serve_cmd

    parser = argparse.ArgumentParser()
    serve_cmd.register(parser.add_subparsers())
    monkeypatch.setenv("LUTB_CPU_WAKEUP_LATENCY_US", "5")
    assert serve_cmd.settings_from_args(parser.parse_args(["serve"])).cpu_wakeup_latency_us == 5
    assert serve_cmd.settings_from_args(parser.parse_args(["serve", "--cpu-wakeup-latency-us", "0"])).cpu_wakeup_latency_us == 0


@pytest.mark.parametrize("usable", [True, False])
def test_the_server_holds_the_bound_while_it_runs(tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture, usable: bool,
                                                   open_here: Callable[[Path], int]) -> None:
    """Held from start to stop; a device the server cannot open is a warning, and the server serves anyway."""
    from lutb_client import ExpertClient
    from lutb_server.testing import ServerThread

    device = tmp_path / "cpu_dma_latency"
    if usable:
        device.write_bytes(b"")
    monkeypatch.setattr(cpu_wakeup, "DEVICE", device)
    caplog.set_level(logging.INFO, logger="lutb_server.app")
    with ServerThread(checkpoint=tiny_checkpoint, cpu_wakeup_latency_us=0) as server:
        with ExpertClient(server.address) as client:
            assert client.model_info().layers  # serving
        if usable:
            assert device.read_bytes() == struct.pack("=i", 0) and open_here(device) == 1
    assert open_here(device) == 0
    notes = [r for r in caplog.records if "CPU wake-up latency" in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in caplog.records]
    assert notes[0].levelno == (logging.INFO if usable else logging.WARNING)
