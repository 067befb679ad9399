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
