"""How long an idle CPU of this machine may take to wake up: the ``cpu_wakeup_latency_us`` setting.

Why: between a lone caller's requests every thread on the request's path sleeps (gRPC's poller, the
event loop, the compute worker or process), and each of them is woken several times per request. A
CPU that went idle meanwhile has entered an idle state, and leaving it costs the wake-up latency of
that state (on a virtual machine a halted vCPU is a VM exit and a wake-up by the host), after which
the request's next steps also run slower than warm. Linux's CPU latency QoS
(Documentation/power/pm_qos_interface.rst in the kernel) lets a process forbid idle states
whose exit latency exceeds a bound, on every CPU, for as long as it keeps ``/dev/cpu_dma_latency``
open with the bound written to it (a 32-bit number of microseconds); 0 leaves idle CPUs polling.

What it gave on the 2-core development VM (guest idle driver ``haltpoll``; fake backend, 16 tokens):
a lone caller's p50 1387-1405 us against 1653-1800 us (compute process, streaming, three interleaved
pairs) and 1461-1471 against 1735-1973 us (thread worker, unary, two pairs), 8 streaming callers
1.06-1.22x the tokens/s; the bare gRPC echo gained as much (bench/results/2026-12-06-cpu-wakeup-cpu.md).

The price: idle CPUs poll instead of sleeping, which costs power (on a virtual machine, host CPU time),
and the request holds for the whole machine, not only for the server's CPUs. Writing the device
needs root; in a container also the device itself (a privileged container, or the device passed in).
So it is off by default (None: the machine's idle states are left alone), and a server that cannot
hold it logs why and serves anyway.

It bounds only the idle states a cpuidle driver manages. A machine without one (``none`` in
``/sys/devices/system/cpu/cpuidle/current_driver``, e.g. the H200 hosts of our device runs, virtual
machines with no guest idle driver) halts an idle CPU whatever the bound says: there it changed
nothing (bench/results/2026-12-06-cpu-wakeup-h200.md), and the hold's note says so.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

DEVICE = Path("/dev/cpu_dma_latency")
"""The kernel's CPU latency QoS device."""

CPUIDLE_DRIVER = Path("/sys/devices/system/cpu/cpuidle/current_driver")
"""Which cpuidle driver manages the idle states (``none``: no states, the architecture's default idle)."""

MAX_LATENCY_US = 2**31 - 1
"""The largest bound the device takes (a signed 32-bit number)."""


class CpuWakeupHold:
    """A bound on every CPU's wake-up latency, held while :attr:`held` (the device stays open) until :meth:`release`.

    Attributes:
        limit_us: the bound asked for, microseconds; None: none asked.
        note: what happened, for the log (held, not asked, or why it could not be held).
    """

    def __init__(self, limit_us: int | None, note: str, fd: int | None = None) -> None:
        self.limit_us = limit_us
        self.note = note
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the bound up (closing the device ends the request); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def cpuidle_driver(path: Path | None = None) -> str | None:
    """The machine's cpuidle driver (e.g. ``intel_idle``, ``haltpoll``; ``none`` where it has none), or None where
    sysfs does not say. ``path``: None for :data:`CPUIDLE_DRIVER`."""
    try:
        return (CPUIDLE_DRIVER if path is None else path).read_text().strip()
    except OSError:
        return None


def hold_cpu_wakeup_latency(limit_us: int | None, device: Path | None = None) -> CpuWakeupHold:
    """Ask that no CPU of this machine take longer than ``limit_us`` microseconds to wake up, until the hold's
    :meth:`~CpuWakeupHold.release` (or this process's end).

    Args:
        limit_us: the bound, 0 to :data:`MAX_LATENCY_US`; None asks for nothing.
        device: the QoS device; None: :data:`DEVICE` (tests pass a file of their own).

    Returns:
        The hold. When the device cannot be opened or written (no such device, no permission), it is not
        :attr:`~CpuWakeupHold.held` and its ``note`` says why: the caller decides whether to go on.

    Raises:
        ValueError: ``limit_us`` outside 0 .. :data:`MAX_LATENCY_US`.
    """
    if limit_us is None:
        return CpuWakeupHold(None, "CPU wake-up latency: left to the machine's idle states")
    if not 0 <= limit_us <= MAX_LATENCY_US:
        raise ValueError(f"cpu_wakeup_latency_us must be 0 to {MAX_LATENCY_US}, got {limit_us}")
    device = DEVICE if device is None else device
    try:
        fd = os.open(device, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as exc:
        return CpuWakeupHold(limit_us, f"CPU wake-up latency NOT bounded: cannot open {device}: {exc.strerror or exc} "
                                       "(needs root, and in a container the device)")
    try:
        os.write(fd, struct.pack("=i", limit_us))  # the kernel reads a native 32-bit int (or a hex string)
    except OSError as exc:
        os.close(fd)
        return CpuWakeupHold(limit_us, f"CPU wake-up latency NOT bounded: {device} refused {limit_us}: {exc.strerror or exc}")
    note = f"CPU wake-up latency bounded at {limit_us} us on every CPU ({device}, while this process holds it)"
    if cpuidle_driver() == "none":  # e.g. a VM without a guest idle driver: it halts, whatever the bound says
        note += "; but this machine has no cpuidle driver (idle is the architecture's default halt), so the bound changes nothing"
    return CpuWakeupHold(limit_us, note, fd)


__all__ = ["CPUIDLE_DRIVER", "DEVICE", "MAX_LATENCY_US", "CpuWakeupHold", "cpuidle_driver", "hold_cpu_wakeup_latency"]
