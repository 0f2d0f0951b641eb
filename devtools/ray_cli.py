"""``python -m devtools.ray_cli start ...``: Ray's own ``ray`` command, for the nodes of a cluster that
lives on 127.0.0.1 (several nodes on one machine), with one refusal lifted.

Ray keeps a node on loopback only while ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: with it at 1 (Linux's
default) ``ray start`` replaces ``--node-ip-address 127.0.0.1`` by the machine's routable address
(``services.resolve_ip_for_localhost``) and every Ray server then listens on all interfaces (Ray's
servers bind 127.0.0.1 only when the node's address is exactly that). With it at 0, though, ``ray
start --address=...`` refuses to start a worker node ("Multi-node Ray clusters are not supported on
Windows and OSX"): a guard for those platforms that trips here only because the loopback switch is the
same variable. This runs Ray's click command unchanged, every option as ``ray`` takes it, with the
variable at 0 for this process and every process the node starts (so each keeps 127.0.0.1), and lets
the CLI module alone read the switch as on (it reads it for that guard and for the head's "to add
another node" hint, nothing else). On separate machines none of this is needed: ``ray start`` itself,
same arguments.
"""

from __future__ import annotations

import os
import sys
import types

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def main(argv: list[str] | None = None) -> int:
    if os.environ.get(LOOPBACK_ENV) != "0":
        print(f"devtools.ray_cli: {LOOPBACK_ENV} must be 0 (a loopback node); use `ray` itself otherwise",
              file=sys.stderr)
        return 2
    import ray._private.ray_constants as constants
    import ray.scripts.scripts as cli

    if constants.ENABLE_RAY_CLUSTER:
        print("devtools.ray_cli: ray was imported before the loopback switch was read", file=sys.stderr)
        return 2
    seen_by_cli = types.ModuleType(constants.__name__)
    seen_by_cli.__dict__.update(constants.__dict__)
    seen_by_cli.ENABLE_RAY_CLUSTER = True  # the worker-node guard only; services still read the real module
    cli.ray_constants = seen_by_cli
    sys.argv = ["ray", *(sys.argv[1:] if argv is None else argv)]
    return cli.main()


if __name__ == "__main__":
    sys.exit(main())
