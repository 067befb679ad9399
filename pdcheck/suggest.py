"""'did you mean' for every name a user types: scenario names, scenario keys, enum values. One helper, so every
error that names a wrong word offers the close ones the same way (difflib's ratio, like typer's own for
commands and flags)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

CUTOFF = 0.6  # difflib's default: 'hetro-p4-d2' finds 'hetero-p4-d2', 'x' finds nothing


def close(word: str, choices: Iterable[str], n: int = 3) -> list[str]:
    """The choices closest to `word`, best first (none when nothing is close)."""
    return difflib.get_close_matches(word, list(dict.fromkeys(choices)), n=n, cutoff=CUTOFF)


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """'; did you mean 'hetero-p4-d2'?' (or '' when nothing is close): the tail of an error line."""
    found = close(word, choices)
    if not found:
        return ""
    return "; did you mean " + " or ".join(repr(x) for x in found) + "?"
