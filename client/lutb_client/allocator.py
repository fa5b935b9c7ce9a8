"""glibc malloc thresholds for processes that move large messages: the server's processes, and clients.

The server applies :func:`tune_malloc` in each of its processes (serving processes, the compute
process). A client process that sends or receives 128+ tokens per request gains the same from
calling it once at start-up (or from the equivalent ``GLIBC_TUNABLES``, see docs/performance.md); the
client library never calls it by itself, since it changes the whole process's allocator.

A request or response of 128+ tokens is a 0.5+ MB buffer, and each one goes through several
short-lived copies (the gRPC message, ``bytes`` of a tensor field, serialisation). With glibc's
defaults, freeing such a buffer often gives its pages back to the kernel (the heap top is trimmed
above ``M_TRIM_THRESHOLD``, and blocks above ``M_MMAP_THRESHOLD`` are unmapped on free, the
thresholds adapting only up to a point), so the next one is faulted in again page by page. On the
CPU sandbox, serialising one 512 KB ``ForwardResponse`` took ~500 us and ~250 page faults in a
loop instead of ~25 us, 2 MB ~1.9 ms instead of ~0.1 ms
(bench/results/2026-12-05-malloc-thresholds-cpu.md).

:func:`tune_malloc` raises both thresholds once per process: blocks up to 32 MiB (glibc's
largest mmap threshold on 64-bit) come from the heap, and up to 64 MiB of free memory at its top
stays mapped. The price is resident memory a process does not return at once (at most the
trim threshold beyond its peak heap use), small beside a GPU server's. A ``GLIBC_TUNABLES``
that sets malloc tunables, or the ``MALLOC_*_`` variables, take precedence: then nothing is
changed (the environment is how to opt out, or to choose other values).
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks smaller than this come from the heap (glibc's ``M_MMAP_THRESHOLD``; 32 MiB is its 64-bit maximum)."""
TRIM_THRESHOLD_BYTES = 64 << 20
"""Free memory at the heap's top kept mapped up to this much (glibc's ``M_TRIM_THRESHOLD``)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_ENVIRONMENT = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def tune_malloc() -> str:
    """Raise glibc's mmap and trim thresholds for this process (see the module docstring); returns what was done,
    for the log.

    Idempotent; cheap. Does nothing off glibc, or when the environment sets malloc tunables.
    """
    if platform.libc_ver()[0] != "glibc":
        return "malloc thresholds: not glibc, left as they are"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(os.environ.get(name) for name in _ENVIRONMENT):
        return "malloc thresholds: set by the environment (GLIBC_TUNABLES / MALLOC_*_), left as they are"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc thresholds: mallopt not found, left as they are"
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return "malloc thresholds: mallopt refused, left as they are"
    return f"malloc thresholds: mmap {MMAP_THRESHOLD_BYTES >> 20} MiB, trim {TRIM_THRESHOLD_BYTES >> 20} MiB"


__all__ = ["MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "tune_malloc"]
