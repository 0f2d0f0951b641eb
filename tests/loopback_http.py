"""A request read off a raw HTTP/1.1 connection, and an answer written to it: for tests that stand in
a loopback server of their own (one that holds answers back, drops connections, or records headers),
where a real server would hide what the test is about."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class Request:
    request_line: str
    headers: dict[str, str]  # names lower-cased
    body: bytes


async def read_request(reader: asyncio.StreamReader) -> Request:
    """The next request on the connection (``asyncio.IncompleteReadError`` once the client closed it)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip()
               for name, sep, value in (line.partition(":") for line in head[1:]) if sep}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(head[0], headers, body)


async def write_response(writer: asyncio.StreamWriter, body: bytes = b"{}", *, close: bool = False) -> None:
    """``200 OK`` with a JSON ``body``; with ``close``, ``connection: close`` (the caller closes)."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                 + str(len(body)).encode() + (b"\r\nconnection: close" if close else b"") + b"\r\n\r\n" + body)
    await writer.drain()
