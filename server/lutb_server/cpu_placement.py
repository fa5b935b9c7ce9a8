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
side by side (one per GPU) set different CPUs aside, whichever users they run as (the lock files are
world-readable, and a lock needs only read access). Servers in separate containers do not see each
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
    ``auto`` (held until :meth:`release`, or until this process ends).

    ``unpinned``: the CPUs this process ran on before it moved off ``cpu``, given back by :meth:`release`
    (None: it was not moved)."""

    def __init__(self, cpu: int | None, lock_fd: int | None = None, unpinned: set[int] | None = None) -> None:
        self.cpu = cpu
        self._lock_fd = lock_fd
        self._unpinned = unpinned

    def release(self) -> None:
        """Give up the claim (another server's ``auto`` may then take the CPU) and move this process back onto the
        CPUs it had (an embedding process, e.g. a test's or a benchmark's, goes on after its server); idempotent."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the only descriptor drops the flock
            self._lock_fd = None
        if self._unpinned is not None:
            unpinned, self._unpinned = self._unpinned, None
            try:
                pin_process(unpinned)
            except OSError as exc:  # e.g. the process's cgroup shrank meanwhile: it stays where it is
                log.warning("compute_cpu: cannot move this process back onto CPUs %s (%s)", _cpu_list(unpinned), exc)


def set_compute_cpu_aside(setting: str, lock_dir: Path | None = None) -> CpuPlacement:
    """For the process that starts the compute process: choose its CPU and move this process, and so the serving
    processes and threads it starts afterwards, off it. The compute process pins itself to ``.cpu``
    (``WorkerSpec.compute_cpu``; None: no placement).

    ``auto`` claims the first of :func:`auto_candidates` whose lock file in ``lock_dir`` (default: the temporary
    directory) no other process holds (see :func:`_claim_first`); a number is taken as given.

    Raises:
        ValueError: as :func:`choose_compute_cpu`.
        OSError: as :func:`pin_process` (the CPU's lock is given back first).
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
    try:
        pin_process(allowed - {cpu})
    except BaseException:
        if lock_fd is not None:  # no placement to release it: give the CPU back now
            os.close(lock_fd)
        raise
    log.info("CPU %d set aside for the compute process; the serving processes run on %s", cpu, _cpu_list(allowed - {cpu}))
    return CpuPlacement(cpu, lock_fd, unpinned=allowed)


def _claim_first(candidates: list[int], lock_dir: Path) -> tuple[int | None, int | None]:
    """The first of ``candidates`` whose lock this process could take, and the lock's descriptor (kept open).

    A lock file is opened read-only (``flock`` needs no write access), so one that another user's server created,
    or left behind, still coordinates with it; a missing one is created with mode 0o644 whatever the umask (empty,
    world-readable: any user's server can lock it). A candidate whose lock file cannot be opened (or created) is
    skipped, not taken unlocked: another server may hold it. Only when no candidate's lock file can be opened at all
    (e.g. an unwritable directory without them) is the first candidate taken without a lock, with a warning.
    """
    import fcntl  # POSIX only, like CPU affinity: candidates are empty elsewhere

    claimed: tuple[int | None, int | None] = (None, None)
    unopened: list[str] = []
    for cpu in candidates:
        try:
            fd = _open_lock(lock_dir / LOCK_NAME.format(cpu=cpu))
        except OSError as exc:  # e.g. another user's file it may not read: skipped, another server may hold it
            unopened.append(f"CPU {cpu}: {exc.strerror or exc}")
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another server holds it
            os.close(fd)
            continue
        claimed = cpu, fd
        break
    if candidates and len(unopened) == len(candidates):  # e.g. an unwritable directory: take the first choice
        log.warning("compute_cpu auto: cannot open a lock in %s (%s); not coordinating with other servers", lock_dir,
                    "; ".join(unopened))
        return candidates[0], None
    if unopened:
        log.warning("compute_cpu auto: skipped CPU(s) whose lock in %s cannot be opened (%s)", lock_dir, "; ".join(unopened))
    return claimed


def _open_lock(path: Path) -> int:
    """A read-only descriptor of the lock file ``path``, created (mode 0o644) if missing.

    Raises:
        OSError: it cannot be opened or created.
    """
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        pass
    try:  # O_EXCL: never O_CREAT on a file that exists (fs.protected_regular refuses it in sticky directories)
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:  # another server created it meanwhile
        return os.open(path, os.O_RDONLY)
    try:
        os.fchmod(fd, 0o644)  # whatever the umask: other users' servers must be able to open it
    except OSError:
        pass  # the owner's servers still coordinate
    return fd


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
