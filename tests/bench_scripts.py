"""The scripts of ``bench/`` imported as modules, for the tests that check their logic on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, monkeypatch: pytest.MonkeyPatch | None = None) -> ModuleType:
    """``bench/<script>`` as a module named ``lutb_bench_<stem>`` (``bench/`` importable while it loads, for the
    scripts that import their siblings). With ``monkeypatch`` the module is registered in ``sys.modules`` for the
    test (a script's dataclasses look their module up there)."""
    name = f"lutb_bench_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, BENCH / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.setitem(sys.modules, name, module)
    sys.path.insert(0, str(BENCH))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCH))
    return module
