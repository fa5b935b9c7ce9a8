"""lutb_server.event_loop: uvloop where installed, asyncio's own loop otherwise, same results."""

from __future__ import annotations

import asyncio
import builtins
from typing import Any

import pytest

from lutb_server import event_loop


async def _answer(x: int) -> tuple[int, str]:
    await asyncio.sleep(0)
    return x * 2, type(asyncio.get_running_loop()).__module__


def test_runs_on_uvloop_when_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    value, module = event_loop.run(_answer(21))
    assert value == 42 and module.startswith("uvloop")
    loop = event_loop.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_falls_back_to_asyncio_without_uvloop(monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_uvloop(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "uvloop":
            raise ImportError("no uvloop here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_uvloop)
    value, module = event_loop.run(_answer(4))
    assert value == 8 and module.startswith("asyncio")
    loop = event_loop.new_event_loop()
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_errors_propagate() -> None:
    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        event_loop.run(fail())
