"""``python -m refgym.serve`` as a fresh interpreter (the tests otherwise fork servers): it binds
127.0.0.1 only, reports its port, and guards its control routes with the token from the file."""

from __future__ import annotations

from pathlib import Path

import httpx

from devtools.gym_fleet import listening_addresses
from devtools.gym_procs import launch
from gymkit import ControlClient


def test_serve_binds_loopback_only_and_reads_its_token_from_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    server = launch("resource", "tools", tmp_path, token_file)  # port 0: any free port, reported back
    try:
        server.wait_ready(timeout=60)
        assert listening_addresses(server.port) == {"0100007F"}  # 127.0.0.1, nothing else
        client = ControlClient(server.url, "s3cret")
        assert client.capabilities().name == "tools"
        assert httpx.get(f"{server.url}/ng-control/v1/capabilities").status_code == 401
        client.close()
    finally:
        server.kill()
    assert not server.alive()
