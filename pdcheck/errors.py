"""One exception hierarchy; each class carries the process exit code it maps to.

Exit codes: 0 the modelled release survives, 1 a hazard fires, 2 bad input, 3 the harness failed.
"""

from __future__ import annotations

import re

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


# What a flag's value should have been, by the kind of the value typer could not read (pydantic's error type
# under typer >= 0.29, click's type name before).
_KINDS = (("int", "a whole number"), ("integer", "a whole number"), ("float", "a number"), ("bool", "true or false"))


def usage_line(exc: Exception) -> str:
    """pdcheck's one line for a command line typer refused: a value it could not read names the flag and the
    value in pdcheck's words (`--requests: 'abc' is not a whole number`), not pydantic's ("Input should be a
    valid integer...", typer >= 0.29) or click's; any other usage error is click's message on one line."""
    param = getattr(exc, "param", None)
    opts = [o for o in getattr(param, "opts", []) if o.startswith("-")]
    if type(exc).__name__ == "BadParameter" and opts:
        flag = max(opts, key=len)
        cause = exc.__cause__
        found = cause.errors() if hasattr(cause, "errors") else []  # a pydantic ValidationError
        if found and isinstance(found[0], dict):
            kind, value = str(found[0].get("type", "")), found[0].get("input")
            what = next((w for k, w in _KINDS if kind.startswith(f"{k}_")), None)
            if what is not None:
                return f"{flag}: {value!r} is not {what}"
            detail = found[0].get("ctx", {}).get("error") or found[0].get("msg", "")
            return f"{flag}: {value!r}: {one_line(str(detail))}"
        m = re.match(r"(.*) is not a valid (\w+)", str(getattr(exc, "message", "")))  # click's own types
        if m:
            what = next((w for k, w in _KINDS if k == m.group(2)), f"a valid {m.group(2)}")
            return f"{flag}: {m.group(1)} is not {what}"
        return f"{flag}: {one_line(str(getattr(exc, 'message', exc)))}"
    return one_line(exc.format_message())  # type: ignore[attr-defined]


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
