"""The `pdcheck` entry point (console script and `python -m pdcheck`).

Commands that start ranks get their forkserver started first, so that its preload (NIXL, numpy, zmq)
runs on another core while this process imports the CLI.
"""

from __future__ import annotations

import sys

RANK_COMMANDS = ("handshake", "serve", "transfer-bench", "doctor", "smoke")  # probe starts no ranks


def main() -> None:
    # First of all, before any import of pdcheck's own: SIGINT, SIGTERM and SIGHUP are recorded and interrupt the
    # run from here on (a signal in the next milliseconds used to print a KeyboardInterrupt traceback from an
    # import, or end the process by the raw signal). pdcheck.lifecycle takes over once imported, with what came.
    import signal

    early: list[int] = []

    def first(signum: int, frame: object) -> None:
        early.append(signum)
        if len(early) == 1:
            raise KeyboardInterrupt(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored (nohup) stays ignored
            signal.signal(sig, first)
    try:
        import os

        # numpy's OpenBLAS starts a thread pool at import that spins ~0.07 s of CPU in this process and again in
        # the forkserver, on 2 cores while the ranks start; pdcheck does no linear algebra. The user's own wins.
        os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
        from pdcheck import lifecycle

        lifecycle.install_signal_handlers(early)
    except BaseException:
        if not early:
            raise
        exit_now(128 + early[0])
        raise SystemExit(128 + early[0]) from None
    try:
        # --ray places ranks as Ray actors: no local forkserver to warm.
        if len(sys.argv) > 1 and sys.argv[1] in RANK_COMMANDS and not any(a.startswith("--ray") for a in sys.argv):
            from pdcheck import frameworks
            from pdcheck.launcher import warm_up

            frameworks.all_frameworks()  # each framework loaded adds its rank modules to the forkserver's preload
            warm_up()
        from pdcheck.cli import main as cli_main

        cli_main()
    except SystemExit as exc:
        exit_now(exc.code)
        raise
    except BaseException as exc:
        # Before cli.main took over its own interrupts. A Ctrl-C can also surface as another error where the
        # handler's KeyboardInterrupt lands inside C code (cli.run): after a signal, that error is the signal.
        if not isinstance(exc, KeyboardInterrupt) and lifecycle.received() is None:
            raise
        code = lifecycle.exit_code(lifecycle.EXIT_INTERRUPTED)
        lifecycle.shutdown(code)
        exit_now(code)
        raise SystemExit(code) from None


def exit_now(code: object) -> None:
    """Exit with `code` as sys.exit would, without the interpreter's finalization (~0.1 s of freeing
    modules such as numpy, NIXL and rich, which nothing needs). What an exit must still do is done here,
    in the interpreter's order: the atexit hooks (multiprocessing's removes its pymp-* directories, logging
    flushes), then stdout and stderr flushed. Returns, leaving the ordinary exit to the caller, when a
    non-daemon thread still runs (the interpreter waits for it) or `code` is a message to print."""
    import threading

    if code is None:
        code = 0
    if not isinstance(code, int) or any(not t.daemon for t in threading.enumerate()
                                        if t is not threading.main_thread()):
        return
    import atexit
    import os

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        if stream is None or stream.closed:
            continue
        try:
            stream.flush()
        except OSError:  # e.g. stdout a closed pipe: the interpreter's own exit status then is 120
            code = 120
    os._exit(code)


if __name__ == "__main__":
    main()
