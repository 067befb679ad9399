"""The one rule that turns per-D-rank handshake outcomes into a release's verdict and the process exit code.

`pdcheck handshake` (fake or live P) and `pdcheck probe` both decide here, from the statuses the same engine
(pdcheck.engine) gives each D rank, so the same deployment cannot survive under one command and fail under the
other. The hazard catalogue explains a verdict; it never decides one (an applicable hazard may be harmless to a
release, e.g. uneven counts that a release handshaking one rank per engine never compares).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pdcheck.errors import EXIT_HARNESS, EXIT_HAZARD, EXIT_OK


def survives(statuses: Sequence[str], d_tp: int) -> bool:
    """A release survives when every one of its d_tp decode ranks reported and each ended "ok"."""
    return len(statuses) == d_tp and all(s == "ok" for s in statuses)


def exit_code(survived: Iterable[bool], *, harness: bool = False) -> int:
    """0 every release survives, 1 one fails, 3 the harness failed (verdicts incomplete)."""
    if harness:
        return EXIT_HARNESS
    return EXIT_OK if all(survived) else EXIT_HAZARD
