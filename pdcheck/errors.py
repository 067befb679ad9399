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


MAX_ERROR_WORD = 200  # characters of one word of an error line (a flag's value echoed back)
MAX_ERROR_LINE = 2000  # characters of the whole line


def error_line(text: str) -> str:
    """The `pdcheck: error:` line's text (pdcheck.cli): one line (one_line), printable (a control character in an
    echoed value shows as its escape), each word at most MAX_ERROR_WORD characters and the line at most
    MAX_ERROR_LINE, each cut saying how long it was (pdcheck.render.text, the one renderer of untrusted text)."""
    from pdcheck.render.text import visible, words_cut

    return visible(words_cut(one_line(text), MAX_ERROR_WORD, MAX_ERROR_LINE))


class FetchTimeout(Exception):
    """No reply within the receive timeout (or pdcheck's own hang timeout)."""


class FetchRefused(Exception):
    """A reply pdcheck refuses to read (more frames or bytes than its caps, pdcheck.netio): a harness limit,
    reported as an error verdict with the reason, never a traceback."""
