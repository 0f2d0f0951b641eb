"""Counting calls in flight, so a server's prepare can wait until it is quiet."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager


class InFlight:
    """``with calls.one(): ...`` around each admitted call; ``await calls.quiet()`` waits for 0."""

    def __init__(self) -> None:
        self.count = 0
        self._quiet = asyncio.Event()
        self._quiet.set()

    @contextmanager
    def one(self) -> Iterator[None]:
        # Entered with no await after the admission check, so a paused server admits nothing new.
        self.count += 1
        self._quiet.clear()
        try:
            yield
        finally:
            self.count -= 1
            if not self.count:
                self._quiet.set()

    async def quiet(self) -> None:
        while self.count:
            await self._quiet.wait()
