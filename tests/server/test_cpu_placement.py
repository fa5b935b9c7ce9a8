"""compute_cpu: choosing the compute process's CPU, pinning every thread, and `lutb serve` placing its processes."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import stat
import tempfile
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lutb_server import cpu_placement
from lutb_server.cpu_placement import LOCK_NAME, _claim_first, _cpu_list, allowed_cpus, auto_candidates, choose_compute_cpu, pin_process

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


def _lockable(path: Path) -> bool:
    """Whether a new lock on ``path`` could be taken now (no descriptor anywhere holds one)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def test_lock_files_are_world_readable_whatever_the_umask(tmp_path: Path) -> None:
    """Another user's server must be able to open (and so lock) the file: 0o644 even under umask 077."""
    old = os.umask(0o077)
    try:
        cpu, fd = _claim_first([3, 2], tmp_path)
    finally:
        os.umask(old)
    assert cpu == 3 and fd is not None
    try:
        assert stat.S_IMODE((tmp_path / LOCK_NAME.format(cpu=3)).stat().st_mode) == 0o644
    finally:
        os.close(fd)


LOOP_CASES = {
    # candidates whose lock file cannot be opened (a symlink to itself), candidates another server holds, the claim
    "skipped, not taken unlocked": ([3], [], (2, True)),
    "skipped, the other one held elsewhere: none": ([3], [2], (None, False)),
    "none can be opened: the first, unlocked": ([3, 2], [], (3, False)),
}


@pytest.mark.parametrize(("unopenable", "held", "want"), LOOP_CASES.values(), ids=LOOP_CASES.keys())
def test_a_lock_file_that_cannot_be_opened_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                      unopenable: list[int], held: list[int],
                                                      want: tuple[int | None, bool]) -> None:
    """A candidate whose lock cannot be opened may be another server's: skipped. Only where no candidate's lock can
    be opened at all (no coordination possible) is the first choice taken without a lock, with a warning."""
    for cpu in unopenable:
        os.symlink(LOCK_NAME.format(cpu=cpu), tmp_path / LOCK_NAME.format(cpu=cpu))  # ELOOP
    holders = [_claim_first([cpu], tmp_path) for cpu in held]
    try:
        cpu, fd = _claim_first([3, 2], tmp_path)
        try:
            assert (cpu, fd is not None) == want
        finally:
            if fd is not None:
                os.close(fd)
    finally:
        for _, holder in holders:
            assert holder is not None
            os.close(holder)
    assert any("cannot be opened" in r.getMessage() or "not coordinating" in r.getMessage() for r in caplog.records)


def test_a_claim_that_cannot_pin_gives_the_cpu_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pinning refused: set_compute_cpu_aside raises, and the lock it took is not left held (its descriptor closed)."""
    def refuse(cpus: set[int]) -> None:
        raise OSError("refused")

    monkeypatch.setattr(cpu_placement, "allowed_cpus", lambda: {0, 1, 2, 3, 4})
    monkeypatch.setattr(cpu_placement, "pin_process", refuse)
    with pytest.raises(OSError, match="refused"):
        cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    assert _lockable(tmp_path / LOCK_NAME.format(cpu=4))


def test_release_moves_the_process_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An embedding process goes on after its server: release() gives back the CPUs it had before, once."""
    pinned: list[set[int]] = []
    monkeypatch.setattr(cpu_placement, "allowed_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(cpu_placement, "pin_process", pinned.append)
    placement = cpu_placement.set_compute_cpu_aside("auto", tmp_path)
    assert placement.cpu == 3 and pinned == [{0, 1, 2}]
    placement.release()
    placement.release()
    assert pinned == [{0, 1, 2}, {0, 1, 2, 3}]
    assert _lockable(tmp_path / LOCK_NAME.format(cpu=3))
    cpu_placement.set_compute_cpu_aside("none", tmp_path).release()  # nothing moved, nothing moved back
    assert len(pinned) == 2


NOBODY = 65534

needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                                reason="runs a claim as a second user (nobody): needs root")


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A fresh directory like /tmp (sticky, anyone may write) that the user nobody can reach (pytest's tmp_path is
    under a directory only its owner may enter)."""
    base = Path(tempfile.mkdtemp(prefix="lutb-test-cpu-"))
    try:
        os.chmod(base, 0o1777)
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _as_nobody(work: Callable[[], object]) -> object:
    """``work()``'s result (JSON-able), run in a child process as the user nobody; the child's locks go with it."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            os.write(write, json.dumps(work()).encode())
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and data
    return json.loads(data)


@needs_root
def test_auto_does_not_take_a_cpu_another_users_server_holds(shared_tmp: Path) -> None:
    """Server A (root) holds CPU 3's lock, its file 0o644 and root's; server B (nobody), which may not write the
    file, must still see the lock and take CPU 2, locked."""
    cpu, fd = _claim_first([3, 2], shared_tmp)
    assert cpu == 3 and fd is not None
    try:
        assert _as_nobody(lambda: [(c, f is not None) for c, f in [_claim_first([3, 2], shared_tmp)]]) == [[2, True]]
    finally:
        os.close(fd)


@needs_root
def test_another_users_stale_lock_file_still_coordinates(shared_tmp: Path) -> None:
    """A lock file left behind by another user's server (root's, never removed) still coordinates this user's servers
    side by side: they set different CPUs aside, each with its lock."""
    cpu, fd = _claim_first([3, 2], shared_tmp)
    assert cpu == 3 and fd is not None
    os.close(fd)  # root's server ended
    claims = _as_nobody(lambda: [(c, f is not None) for c, f in [_claim_first([3, 2], shared_tmp) for _ in range(2)]])
    assert claims == [[3, True], [2, True]]


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
