"""A loopback TCP proxy in front of a test server that can be switched to stall, and back.

A stalled server is not a stopped one: it accepts connections and then never answers, so a client
learns of it only through its own timeouts. :class:`StallProxy` listens on 127.0.0.1 and forwards
every connection to its upstream (e.g. the session's SeaweedFS) until :meth:`StallProxy.stall`;
from then on every connection, open or new, is held open and forwards nothing in either direction
(what arrives is read and dropped, so a client's upload still "succeeds" and it then waits for an
answer that never comes). :meth:`StallProxy.answer` closes the stalled connections (their state is
lost, as after a real stall) and forwards new ones again.

Two threads per connection, each a bounded loop that ends when its socket closes; :meth:`close`
closes every socket and joins every thread with a time limit.
"""

from __future__ import annotations

import socket
import threading
from urllib.parse import urlparse

_CHUNK = 1 << 16
_CONNECT_TIMEOUT_S = 5.0
_JOIN_TIMEOUT_S = 5.0


class _Link:
    """One client connection and, unless it was stalled from the start, its upstream connection."""

    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream
        self.stalled = upstream is None

    def close(self) -> None:
        for sock in (self.client, self.upstream):
            if sock is None:
                continue
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in recv on it
            except OSError:
                pass
            sock.close()


class StallProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream`` (an ``http://host:port`` endpoint), or stalls."""

    def __init__(self, upstream: str) -> None:
        parsed = urlparse(upstream)
        if parsed.hostname is None or parsed.port is None:
            raise ValueError(f"{upstream}: expected http://host:port")
        self._upstream = (parsed.hostname, parsed.port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._lock = threading.Lock()
        self._stalled = False
        self._closed = False
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self.connections = 0  # accepted so far (a test may check that clients did come)
        self._start(self._accept_loop, "accept")

    # -- switching ----------------------------------------------------------------------------
    @property
    def stalled(self) -> bool:
        return self._stalled

    def stall(self) -> None:
        """From now on every connection, open or new, forwards nothing and stays open."""
        with self._lock:
            self._stalled = True
            for link in self._links:
                link.stalled = True

    def answer(self) -> None:
        """Close the stalled connections and forward new ones again."""
        with self._lock:
            self._stalled = False
            stalled = [link for link in self._links if link.stalled]
            self._links.difference_update(stalled)
        for link in stalled:
            link.close()

    def close(self) -> None:
        """Stop listening, close every connection, and join the threads (bounded)."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links), set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # close() alone does not wake a blocked accept()
        except OSError:
            pass
        self._listener.close()
        for link in links:
            link.close()
        for thread in self._threads:
            thread.join(_JOIN_TIMEOUT_S)

    def __enter__(self) -> StallProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- forwarding ---------------------------------------------------------------------------
    def _start(self, target, name: str, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, name=f"stall-proxy-{name}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener was closed
                return
            self.connections += 1
            upstream = None
            if not self._stalled:
                try:
                    upstream = socket.create_connection(self._upstream, timeout=_CONNECT_TIMEOUT_S)
                    upstream.settimeout(None)
                except OSError:
                    client.close()  # upstream down: the client sees its connection closed
                    continue
            link = _Link(client, upstream)
            with self._lock:
                if self._closed:
                    link.close()
                    return
                link.stalled = link.stalled or self._stalled
                self._links.add(link)
            self._start(self._pipe, "up", link, client, upstream)
            if upstream is not None:
                self._start(self._pipe, "down", link, upstream, client)

    def _pipe(self, link: _Link, source: socket.socket, sink: socket.socket | None) -> None:
        """Copy ``source`` to ``sink`` until either closes; drop everything once the link stalls."""
        while True:
            try:
                data = source.recv(_CHUNK)
            except OSError:
                data = b""
            if not data:
                break
            if link.stalled or sink is None:
                continue  # read and dropped: the sender waits for an answer that never comes
            try:
                sink.sendall(data)
            except OSError:
                break
        with self._lock:
            self._links.discard(link)
        link.close()


__all__ = ["StallProxy"]
