"""Which CPUs the compute process and the serving processes run on (the ``compute_cpu`` setting).

Why: with ``compute_worker = process`` one thread of one process, the compute process's, feeds the
GPU for every front end, and under load it is the server's busiest thread. It wakes a front end for
every answer, and when every CPU is busy a woken front end may run on the compute process's CPU and
preempt it (bench/wake_preemption.py, bench/results/2026-12-05-wake-preemption-cpu.md). With a CPU of
its own, which the serving processes (and the threads and processes they start) never use, that cannot
happen.

Off by default (``none``): the kernel places every process. Where the server's CPUs are not its own,
a CPU set aside here is still shared with other workloads, and two servers on one machine with ``auto``
set the same CPU aside; with Kubernetes' static CPU manager policy (a Guaranteed pod with whole CPUs)
the pod's CPUs are its own.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

AUTO_MIN_CPUS = 3
"""``auto`` sets a CPU aside only when the process may use at least this many: the serving side keeps two."""


def allowed_cpus() -> set[int] | None:
    """The CPUs this thread may run on, or None where the platform cannot tell (no ``sched_getaffinity``)."""
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None


def choose_compute_cpu(setting: str, allowed: set[int] | None) -> int | None:
    """The compute process's CPU for ``setting`` (``none``, ``auto`` or a CPU number), given the ``allowed`` CPUs.

    ``none``: None. ``auto``: the highest allowed CPU when at least :data:`AUTO_MIN_CPUS` are allowed, else None.
    A number: that CPU.

    Raises:
        ValueError: a number where CPU affinity is not supported, not among ``allowed``, or leaving the serving
            processes no CPU.
    """
    if setting == "none":
        return None
    if setting == "auto":
        return max(allowed) if allowed is not None and len(allowed) >= AUTO_MIN_CPUS else None
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


def set_compute_cpu_aside(setting: str) -> int | None:
    """For the process that starts the compute process: choose its CPU (:func:`choose_compute_cpu`) and move this
    process, and so the serving processes and threads it starts afterwards, off it. Returns the CPU (None: no
    placement); the compute process pins itself to it (``WorkerSpec.compute_cpu``)."""
    allowed = allowed_cpus()
    cpu = choose_compute_cpu(setting, allowed)
    if cpu is None:
        if setting == "auto":
            log.info("compute_cpu auto: %s CPU(s) allowed, fewer than %d: no CPU set aside",
                     len(allowed) if allowed is not None else "unknown", AUTO_MIN_CPUS)
        return None
    assert allowed is not None  # choose_compute_cpu returns a CPU only where affinity works
    pin_process(allowed - {cpu})
    log.info("CPU %d set aside for the compute process; the serving processes run on %s", cpu, _cpu_list(allowed - {cpu}))
    return cpu


def _cpu_list(cpus: set[int]) -> str:
    """``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


__all__ = ["AUTO_MIN_CPUS", "allowed_cpus", "choose_compute_cpu", "pin_process", "set_compute_cpu_aside"]
