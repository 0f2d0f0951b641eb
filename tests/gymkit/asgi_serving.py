"""An app served by uvicorn on 127.0.0.1 inside the test's own event loop, with a client to it."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn


@asynccontextmanager
async def serving_app(app: Any) -> AsyncIterator[httpx.AsyncClient]:
    """``app`` on a free port of 127.0.0.1 (real HTTP), stopped when the block ends."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off", timeout_graceful_shutdown=1))
    task = asyncio.create_task(uv.serve(sockets=[sock]))
    while not uv.started:
        await asyncio.sleep(0.005)
        if task.done():
            task.result()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as client:
            yield client
    finally:
        uv.should_exit = True
        await task
        sock.close()


def run_async(fn: Callable[[], Awaitable[None]]) -> None:
    """``fn()`` on a fresh event loop, bounded to 60 s."""
    asyncio.run(asyncio.wait_for(fn(), 60))
