"""Run one reference Gym server: ``python -m refgym.serve --component model|agent|resource ...``.

The server listens on 127.0.0.1 only, unless ``--host`` names another address (another loopback
address such as 127.0.0.2 stands for another host in tests; a non-loopback one is said on stderr).
``--port 0`` picks a free port; ``--port-file`` receives the port actually bound (written atomically
once the socket is bound, before serving starts), so a launcher never races another process for a port.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI

HOST = "127.0.0.1"
#: How long an idle keep-alive connection stays open. Longer than any client's pool keeps one
#: (httpx: 5 s): were both 5 s, a client could send on a connection the server, its loop busy with
#: thousands of rollouts, is closing in the same moment, and see the request fail (ReadError).
KEEP_ALIVE_S = 30
BACKLOG = 2048  # uvicorn's default; bind() listens with it before uvicorn does again


def build_app(args: argparse.Namespace, token: str) -> FastAPI:
    """The FastAPI app of the requested component."""
    if args.component == "model":
        from refgym.model_server import create_app as model_app

        return model_app(args.name, token, seed=args.seed, slow_ms=args.slow_ms, commit_delay_ms=args.commit_delay_ms,
                         token_store=args.token_store)
    if args.component == "resource":
        from refgym.resource_server import create_app as resource_app

        return resource_app(args.name, token, kind=args.tool, slow_ms=args.slow_ms, test_faults=args.test_faults)
    if not args.model_url or not args.resource_url:
        raise SystemExit("an agent server needs --model-url and --resource-url (and --sandbox-url for sandbox tools)")
    from refgym.agent_server import create_app as agent_app

    tools = {"notes": args.resource_url} | ({"sandbox": args.sandbox_url} if args.sandbox_url else {})
    return agent_app(args.name, token, model_url=args.model_url, tool_urls=tools)


def bind(port: int, host: str = HOST) -> socket.socket:
    """A listening socket on 127.0.0.1 (SO_REUSEADDR, so a restarted server can take its old port)."""
    # IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on connections accepted from a socket that
    # says it is TCP; without it every keep-alive request waits ~40 ms (Nagle + delayed ACK).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # Listening at once, before the port file names the port: two SO_REUSEADDR sockets that are
    # bound but not yet listening may share a port (a server started on port 0 was given the port
    # another had just been picked), and whichever listened first then answered the other's
    # readiness check and its clients. A listening socket makes the second bind fail instead.
    sock.listen(BACKLOG)
    return sock


def _loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1): reachable from this machine only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def write_port_file(path: str, port: int) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(f"{port}\n")
    os.replace(tmp, path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m refgym.serve", description=__doc__.splitlines()[0])
    p.add_argument("--component", required=True, choices=["model", "agent", "resource"])
    p.add_argument("--name", required=True, help="the server's name (its capability name, NeMo-RL's participant name)")
    p.add_argument("--host", default=HOST, help="address to listen on; 127.0.0.1 unless exposing the server is "
                   "meant (another machine's NemoGym actor must reach it)")
    p.add_argument("--port", type=int, default=0, help="port (0: any free port)")
    p.add_argument("--port-file", help="write the bound port here")
    p.add_argument("--token-file", required=True, help="file holding the bearer token of the control routes")
    p.add_argument("--model-url", help="agent: the policy model server")
    p.add_argument("--resource-url", help="agent: the resources server of the notes tool")
    p.add_argument("--sandbox-url", help="agent: the resources server of the sandbox tool (restart-only)")
    p.add_argument("--tool", default="notes", choices=["notes", "sandbox"],
                   help="resource: the tool kind it serves (sandbox is restart-only)")
    p.add_argument("--seed", type=int, default=0, help="model: the model's seed")
    p.add_argument("--slow-ms", type=int, default=0, help="model/resource: make every call take this long")
    p.add_argument("--commit-delay-ms", type=int, default=0, help="model: hold each commit open this long (tests)")
    p.add_argument("--token-store", help="model: capture every call's TokenEntry into this folder or s3:// location")
    p.add_argument("--test-faults", action="store_true", help="resource: serve POST /test/faults (tests only)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    token = Path(args.token_file).read_text().strip()
    if not token:
        print(f"{args.token_file}: empty token", file=sys.stderr)
        return 2
    app = build_app(args, token)
    if not _loopback(args.host):
        print(f"refgym: listening on {args.host}, not only loopback (--host was given)", file=sys.stderr)
    sock = bind(args.port, args.host)
    port = sock.getsockname()[1]
    if args.port_file:
        write_port_file(args.port_file, port)
    config = uvicorn.Config(app, host=args.host, port=port, log_level=args.log_level, lifespan="on",
                            timeout_keep_alive=KEEP_ALIVE_S, backlog=BACKLOG)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
