"""`python -m pdcheck.bench transfer-bench ...`: the command without the rest of the pdcheck CLI."""

from __future__ import annotations

import sys

import typer

from pdcheck.bench.command import USAGE_ERRORS, register

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False)


@app.callback()
def _root() -> None:
    """pdcheck transfer-bench, standalone."""


register(app)


def main() -> None:
    try:
        rc = app(standalone_mode=False)
    except typer.Exit as exc:  # our command's exit codes
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except USAGE_ERRORS as exc:  # outside the command, e.g. an unknown command name
        sys.stderr.write(f"pdcheck transfer-bench: error: {' '.join(exc.format_message().split())}\n")  # type: ignore[attr-defined]
        sys.exit(2)
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
