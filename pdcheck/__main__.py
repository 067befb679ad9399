"""The `pdcheck` entry point (console script and `python -m pdcheck`).

Commands that start ranks get their forkserver started first, so that its preload (NIXL, numpy, zmq)
runs on another core while this process imports the CLI.
"""

import sys

RANK_COMMANDS = ("handshake", "serve", "transfer-bench")  # probe starts no ranks


def main() -> None:
    # --ray places ranks as Ray actors: no local forkserver to warm.
    if len(sys.argv) > 1 and sys.argv[1] in RANK_COMMANDS and not any(a.startswith("--ray") for a in sys.argv):
        from pdcheck.launcher import warm_up

        warm_up()
    from pdcheck.cli import main as cli_main

    cli_main()


if __name__ == "__main__":
    main()
