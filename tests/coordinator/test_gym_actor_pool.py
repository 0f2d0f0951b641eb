"""The NemoGym actor's control calls that must not be sent twice never ride a kept-alive connection.

httpcore 1.0 (httpx's pool) closes the connections it finds expired one after another, and a call
it handed one of them to a moment before may already be sending on it when its turn comes: the
call fails with ``ReadError``. At 100 servers this failed every scale run's restore (or commit) of
the agents, all called at once on connections left idle since discovery. With no expiry instead, a
server's own keep-alive close can meet a call as it is sent (once in a 100,000-rollout run: a
prepare). So the calls that are not sent again (prepare, commit, restore, resume...) go through a
second pool, each on a connection of its own closed after its answer
(``gymkit.control_client.ONE_CONNECTION_PER_CALL``); the idempotent ones keep the kept-alive pool
and are sent once more if a connection drops under them.

The race is made certain here, not waited for: httpcore's clock jumps by an hour between the first
ten calls of a fan-out being handed their connections and the next call's turn at the pool.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpcore._async.http11 as httpcore_http11
import pytest

from coordinator.gym_actor import NemoGym
from gymkit.control_client import AsyncControlClient, ControlCallError
from tests.loopback_http import read_request, write_response

SERVERS = 20
HANDED_BEFORE_THE_JUMP = 10
PATH = "/ng-control/v1/agent-checkpoint/restore"


class _JumpingClock:
    """``time`` for httpcore's HTTP/1.1 connections: the real monotonic clock plus ``offset``."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


class _Servers:
    """``SERVERS`` keep-alive HTTP/1.1 servers on loopback answering 200 ``{}``; each request's
    ``connection`` header is kept (closing the connection after the answer when it says so)."""

    def __init__(self) -> None:
        self.connection_headers: list[str] = []
        self._servers: list[asyncio.base_events.Server] = []

    async def __aenter__(self) -> list[str]:
        self._servers = [await asyncio.start_server(self._serve, "127.0.0.1", 0) for _ in range(SERVERS)]
        return [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in self._servers]

    async def __aexit__(self, *exc: object) -> None:
        for s in self._servers:
            s.close()
            await s.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                connection = (await read_request(reader)).headers.get("connection", "").lower()
                self.connection_headers.append(connection)
                await write_response(writer, close=connection == "close")
                if connection == "close":
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


async def _across_a_clock_jump(clock: _JumpingClock, urls: list[str], warm: Callable[[str], Awaitable[object]],
                               call: Callable[[str], Awaitable[object]]) -> list[object]:
    """``warm`` every server once (leaving a kept-alive connection to each behind), then ``call``
    every server with httpcore's clock jumping after the first ``HANDED_BEFORE_THE_JUMP`` calls are
    handed their connections."""

    async def outcome(url: str) -> object:
        try:
            return await call(url)
        except (ControlCallError, Exception) as exc:  # noqa: BLE001 - the outcome is what is asserted
            return repr(exc)

    async def jump() -> str:
        clock.offset += 3600.0  # every idle connection is now long past any expiry
        return "jump"

    assert await asyncio.gather(*(warm(u) for u in urls)) == [200] * SERVERS
    # gather starts the calls in this order: the first ten are handed their connections, the clock
    # jumps, and the next call's turn at the pool finds every idle connection expired
    out = await asyncio.gather(*(outcome(u) for u in urls[:HANDED_BEFORE_THE_JUMP]), jump(),
                               *(outcome(u) for u in urls[HANDED_BEFORE_THE_JUMP:]))
    out.remove("jump")
    return out


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _JumpingClock:
    jumping = _JumpingClock()
    monkeypatch.setattr(httpcore_http11, "time", jumping)
    return jumping


def test_a_kept_alive_connection_can_be_closed_under_a_call(clock: _JumpingClock) -> None:
    """Why: on the actor's kept-alive pool, a bare request (not sent again) loses its connection.
    Should httpcore stop closing a connection it has handed to a request, this fails."""

    async def scenario() -> list[object]:
        async with _Servers() as urls:
            nemo = NemoGym(urls, "t")
            try:
                def post(u: str) -> Awaitable[int]:
                    return _status(nemo.http.post(f"{u}{PATH}", content=b"{}"))

                return await _across_a_clock_jump(clock, urls, post, post)
            finally:
                await nemo.close()

    out = asyncio.run(scenario())
    assert any("ReadError" in str(o) for o in out[:HANDED_BEFORE_THE_JUMP]), out


@pytest.mark.parametrize("pools", ["the actor's two pools", "one kept-alive pool"])
def test_a_call_that_is_not_sent_twice_never_loses_its_connection(pools: str, clock: _JumpingClock) -> None:
    servers = _Servers()

    async def scenario() -> list[object]:
        async with servers as urls:
            nemo = NemoGym(urls, "t")
            once = nemo.http_once if pools == "the actor's two pools" else None
            clients = {u: AsyncControlClient(u, "t", nemo.http, once=once) for u in urls}
            try:
                # an idempotent call first leaves a kept-alive connection to every server behind
                return await _across_a_clock_jump(clock, urls, lambda u: _status(clients[u].request("GET", "/x",
                                                                                                     idempotent=True)),
                                                  lambda u: _status(clients[u].request("POST", PATH)))
            finally:
                await nemo.close()

    out = asyncio.run(scenario())
    # every call that must not be sent twice asked for a connection of its own; idempotent ones did not
    assert servers.connection_headers.count("close") == SERVERS
    assert servers.connection_headers.count("keep-alive") == SERVERS  # httpx's default
    if pools == "the actor's two pools":
        assert out == [200] * SERVERS
    else:  # on the kept-alive pool, the header alone does not keep the call off an idle connection
        assert any("ReadError" in str(o) for o in out[:HANDED_BEFORE_THE_JUMP]), out


def test_an_idempotent_call_whose_connection_is_closed_under_it_is_sent_again(clock: _JumpingClock) -> None:
    servers = _Servers()

    async def scenario() -> list[object]:
        async with servers as urls:
            nemo = NemoGym(urls, "t")
            clients = {u: AsyncControlClient(u, "t", nemo.http, once=nemo.http_once) for u in urls}
            try:
                def get(u: str) -> Awaitable[int]:
                    return _status(clients[u].request("GET", "/x", idempotent=True))

                return await _across_a_clock_jump(clock, urls, get, get)
            finally:
                await nemo.close()

    assert asyncio.run(scenario()) == [200] * SERVERS
    assert len(servers.connection_headers) > 2 * SERVERS  # some were sent twice: their first connection dropped


async def _status(response: Awaitable) -> int:
    return (await response).status_code
