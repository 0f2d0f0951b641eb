"""Ports picked for servers that bind them later: distinct when picked together."""

from __future__ import annotations

import socket

import pytest

from devtools.cluster import HEAD_PORT_OPTIONS, NODE_PORT_OPTIONS, LocalCluster
from devtools.gym_procs import LOCALHOST, bindable, free_ports

# Enough picks that one-at-a-time picking (bind, close, bind again) repeats a port (20 runs of 20 did): the
# kernel hands a closed port out again, which is how a Ray node got one port for two of its servers.
PICKS = 400


def test_ports_picked_together_are_distinct_and_free() -> None:
    ports = free_ports([LOCALHOST] * PICKS)
    assert len(set(ports)) == PICKS
    with socket.socket() as sock:  # released once picked: a server can bind any of them
        sock.bind((LOCALHOST, ports[0]))


def test_excluded_ports_are_never_picked() -> None:
    taken = set(free_ports([LOCALHOST] * PICKS))  # released: the kernel may hand any of them out again
    assert not taken & set(free_ports([LOCALHOST] * PICKS, exclude=taken))


@pytest.mark.skipif(not bindable("127.0.0.2"), reason="127.0.0.2 is not a loopback address on this machine")
def test_ports_on_other_addresses_are_picked_on_those_addresses() -> None:
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.1"]
    ports = free_ports(hosts)
    assert ports[0] != ports[2]
    with socket.socket() as sock:
        sock.bind((hosts[1], ports[1]))


def test_every_ray_node_gets_a_distinct_port_for_each_of_its_servers() -> None:
    cluster = LocalCluster()
    try:
        for node in cluster.nodes.values():
            for _ in range(20):  # each start picks anew (a restarted node too)
                options = {a.split("=", 1)[0][2:]: int(a.split("=", 1)[1]) for a in node.command()
                           if a.split("=", 1)[0][2:] in NODE_PORT_OPTIONS + HEAD_PORT_OPTIONS}
                expected = NODE_PORT_OPTIONS + (HEAD_PORT_OPTIONS if node.head else ())
                assert sorted(options) == sorted(expected), node.name
                assert len(set(options.values())) == len(options), (node.name, options)
                assert node.gcs_port not in options.values()
    finally:
        cluster.close()
