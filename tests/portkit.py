"""Ports for tests that run beside other tests and other copies of the suite (docs/performance.md, "The test
suite"): never a fixed number, one helper for every test that needs a port of its own."""

from __future__ import annotations

import fcntl
import random
import socket
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path


def free_run(n: int = 1, host: str = "127.0.0.1") -> int:
    """A base port with n free ports from it, below the kernel's ephemeral range (32768 up by default), so that
    no outgoing connection of a parallel test takes one between this check and the bind of whatever uses it."""
    rng = random.Random()
    for _ in range(500):
        base = rng.randrange(20000, 32000 - n)
        if is_free(base, n, host):
            return base
    raise AssertionError(f"no run of {n} free ports found on {host}")


def is_free(base: int, n: int = 1, host: str = "127.0.0.1", reuse: bool = False) -> bool:
    """Whether ports base .. base+n-1 can all be bound on host now; reuse: with SO_REUSEADDR, as ZMQ binds, so
    that a TIME_WAIT left by a closed connection does not count as a bound port."""
    try:
        with ExitStack() as held:
            for p in range(base, base + n):
                s = held.enter_context(socket.socket())
                if reuse:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind((host, p))
        return True
    except OSError:
        return False


@contextmanager
def machine_wide(name: str) -> Iterator[None]:
    """Hold a lock every copy of the suite on this machine shares: for the few tests that must use a port the
    released code fixes (vLLM's default side-channel port), one copy at a time."""
    path = Path(tempfile.gettempdir()) / f"pdcheck-tests-{name}.lock"
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def refusing(host: str = "127.0.0.1") -> Iterator[int]:
    """A port where every connection is refused for as long as the block runs: bound, never listened on, so no
    other process (a parallel test's server) can take it meanwhile, as one freed at once could be."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        yield s.getsockname()[1]
