#!/usr/bin/env python3
"""Run ``@pytest.mark.gpu`` tests: through pytest when installed, else a minimal runner.

The device image may lack pytest. Then ``bench/pytest_shim`` stands in for it and this
script collects ``test_*`` functions of the given files, expands ``parametrize`` and runs
the ones marked ``gpu`` (no fixtures). Exit status 1 when any test fails.

    PYTHONPATH=kernels python3 bench/run_gpu_tests.py tests/kernels/test_*.py
"""

from __future__ import annotations

import importlib.util
import itertools
import sys
import time
import traceback
from pathlib import Path

MAX_FAILURES = 5


def main(paths: list[str]) -> int:
    try:
        import pytest  # noqa: F401

        return int(__import__("pytest").main(["-m", "gpu", "-q", "-x", "-p", "no:cacheprovider", *paths]))
    except ImportError:
        pass
    sys.modules.pop("pytest", None)
    sys.path.insert(0, str(Path(__file__).resolve().parent / "pytest_shim"))
    import pytest  # the shim
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: every gpu test skips")
        return 0

    passed = failed = skipped = 0
    for path in paths:
        p = Path(path)
        sys.path.insert(0, str(p.resolve().parent))
        spec = importlib.util.spec_from_file_location(p.stem, p)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except pytest.Skipped as exc:
            print(f"SKIP {path}: {exc}")
            continue
        module_marks = getattr(module, "pytestmark", [])
        module_marks = module_marks if isinstance(module_marks, list) else [module_marks]
        for name, fn in list(vars(module).items()):
            if not name.startswith("test_") or not callable(fn):
                continue
            marks = module_marks + list(getattr(fn, "pytestmark", []))
            if not any(m.name == "gpu" for m in marks):
                continue
            grids = []
            for m in marks:
                if m.name == "parametrize":
                    argnames = [a.strip() for a in m.args[0].split(",")] if isinstance(m.args[0], str) else list(m.args[0])
                    values = [v if len(argnames) > 1 else (v,) for v in m.args[1]]
                    grids.append([dict(zip(argnames, v)) for v in values])
            for combo in itertools.product(*grids) if grids else [()]:
                kwargs = {k: v for d in combo for k, v in d.items()}
                label = f"{p.name}::{name}[{', '.join(f'{k}={v}' for k, v in kwargs.items())}]"
                t0 = time.time()
                try:
                    fn(**kwargs)
                    passed += 1
                except pytest.Skipped as exc:
                    skipped += 1
                    print(f"SKIP {label}: {exc}")
                except Exception:  # noqa: BLE001
                    failed += 1
                    print(f"FAIL {label} ({time.time() - t0:.1f} s)")
                    traceback.print_exc(limit=6)
                    if failed >= MAX_FAILURES:
                        print(f"stopping after {failed} failures")
                        print(f"{passed} passed, {failed} failed, {skipped} skipped (minimal runner: pytest not installed)")
                        return 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped (minimal runner: pytest not installed)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
