"""compute_cpu: choosing the compute process's CPU, pinning every thread, and `lutb serve` placing its processes."""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

import pytest

from lutb_server import cpu_placement
from lutb_server.cpu_placement import _cpu_list, allowed_cpus, auto_candidates, choose_compute_cpu, pin_process

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")

CHOOSE_CASES = {
    # setting, allowed CPUs, the CPU chosen (or the error's words)
    "none": ("none", {0, 1, 2, 3}, None),
    "none without affinity": ("none", None, None),
    "auto takes the highest": ("auto", {0, 1, 2, 7}, 7),
    "auto with two CPUs sets none aside": ("auto", {0, 1}, None),
    "auto without affinity": ("auto", None, None),
    "a number": ("2", {0, 1, 2, 3}, 2),
    "the lowest of two": ("0", {0, 1}, 0),
    "a CPU not allowed": ("5", {0, 1, 2, 3}, "not one of the CPUs this process may use (0-3)"),
    "the only CPU": ("0", {0}, "the serving processes need another"),
    "a number without affinity": ("1", None, "cannot pin"),
}


@pytest.mark.parametrize(("setting", "allowed", "want"), CHOOSE_CASES.values(), ids=CHOOSE_CASES.keys())
def test_choose_compute_cpu(setting: str, allowed: set[int] | None, want: int | str | None) -> None:
    if isinstance(want, str):
        with pytest.raises(ValueError, match=re.escape(want)):
            choose_compute_cpu(setting, allowed)
    else:
        assert choose_compute_cpu(setting, allowed) == want


@pytest.mark.parametrize(("allowed", "want"), [
    (None, []), ({0, 1}, []), ({0, 1, 2}, [2]), ({0, 1, 2, 3}, [3, 2]), ({4, 9, 2, 7, 1}, [9, 7, 4]),
])
def test_auto_leaves_the_serving_processes_two_cpus(allowed: set[int] | None, want: list[int]) -> None:
    assert auto_candidates(allowed) == want


