"""A tiny stand-in for pytest, used by bench/run_gpu_tests.py only when pytest is not installed.

Supports what tests/kernels' GPU tests use: ``pytest.mark.<name>`` (incl. ``parametrize``
with ``ids``), module ``pytestmark``, ``pytest.raises(match=)``, ``pytest.skip``,
``pytest.importorskip``, ``pytest.fixture`` (recorded, not injected).
"""

from __future__ import annotations

import importlib
import re


class Skipped(Exception):
    pass


class Mark:
    """``pytest.mark.<name>``: a mark, a decorator, or (called with arguments) a new mark."""

    def __init__(self, name: str, args: tuple = (), kwargs: dict | None = None) -> None:
        self.name, self.args, self.kwargs = name, args, kwargs or {}

    def __call__(self, *args, **kwargs):
        if len(args) == 1 and callable(args[0]) and not kwargs and self.name != "parametrize" or (
            self.args and len(args) == 1 and callable(args[0]) and not kwargs
        ):
            fn = args[0]
            fn.__dict__.setdefault("pytestmark", []).append(self)
            return fn
        return Mark(self.name, args, kwargs)


class _MarkGenerator:
    def __getattr__(self, name: str) -> Mark:
        return Mark(name)


mark = _MarkGenerator()


def skip(reason: str = "") -> None:
    raise Skipped(reason)


def importorskip(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise Skipped(f"{name} not importable") from None


def fixture(*args, **kwargs):
    if len(args) == 1 and callable(args[0]):
        args[0]._is_fixture = True
        return args[0]
    return lambda fn: fixture(fn)


class raises:  # noqa: N801 - pytest's name
    def __init__(self, exc, match: str | None = None) -> None:
        self.exc, self.match = exc, match

    def __enter__(self):
        return self

    def __exit__(self, etype, value, tb):
        if etype is None:
            raise AssertionError(f"DID NOT RAISE {self.exc}")
        if not issubclass(etype, self.exc):
            return False
        if self.match and not re.search(self.match, str(value)):
            raise AssertionError(f"{value!r} does not match {self.match!r}")
        return True
