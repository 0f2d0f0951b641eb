"""The NemoGym actor's fan-out is parallel across every server (issue 22 §2): each of its HTTP pools
(the kept-alive one of the idempotent calls, and the one of the fenced calls, a connection each) has
a connection for each Gym server, so a step that calls 40 servers at once has 40 calls in flight,
none queued behind another server's slow answer (a prepare waits for parking). Checked against a
real HTTP server on 127.0.0.1 that answers only once every call has arrived."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.gym_actor import MIN_CONNECTIONS, NemoGym, pool_size
from tests.loopback_http import read_request, write_response

SERVERS = MIN_CONNECTIONS + 8  # more servers than the old fixed pool of 32 connections


async def _barrier_server(expected: int) -> tuple[asyncio.Server, int, list[int]]:
    """A minimal HTTP/1.1 server: every request waits until ``expected`` requests are open at once."""
    arrived = [0]
    everyone = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await read_request(reader)
                arrived[0] += 1
                if arrived[0] >= expected:
                    everyone.set()
                await everyone.wait()
                await write_response(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], arrived


def test_the_pool_has_a_connection_per_server_bounded() -> None:
    assert pool_size(1) == MIN_CONNECTIONS
    assert pool_size(200) >= 200
    assert pool_size(10**6) <= 1024


@pytest.mark.timeout(60)
@pytest.mark.parametrize("pool", ["http", "http_once"])
def test_every_server_of_a_step_is_called_at_once(pool: str) -> None:
    async def scenario(connections: int | None, wait_s: float) -> int:
        server, port, arrived = await _barrier_server(SERVERS)
        url = f"http://127.0.0.1:{port}"
        gym = NemoGym({f"agent{i:02d}": url for i in range(SERVERS)}, "token", connections=connections)
        http = getattr(gym, pool)
        try:
            # What GymFleet does for one step: one call per server, all gathered. Each answer needs all.
            replies = await asyncio.wait_for(asyncio.gather(*(
                http.post(f"{url}/ng-control/v1/agent-checkpoint/prepare", json={"server": i})
                for i in range(SERVERS))), wait_s)
        except TimeoutError:
            return arrived[0]
        finally:
            await gym.close()
            server.close()
            await server.wait_closed()
        assert all(r.status_code == 200 for r in replies)
        return arrived[0]

    assert asyncio.run(scenario(None, 20)) == SERVERS
    # With a pool smaller than the servers (the old fixed 32), only the pool's worth arrive and the step never
    # completes: the barrier answers no call. The calls that get a connection arrive within milliseconds,
    # so 5 s shows the others were held back.
    assert asyncio.run(scenario(MIN_CONNECTIONS, 5)) == MIN_CONNECTIONS


def test_a_pool_of_no_connection_is_refused() -> None:
    with pytest.raises(ValueError, match="connections is 0"):
        NemoGym(["http://127.0.0.1:1"], "token", connections=0)