def test_auto_claims_a_cpu_no_other_server_holds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers side by side (one per GPU) set different CPUs aside: each holds a lock on its CPU until it releases
    it; when every candidate is taken, none is set aside. A number is taken as given, without a lock."""
    pinned: list[set[int]] = []
    monkeypatch.setattr(cpu_placement, "allowed_cpus", lambda: {0, 1, 2, 3, 4})
    monkeypatch.setattr(cpu_placement, "pin_process", pinned.append)  # this test process stays where it is
    first = cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    second = cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    third = cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    assert (first.cpu, second.cpu, third.cpu) == (4, 3, 2)
    assert pinned == [{0, 1, 2, 3}, {0, 1, 2, 4}, {0, 1, 3, 4}]
    assert cpu_placement.set_compute_cpu_aside("auto", tmp_path).cpu is None  # 0 and 1 stay with the serving side
    second.release()
    second.release()  # idempotent
    again = cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    assert again.cpu == 3
    assert cpu_placement.set_compute_cpu_aside("4", tmp_path).cpu == 4  # as given: no lock asked
    assert cpu_placement.set_compute_cpu_aside("none", tmp_path).cpu is None
    for placement in (first, third, again):
        placement.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"lutb-compute-cpu-{c}.lock" for c in (2, 3, 4)]


@pytest.mark.parametrize(("cpus", "text"), [({0}, "0"), ({0, 1, 2}, "0-2"), ({0, 1, 2, 5, 7, 8}, "0-2,5,7-8"), ({3, 1}, "1,3")])
def test_cpu_list(cpus: set[int], text: str) -> None:
    assert _cpu_list(cpus) == text


@pytest.mark.parametrize(("value", "want"), [("none", "none"), ("AUTO", "auto"), (" 3 ", "3"), ("07", "7"), (4, "4")])
def test_the_setting_is_normalised(value: object, want: str) -> None:
    from lutb_server.settings import ServerSettings

    assert ServerSettings(compute_worker="process", compute_cpu=value).compute_cpu == want


@pytest.mark.parametrize("value", ["-1", "first", "1.5", ""])
def test_bad_settings_are_refused(value: str) -> None:
    from pydantic import ValidationError

    from lutb_server.settings import ServerSettings

    with pytest.raises(ValidationError, match="compute_cpu must be none, auto or a CPU number"):
        ServerSettings(compute_worker="process", compute_cpu=value)


def test_compute_cpu_needs_the_compute_process() -> None:
    from pydantic import ValidationError

    from lutb_server.settings import ServerSettings

    with pytest.raises(ValidationError, match="needs compute_worker = process"):
        ServerSettings(compute_cpu="auto")
    assert ServerSettings(compute_cpu="none").compute_cpu == "none"


@needs_affinity
def test_pin_process_moves_every_thread() -> None:
    """Threads already running are moved too (sched_setaffinity of pid 0 would move only the caller), and a thread
    started afterwards inherits the CPUs."""
    before = allowed_cpus()
    assert before is not None
    target = {min(before)}
    stop = threading.Event()
    started = threading.Event()
    ids: list[int] = []

    def wait() -> None:
        ids.append(threading.get_native_id())
        started.set()
        stop.wait(30)

    running = threading.Thread(target=wait)
    running.start()
    started.wait(10)
    try:
        pin_process(target)
        assert os.sched_getaffinity(0) == target and os.sched_getaffinity(ids[0]) == target
        later: list[set[int]] = []
        thread = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))
        thread.start()
        thread.join(10)
        assert later == [target]
    finally:
        pin_process(before)
        stop.set()
        running.join(10)
    assert os.sched_getaffinity(0) == before


def _allowed_list(pid: int, tid: int | None = None) -> set[int]:
    """The CPUs a process (or one of its threads) may run on, from /proc."""
    status = Path(f"/proc/{pid}/task/{tid}/status" if tid else f"/proc/{pid}/status").read_text()
    text = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M).group(1)  # type: ignore[union-attr]
    cpus: set[int] = set()
    for part in text.split(","):
        a, _, b = part.partition("-")
        cpus.update(range(int(a), int(b or a) + 1))
    return cpus


@needs_affinity
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True, reason="needs 2 CPUs")
@pytest.mark.parametrize("front_ends", [1, 2])
def test_lutb_serve_sets_a_cpu_aside_for_the_compute_process(tiny_checkpoint: Path, front_ends: int) -> None:
    """`--compute-cpu N`: the compute process (every thread of it) runs on CPU N only; the serving processes (every
    thread of each) on the others. With one front end the compute process is started from a worker thread of the
    serving process, with two from its main thread."""
    from lutb_server.testing import ServeProcess

    allowed = os.sched_getaffinity(0)
    cpu = max(allowed)
    serving = ServeProcess("--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--front-ends",
                           str(front_ends), "--compute-cpu", str(cpu), "--no-validate-checkpoint").wait_ready()
    try:
        compute = int(next(m for m in (re.search(r"compute process (\d+) ready", line) for line in serving.lines) if m).group(1))
        serving_pids = [serving.pid]
        if front_ends > 1:
            serving_pids.append(int(next(m for m in (re.search(r"pids \[(\d+)\]", line) for line in serving.lines
                                                     if "front ends 1-1 started" in line) if m).group(1)))
        for pid, want in ((compute, {cpu}), *((p, allowed - {cpu}) for p in serving_pids)):
            for tid in os.listdir(f"/proc/{pid}/task"):
                assert _allowed_list(pid, int(tid)) == want, (pid, tid, want)
        assert any(f"CPU {cpu} set aside for the compute process" in line for line in serving.lines), "".join(serving.lines)
        assert serving.stop(60) == 0, "".join(serving.lines)
    finally:
        serving.kill()


def test_lutb_serve_refuses_a_cpu_it_may_not_use(tiny_checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lutb_server.cli import main

    assert main(["serve", "--checkpoint", str(tiny_checkpoint), "--compute-worker", "process", "--compute-cpu", "4095"]) == 2
    assert "compute_cpu = 4095" in capsys.readouterr().err
