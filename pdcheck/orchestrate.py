"""Driving started ranks from the parent, for every command (handshake, live, serve, requests, transfer-bench, doctor,
every framework): wait until every rank of a group answered one kind of message (with a deadline, naming the rank
that failed, died or stayed silent), and send to a group. A framework's own conversations build on these
(vLLM's side-channel ports and block-tag routing: pdcheck/vllm/drive.py).

Works over any placement backend: it needs a launcher's `events()` and ranks that answer `id`, `send()`,
`ended()` and `done` (pdcheck.launcher.Launcher with forked ranks, pdcheck.raylaunch.RayLauncher with actors).
Ranks are named by their placement.RankId (re-exported here with `ids`, as every result is keyed by it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from pdcheck import messages as m
from pdcheck.errors import HarnessError
from pdcheck.placement import RankHandle, RankId, ids

__all__ = ["Events", "Faults", "RankHandle", "RankId", "Stage", "await_ready", "gather", "ids", "send_all"]

M = TypeVar("M")
Tick = Callable[[str, int, int], None]  # (stage, done, total), e.g. pdcheck.progress


R = TypeVar("R", bound=RankHandle)


class Events(Protocol):
    """A placement backend's event stream: (rank, message) as they arrive, (rank, None) when a rank ended."""

    def events(self, ranks: Any, deadline: float) -> Iterator[tuple[Any, m.Msg | None]]: ...


class Faults(Protocol):
    """How a wait names what went wrong: the exception to raise for each way a rank can let it down."""

    def failed(self, rank: RankHandle, msg: m.Failed) -> Exception: ...

    def died(self, rank: RankHandle) -> Exception: ...

    def late(self, pending: list[RankId]) -> Exception: ...

    def stray(self, rank: RankHandle, msg: m.Msg) -> Exception | None:
        """A message of another kind, or a second one: the exception to raise, or None to skip it."""
        ...


@dataclass(frozen=True)
class Stage:
    """Faults of a start-up stage as one-line harness errors; templates take {rank}, {error}, {ended}, {ranks},
    {timeout}."""

    failed_text: str
    died_text: str
    late_text: str
    timeout_s: float

    def failed(self, rank: RankHandle, msg: m.Failed) -> Exception:
        return HarnessError(self.failed_text.format(rank=rank.id, error=msg.error))

    def died(self, rank: RankHandle) -> Exception:
        return HarnessError(self.died_text.format(rank=rank.id, ended=rank.ended()))

    def late(self, pending: list[RankId]) -> Exception:
        return HarnessError(self.late_text.format(ranks=", ".join(sorted(map(str, pending))),
                                                  timeout=self.timeout_s))

    def stray(self, rank: RankHandle, msg: m.Msg) -> Exception | None:
        return None


def send_all(ranks: Iterable[RankHandle], msg: m.Msg) -> None:
    for rank in ranks:
        rank.send(msg)


def gather(lau: Events, ranks: Sequence[R], kind: type[M], timeout_s: float, faults: Faults, *,
           watch: Sequence[R] = (), tick: Callable[[int, int], None] | None = None,
           ended_ok: bool = False) -> dict[RankId, tuple[R, M]]:
    """One `kind` message from each of `ranks` within timeout_s: rank id -> (rank, message), in arrival order.

    watch: further ranks whose death (or Failed) also ends the wait, e.g. a P rank that dies while D ranks
    measure. Any other message goes to faults.stray. ended_ok: a rank that already answered may end (its
    goodbye)."""
    pending = {r.id for r in ranks}
    got: dict[RankId, tuple[R, M]] = {}
    everyone = [*ranks, *(w for w in watch if w.id not in pending)]
    for rank, msg in lau.events(everyone, time.monotonic() + timeout_s):
        if msg is None:
            if ended_ok and rank.id not in pending:
                continue
            raise faults.died(rank)
        if isinstance(msg, m.Failed):
            raise faults.failed(rank, msg)
        if not isinstance(msg, kind) or rank.id not in pending:
            stray = faults.stray(rank, msg)
            if stray is not None:
                raise stray
            continue
        got[rank.id] = (rank, msg)
        pending.discard(rank.id)
        if tick:
            tick(len(got), len(ranks))
        if not pending:
            return got
    raise faults.late(sorted(pending))


def await_ready(lau: Events, ranks: Sequence[R], timeout_s: float,
                tick: Tick | None = None) -> dict[RankId, tuple[float, bytes | None]]:
    """Every handshake/serve rank's Ready: rank id -> (setup ms, P's metadata values)."""
    stage = Stage("{rank} failed to start: {error}", "{rank} died during start-up: it {ended}",
                  "{ranks} not ready after {timeout:g} s (start-up follows --timeout)", timeout_s)
    got = gather(lau, ranks, m.Ready, timeout_s, stage,
                 tick=(lambda done, total: tick("ranks up", done, total)) if tick else None)
    return {rid: (msg.setup_ms, msg.values) for rid, (_rank, msg) in got.items()}


