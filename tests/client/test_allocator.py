"""lutb_client.allocator: glibc's malloc thresholds raised once per process, unless the environment says."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from lutb_client import allocator

ROOT = Path(__file__).resolve().parents[2]
GLIBC = platform.libc_ver()[0] == "glibc"

# Serialises a 2 MB ForwardResponse 40 times in a fresh process, after tune_malloc() when asked, and prints
# tune_malloc's answer and the minor page faults per serialisation (the last 30).
_PROBE = """
import os, resource, sys
from lutb_client._proto.lutb.v1 import expert_service_pb2 as pb
from lutb_client.allocator import tune_malloc
said = tune_malloc() if sys.argv[1] == "tune" else "-"
data = os.urandom(2 << 20)
def once():
    r = pb.ForwardResponse(request_id=1)
    r.output.data = data
    return len(r.SerializeToString())
for _ in range(10):
    once()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    once()
print(said)
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 30)
"""


def _probe(mode: str, **env: str) -> tuple[str, float]:
    environ = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    environ["PYTHONPATH"] = os.pathsep.join(str(ROOT / d) for d in ("kernels", "client", "server"))
    proc = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120,
                          env={**environ, **env}, check=True)
    said, faults = proc.stdout.strip().splitlines()[-2:]
    return said, float(faults)


@pytest.mark.skipif(not GLIBC, reason="glibc only")
def test_large_messages_stop_faulting_once_tuned() -> None:
    said, faults = _probe("tune")
    assert said == "malloc thresholds: mmap 32 MiB, trim 64 MiB"
    # a 2 MB message and its serialisation (~1000 pages) no longer come fresh from the kernel each time
    assert faults < 50, faults


@pytest.mark.skipif(not GLIBC, reason="glibc only")
@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"},
                                 {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_the_environment_takes_precedence(env: dict[str, str]) -> None:
    said, _ = _probe("tune", **env)
    assert said.startswith("malloc thresholds: set by the environment")


def test_other_c_libraries_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.platform, "libc_ver", lambda: ("", ""))
    assert allocator.tune_malloc() == "malloc thresholds: not glibc, left as they are"
