"""Reading a request body with its size limited before it is held in memory."""

from __future__ import annotations

from fastapi import Request


class BodyTooLarge(Exception):
    """The body is (or says it is) larger than the limit; ``size`` is what was seen or declared."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"body of {size} bytes exceeds {limit}")
        self.size = size


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refusing one that declares or streams more than ``limit`` bytes: a client
    cannot make the server buffer more than the limit whatever it sends."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise BodyTooLarge(int(declared) if declared.isdigit() else limit + 1, limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)
