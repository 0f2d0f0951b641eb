"""moto's S3 server with one change: its writes run one at a time, so a conditional write is atomic.

moto reproduces AWS's exact error shapes, which is why the tests run against it. But its server
handles each request in its own thread, and its create-only PUT (``If-None-Match: *``) looks the
key up and then stores it, with no lock between the two (moto 5.2, ``S3Response.put_object``). So
two racing create-only PUTs of one key can both succeed there, which AWS never allows: a
conditional write is atomic on S3 (one wins, the others get 412 or 409). The publish-race test
saw it on a loaded machine: two winners of one round on moto, one on SeaweedFS.

This entry point serves moto's own application through werkzeug as ``moto_server`` does, and
holds one lock around every request that is not a read. Reads still run in parallel.

    python -m devtools.moto_server -H 127.0.0.1 -p PORT
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

_READS = frozenset({"GET", "HEAD", "OPTIONS"})

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


class WritesOneAtATime:
    """A WSGI wrapper: requests that may change state run one at a time, reads as they come.

    The whole response is built inside the lock (moto builds it in full before returning it), so a
    write's check and its store are one step to every other write.
    """

    def __init__(self, app: WsgiApp) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ.get("REQUEST_METHOD", "GET") in _READS:
            return self._app(environ, start_response)
        with self._lock:
            body = self._app(environ, start_response)
            try:
                return list(body)
            finally:
                close = getattr(body, "close", None)
                if close is not None:  # WSGI: the server calls close(); the list handed on has none
                    close()


def _stop(signum: int, frame: Any) -> None:
    sys.exit(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-H", "--host", default="127.0.0.1", help="address to bind (loopback)")
    parser.add_argument("-p", "--port", type=int, required=True, help="port to bind")
    args = parser.parse_args(argv)

    # Imported here: moto's import is slow, and this module is also imported by tests of the wrapper.
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(args.port))  # moto builds some URLs from it, as moto_server sets it
    signal.signal(signal.SIGTERM, _stop)
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(args.host, args.port, WritesOneAtATime(app), threaded=True)


if __name__ == "__main__":
    main()
