"""Process lifecycle of the pdcheck parent: signals, exit codes, and stopping the forkserver.

SIGINT, SIGTERM and SIGHUP all take the Ctrl-C path: the first one raises KeyboardInterrupt in the main
thread, so every `finally` runs (ranks terminated and reaped, sockets closed), multiprocessing's atexit
hooks remove their pymp-* directories, and the process exits 128 + the signal (130, 143, 129).
A signal that arrives while that cleanup runs is only recorded, so it cannot cut the cleanup short.
A signal the parent inherited as ignored (nohup, a background job without job control) stays ignored,
as POSIX tools do.
"""

from __future__ import annotations

import signal
import sys
from types import FrameType

from pdcheck.errors import EXIT_INTERRUPTED

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_received: list[int] = []


def _handler(signum: int, frame: FrameType | None) -> None:
    first = not _received
    _received.append(signum)
    if first:
        raise KeyboardInterrupt(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    for sig in HANDLED:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, _handler)


def received() -> int | None:
    """The first signal that interrupted this run, if any."""
    return _received[0] if _received else None


def exit_code(code: int) -> int:
    """An interrupted run exits 128 + the signal that stopped it; anything else keeps its code."""
    sig = received()
    if sig is not None and code in (EXIT_INTERRUPTED, 0, 1):
        return 128 + sig
    return code


def shutdown() -> None:
    """Stop the forkserver and its resource tracker now instead of when they notice we are gone (up to
    tens of seconds later under SIGTERM). Both are idempotent; nothing is started here."""
    if "pdcheck.launcher" in sys.modules:
        sys.modules["pdcheck.launcher"].stop_forkserver()
