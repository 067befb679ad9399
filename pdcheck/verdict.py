"""The one rule that turns per-rank outcomes into a release's verdict and the process exit code, and the one
shape every command's --json gives a per-rank verdict (docs/json.md).

Every command decides here: `handshake` (either framework, fake or live P), `probe`, `requests`, `smoke` and
`transfer-bench` each reduce their outcomes to "survived" per release (or per case, per sweep) and take the
exit code from `exit_code`, so the same deployment cannot survive under one command and fail under another.
The hazard catalogue explains a verdict; it never decides one (an applicable hazard may be harmless to a
release, e.g. uneven counts that a release handshaking one rank per engine never compares).

This module imports no framework: the runtime, every framework's report and the tests read it alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from pdcheck.errors import EXIT_HARNESS, EXIT_HAZARD, EXIT_OK

OK = "ok"
Status = Literal["ok", "assert", "silent", "error", "hang"]  # a handshake's verdict on one decode rank
STATUSES: tuple[str, ...] = Status.__args__  # type: ignore[attr-defined]


class Proof(msgspec.Struct, kw_only=True):
    """What the transfer proof found on one rank for one release: blocks (SGLang: pages) checked by
    coordinate, and how many held another coordinate's bytes. Where the release asserted, the proof is the re-run
    with its asserts stripped (as `python -O` runs it): what that release would have delivered."""

    asserts_stripped: bool | None = None  # True: this proof is the asserts-stripped re-run; None: as released
    status: str  # ok | wrong | error | skipped | arrived (READ done, content not checkable)
    blocks: int = 0
    wrong: int = 0


class RankVerdict(msgspec.Struct, kw_only=True):
    """One modelled release on one decode rank (the `requests` command: on one request), the same shape for
    every framework. `verdicts` in a --json document is a list of these; the corrected model's are not in it
    (they never set the exit code; each framework's own section carries them)."""

    release: str  # the modelled release as the command names it ("0.9.1"; SGLang: the release of --sglang)
    rank: str  # the decode rank: "D0", "DP1/D0" (decode DP > 1)
    status: str  # handshake: ok | assert | silent | error | hang; requests: its verdict words (docs/requests.md)
    detail: str = ""  # one line: the assert's expression and message, the exception, why it waits
    stage: str | None = None  # where it stopped, as the framework names its stages (SGLang: bootstrap, ...)
    contacted: list[int] = []  # the P ranks this D rank talked to
    contacted_stages: list[int] = []  # P with pipeline stages: the stage (pp_rank) asked of each contacted rank
    request: int | None = None  # `requests`: the request id
    proof: Proof | None = None  # the transfer proof, where one ran


def rank_label(tp_rank: int, dp_rank: int = 0, dp: bool = False) -> str:
    """A decode rank's stable id: "D3", or "DP1/D3" when the decode side has more than one DP rank."""
    return f"DP{dp_rank}/D{tp_rank}" if dp else f"D{tp_rank}"


def survives(statuses: Sequence[str], d_tp: int) -> bool:
    """A release survives when every one of its d_tp decode ranks reported and each ended "ok"."""
    return len(statuses) == d_tp and all(s == OK for s in statuses)


def exit_code(survived: Iterable[bool], *, harness: bool = False) -> int:
    """0 every release (case, sweep) survives, 1 one fails, 3 the harness failed (verdicts incomplete)."""
    if harness:
        return EXIT_HARNESS
    return EXIT_OK if all(survived) else EXIT_HAZARD


def exit_code_of(verdicts: Iterable[RankVerdict], *, harness: bool = False) -> int:
    """The exit code of a list of per-rank handshake verdicts: 1 when any is not "ok"."""
    return exit_code((v.status == OK for v in verdicts), harness=harness)
