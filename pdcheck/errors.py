"""One exception hierarchy; each class carries the process exit code it maps to.

Exit codes: 0 the modelled release survives, 1 a hazard fires, 2 bad input, 3 the harness failed.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_HAZARD = 1
EXIT_BAD_INPUT = 2
EXIT_HARNESS = 3


class PdcheckError(Exception):
    """Base class. The message is a single line meant for the user."""

    exit_code = EXIT_HARNESS


class BadInput(PdcheckError):
    """A scenario file, flag or release name is wrong. Names what and where."""

    exit_code = EXIT_BAD_INPUT


class HarnessError(PdcheckError):
    """pdcheck itself could not finish: a rank died, hung or failed to start."""

    exit_code = EXIT_HARNESS


class RankFailed(HarnessError):
    pass


class RankTimeout(HarnessError):
    pass


class NixlCallError(PdcheckError):
    """A NIXL call failed; carries the operation and the NIXL status for the report."""

    exit_code = EXIT_HARNESS

    def __init__(self, op: str, status: str, detail: str, context: str = "") -> None:
        self.op = op
        self.status = status
        self.detail = detail
        self.context = context
        where = f" ({context})" if context else ""
        super().__init__(f"NIXL {op} failed{where}: {status}: {detail}")
EXIT_INTERRUPTED = 130  # 128 + SIGINT; SIGTERM gives 143, SIGHUP 129


def usage_error_types() -> tuple[type[Exception], ...]:
    """The ClickException classes of the click that typer runs on. typer >= 0.29 vendors its own copy
    (typer._click) and no longer installs click; older typer depends on click. Nothing else is imported."""
    found: list[type[Exception]] = []
    for mod in ("typer._click.exceptions", "click.exceptions"):
        try:
            found.append(__import__(mod, fromlist=["ClickException"]).ClickException)
        except (ImportError, AttributeError):
            pass
    return tuple(found)


def one_line(text: str) -> str:
    """Collapse a (possibly multi-line) message to the one line the exit-code contract promises."""
    return " ".join(str(text).split())


class FetchTimeout(Exception):
    """No reply within the receive timeout (or pdcheck's own hang timeout)."""


class FetchRefused(Exception):
    """A reply pdcheck refuses to read (more frames or bytes than its caps, pdcheck.netio): a harness limit,
    reported as an error verdict with the reason, never a traceback."""
