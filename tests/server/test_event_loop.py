"""lutb_server.event_loop: uvloop where installed, asyncio's own loop otherwise, same results."""

from __future__ import annotations

import asyncio
import builtins
from pathlib import Path
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


def test_asyncio_kind_ignores_an_installed_uvloop() -> None:
    value, module = event_loop.run(_answer(5), "asyncio")
    assert value == 10 and module.startswith("asyncio")
    loop = event_loop.new_event_loop("asyncio")
    try:
        assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()


def test_unknown_kind_is_refused() -> None:
    coro = _answer(1)
    with pytest.raises(ValueError, match="uvloop' or 'asyncio'"):
        event_loop.run(coro, "trio")  # type: ignore[arg-type]
    coro.close()


def test_setting_picks_the_loop_and_the_server_answers_on_it(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``event_loop = asyncio`` (here from LUTB_EVENT_LOOP) serves on asyncio's own loop, with the reference's results."""
    import torch

    from lutb_client import ExpertClient
    from lutb_kernels.checkpoint import Checkpoint
    from lutb_kernels.experts.reference import ReferenceExperts
    from lutb_server.settings import ServerSettings
    from lutb_server.testing import ServerThread

    monkeypatch.setenv("LUTB_EVENT_LOOP", "asyncio")
    assert ServerSettings(checkpoint=tiny_checkpoint).event_loop == "asyncio"
    monkeypatch.setenv("LUTB_EVENT_LOOP", "libuv")
    with pytest.raises(ValueError, match="event_loop"):
        ServerSettings(checkpoint=tiny_checkpoint)
    monkeypatch.delenv("LUTB_EVENT_LOOP")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=gen).to(torch.bfloat16)
    ids = torch.rand(5, 8, generator=gen).argsort(dim=1)[:, :2].to(torch.int32)
    w = torch.rand(5, 2, generator=gen)
    ckpt = Checkpoint(tiny_checkpoint)
    expected = ReferenceExperts(ckpt.config, ckpt.layer(0), "cpu").forward(x, ids, w)
    with ServerThread(checkpoint=tiny_checkpoint, event_loop="asyncio") as node, ExpertClient(node.address) as client:
        assert type(node.loop).__module__.startswith("asyncio")
        out = client.forward(0, x, ids, w)
    assert torch.equal(out, expected)
