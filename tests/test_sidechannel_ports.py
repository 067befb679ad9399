"""A restarted P binds its side channel's port again: the port is one the kernel never hands out on its own."""

from __future__ import annotations

import socket

from pdcheck.sidechannel import rebindable_port


def _ephemeral_low() -> int:
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        return int(f.read().split()[0])


def test_a_rebindable_port_is_free_and_below_the_ephemeral_range() -> None:
    low = _ephemeral_low()
    ports = {rebindable_port("127.0.0.1") for _ in range(20)}
    assert all(1024 <= p < low for p in ports), (ports, low)
    assert len(ports) > 1  # picked at random: parallel runs do not line up on one
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free right after it was picked


def test_an_outgoing_connection_is_never_given_a_rebindable_port() -> None:
    """What took a restarted P's port before: another process's connect() got it from the ephemeral range."""
    low = _ephemeral_low()
    with socket.create_server(("127.0.0.1", 0)) as srv:
        peers = [socket.create_connection(srv.getsockname()) for _ in range(50)]
        try:
            assert all(c.getsockname()[1] >= low for c in peers)
        finally:
            for c in peers:
                c.close()
