"""`python -m pdcheck.bench transfer-bench ...`: the command without the rest of the pdcheck CLI."""

from __future__ import annotations

import sys

import typer

from pdcheck import lifecycle
from pdcheck.bench.command import USAGE_ERRORS, register
from pdcheck.errors import EXIT_INTERRUPTED, one_line

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """pdcheck transfer-bench, standalone."""


register(app)


def main() -> None:
    lifecycle.install_signal_handlers()
    try:
        rc = app(standalone_mode=False)
        code = rc if isinstance(rc, int) else 0
    except typer.Exit as exc:  # our command's exit codes
        code = exc.exit_code
    except KeyboardInterrupt:
        code = EXIT_INTERRUPTED
    except USAGE_ERRORS as exc:  # outside the command, e.g. an unknown command name
        sys.stderr.write(f"pdcheck transfer-bench: error: {one_line(exc.format_message())}\n")  # type: ignore[attr-defined]
        code = exc.exit_code  # type: ignore[attr-defined]
    finally:
        lifecycle.shutdown()  # the ranks' forkserver, now rather than when it notices we are gone
    sys.exit(lifecycle.exit_code(code))


if __name__ == "__main__":
    main()
