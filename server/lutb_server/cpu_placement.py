"""Which CPUs the compute process and the serving processes run on (the ``compute_cpu`` setting).

Why: with ``compute_worker = process`` one thread of one process, the compute process's, feeds the
GPU for every front end, and under load it is the server's busiest thread. It wakes a front end for
every answer, and when every CPU is busy a woken front end may run on the compute process's CPU and
preempt it (bench/wake_preemption.py, bench/results/2026-12-05-wake-preemption-cpu.md). With a CPU of
its own, which the serving processes (and the threads and processes they start) never use, that cannot
happen. On an H100 host with 8 front ends and 64 callers that gave a median 1.09x the tokens/s
(bench/results/2026-12-05-compute-cpu-dma-h100.md).

``auto`` takes the highest CPU that no other server on the machine has taken: each server holds an
exclusive ``flock`` on ``<tmp>/lutb-compute-cpu-<N>.lock`` for the CPU it set aside, so servers started
side by side (one per GPU) set different CPUs aside. Servers in separate containers do not see each
other's locks (each has its own ``/tmp``).

Off by default (``none``): the kernel places every process. Where the server's CPUs are not its own,
a CPU set aside here is still shared with other workloads; with Kubernetes' static CPU manager policy
(a Guaranteed pod with whole CPUs) the pod's CPUs are its own.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

AUTO_MIN_CPUS = 3
"""``auto`` sets a CPU aside only when the process may use at least this many: the serving side keeps two."""

LOCK_NAME = "lutb-compute-cpu-{cpu}.lock"
"""The lock file (in the temporary directory) of a CPU that a server's ``auto`` has set aside."""


def allowed_cpus() -> set[int] | None:
    """The CPUs this thread may run on, or None where the platform cannot tell (no ``sched_getaffinity``)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def auto_candidates(allowed: set[int] | None) -> list[int]:
    """The CPUs ``auto`` may set aside, the first choice first: the highest allowed ones, leaving the serving
    processes two (none when fewer than :data:`AUTO_MIN_CPUS` are allowed)."""
    if allowed is None or len(allowed) < AUTO_MIN_CPUS:
        return []
    return sorted(allowed, reverse=True)[: len(allowed) - 2]


def choose_compute_cpu(setting: str, allowed: set[int] | None) -> int | None:
    """The compute process's CPU for ``setting`` (``none``, ``auto`` or a CPU number), given the ``allowed`` CPUs,
    before any other server's claim (``lutb serve`` checks its setting with it before starting anything).

    ``none``: None. ``auto``: the first of :func:`auto_candidates`, or None. A number: that CPU.

    Raises:
        ValueError: a number where CPU affinity is not supported, not among ``allowed``, or leaving the serving
            processes no CPU.
    """
    if setting == "none":
        return None
    if setting == "auto":
        return next(iter(auto_candidates(allowed)), None)
    cpu = int(setting)
    if allowed is None:
        raise ValueError(f"compute_cpu = {cpu}: this platform cannot pin processes to CPUs")
    if cpu not in allowed:
        raise ValueError(f"compute_cpu = {cpu}: not one of the CPUs this process may use ({_cpu_list(allowed)})")
    if len(allowed) < 2:
        raise ValueError(f"compute_cpu = {cpu}: the only CPU this process may use; the serving processes need another")
    return cpu


def pin_process(cpus: set[int]) -> None:
    """Restrict every thread of this process to ``cpus``; threads and processes they start later inherit it.

    Raises:
        OSError: the kernel refused (e.g. none of ``cpus`` is in the process's cgroup).
    """
    done: set[str] = set()
    while True:  # again until no thread is new: one started meanwhile by a thread not yet moved kept the old CPUs
        tids = set(os.listdir("/proc/self/task")) - done
        if not tids:
            return
        for tid in tids:
            try:
                os.sched_setaffinity(int(tid), cpus)
            except ProcessLookupError:  # the thread ended meanwhile
                pass
        done |= tids


class CpuPlacement:
    """A CPU set aside for the compute process (:func:`set_compute_cpu_aside`), and the lock that claims it for
    ``auto`` (held until :meth:`release`, or until this process ends)."""

    def __init__(self, cpu: int | None, lock_fd: int | None = None) -> None:
        self.cpu = cpu
        self._lock_fd = lock_fd

    def release(self) -> None:
        """Give up the claim (another server's ``auto`` may then take the CPU); idempotent."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the only descriptor drops the flock
            self._lock_fd = None


def set_compute_cpu_aside(setting: str, lock_dir: Path | None = None) -> CpuPlacement:
    """For the process that starts the compute process: choose its CPU and move this process, and so the serving
    processes and threads it starts afterwards, off it. The compute process pins itself to ``.cpu``
    (``WorkerSpec.compute_cpu``; None: no placement).

    ``auto`` claims the first of :func:`auto_candidates` whose lock file in ``lock_dir`` (default: the temporary
    directory) no other process holds; a number is taken as given.

    Raises:
        ValueError: as :func:`choose_compute_cpu`.
    """
    allowed = allowed_cpus()
    lock_fd = None
    if setting == "auto":
        cpu, lock_fd = _claim_first(auto_candidates(allowed), lock_dir or Path(tempfile.gettempdir()))
    else:
        cpu = choose_compute_cpu(setting, allowed)
    if cpu is None:
        if setting == "auto":
            log.info("compute_cpu auto: no CPU set aside (%s CPU(s) allowed, %d needed; or every candidate taken by "
                     "another server)", len(allowed) if allowed is not None else "unknown", AUTO_MIN_CPUS)
        return CpuPlacement(None)
    assert allowed is not None  # a CPU is chosen only where affinity works
    pin_process(allowed - {cpu})
    log.info("CPU %d set aside for the compute process; the serving processes run on %s", cpu, _cpu_list(allowed - {cpu}))
    return CpuPlacement(cpu, lock_fd)


def _claim_first(candidates: list[int], lock_dir: Path) -> tuple[int | None, int | None]:
    """The first of ``candidates`` whose lock this process could take, and the lock's descriptor (kept open)."""
    import fcntl  # POSIX only, like CPU affinity: candidates are empty elsewhere

    for cpu in candidates:
        try:
            fd = os.open(lock_dir / LOCK_NAME.format(cpu=cpu), os.O_CREAT | os.O_RDWR, 0o666)
        except OSError as exc:  # an unwritable directory: no coordination, take the first choice
            log.warning("compute_cpu auto: cannot open a lock in %s (%s); not coordinating with other servers", lock_dir, exc)
            return cpu, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another server holds it
            os.close(fd)
            continue
        return cpu, fd
    return None, None


def _cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


__all__ = ["AUTO_MIN_CPUS", "CpuPlacement", "allowed_cpus", "auto_candidates", "choose_compute_cpu", "pin_process",
           "set_compute_cpu_aside"]
