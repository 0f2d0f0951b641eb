"""The NemoGym actor's HTTP pool never closes a kept-alive connection it has just handed to a call.

httpcore 1.0 (httpx's pool) closes the connections it finds expired one after another, and a call
it handed one of them to a moment before may already be sending on it when its turn comes: the
call fails with ``ReadError``. At 100 servers this failed every scale run's restore (or commit) of
the agents, all called at once on connections left idle since discovery. The actor's pool has no
expiry (``coordinator.gym_actor.KEEPALIVE_EXPIRY_S``), so it closes none of its own accord.

The race is made certain here, not waited for: httpcore's clock jumps by an hour between the first
ten calls of a fan-out being handed their connections and the next call's turn at the pool.
"""

from __future__ import annotations

import asyncio
import time

import httpcore._async.http11 as httpcore_http11
import pytest

from coordinator import gym_actor
from coordinator.gym_actor import NemoGym

SERVERS = 20
HANDED_BEFORE_THE_JUMP = 10


class _JumpingClock:
    """``time`` for httpcore's HTTP/1.1 connections: the real monotonic clock plus ``offset``."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A keep-alive HTTP/1.1 server: 200 ``{}`` to every request on the connection, until it closes."""
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            await reader.readexactly(length)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


async def _fan_out_across_a_clock_jump(clock: _JumpingClock) -> list[object]:
    servers = [await asyncio.start_server(_answer_ok, "127.0.0.1", 0) for _ in range(SERVERS)]
    urls = [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in servers]
    nemo = NemoGym(urls, "t")

    async def call(url: str) -> object:
        try:
            return (await nemo.http.post(f"{url}/ng-control/v1/agent-checkpoint/restore", content=b"{}")).status_code
        except Exception as exc:  # noqa: BLE001 - the outcome is what is asserted
            return repr(exc)

    async def jump() -> str:
        clock.offset += 3600.0  # every idle connection is now long past any expiry
        return "jump"

    try:
        first = await asyncio.gather(*(call(u) for u in urls))  # one idle kept-alive connection per server
        assert first == [200] * SERVERS
        # gather starts the calls in this order: the first ten are handed their idle connections, the
        # clock jumps, and the next call's turn at the pool finds every idle connection expired
        out = await asyncio.gather(*(call(u) for u in urls[:HANDED_BEFORE_THE_JUMP]), jump(),
                                   *(call(u) for u in urls[HANDED_BEFORE_THE_JUMP:]))
    finally:
        await nemo.close()
        for s in servers:
            s.close()
            await s.wait_closed()
    out.remove("jump")
    return out


@pytest.mark.parametrize("expiry", [gym_actor.KEEPALIVE_EXPIRY_S, 2.0], ids=["the actor's", "a 2 s expiry"])
def test_no_call_loses_its_connection_to_the_pools_expiry(expiry: float | None,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _JumpingClock()
    monkeypatch.setattr(httpcore_http11, "time", clock)
    monkeypatch.setattr(gym_actor, "KEEPALIVE_EXPIRY_S", expiry)
    out = asyncio.run(_fan_out_across_a_clock_jump(clock))
    if expiry is None:
        assert out == [200] * SERVERS
    else:  # httpcore's race; should it be mended, this fails, and an expiry may come back
        assert any("ReadError" in str(o) for o in out[:HANDED_BEFORE_THE_JUMP]), out
