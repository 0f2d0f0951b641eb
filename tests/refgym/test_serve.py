"""``python -m refgym.serve`` as a fresh interpreter (the tests otherwise fork servers): it binds
127.0.0.1 only, reports its port, serves ``GET capabilities`` without a token and guards every other
control route with the token from the file."""

from __future__ import annotations

import errno
import time
from pathlib import Path

import httpx
import pytest

from devtools.gym_fleet import listening_addresses
from devtools.gym_procs import launch
from gymkit import ControlClient
from schemas.control import CONTROL_PREFIX, UNAUTHORIZED_DETAIL


def test_serve_binds_loopback_only_and_reads_its_token_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = launch("resource", "tools", tmp_path, token_file)  # port 0: any free port, reported back
    try:
        server.wait_ready(timeout=60)
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, nothing else
        caps = httpx.get(f"{server.url}{CONTROL_PREFIX}/capabilities")  # the one route without a token
        assert caps.status_code == 200 and caps.json()["name"] == "tools"
        body = {"checkpoint_id": "ck-serve", "deadline_ts": time.time() + 30}
        refused = httpx.post(f"{server.url}{CONTROL_PREFIX}/resources-checkpoint/prepare", json=body)
        assert (refused.status_code, refused.json()) == (401, {"detail": UNAUTHORIZED_DETAIL})
        with ControlClient(server.url, "s3cret") as client:  # the file's token, without its newline
            assert client.capabilities().checkpoint_mode == "export_restore"
            assert client.resources.prepare("ck-serve", body["deadline_ts"]).state == "prepared"
            assert client.resources.resume("ck-serve", body["deadline_ts"]).state == "accepting"
    finally:
        server.kill()
    assert not server.alive()


def test_a_servers_port_is_listening_before_it_is_named_so_no_other_server_can_share_it() -> None:
    """``bind`` listens before the port file names the port. Two SO_REUSEADDR sockets that are only
    bound may share a port: a server started on port 0 could be given the port another had just
    been picked, and the one listening first then answered the other's readiness check and clients."""
    from refgym.serve import bind

    first = bind(0)
    try:
        port = first.getsockname()[1]
        with pytest.raises(OSError) as refused:
            bind(port).close()
        assert refused.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    bind(port).close()  # once it is closed, a restarted server takes its old port (SO_REUSEADDR)
