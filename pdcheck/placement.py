"""The placement seam, on its own so both launchers import it and neither imports the other's module: where a
rank runs (Place), and what a launcher answers (RankLauncher). pdcheck.launcher.Launcher forks local ranks,
pdcheck.raylaunch.RayLauncher starts Ray actors; pdcheck.launcher.launcher() picks one."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol, TypeVar

from pdcheck import messages as m


@dataclass(frozen=True, order=True)
class RankId:
    """A rank's one label: its role ("P" prefill / target, "D" decode / initiator) and index. Rendered for people
    as 'P rank 3' (str) and for files and process names as 'P3' (short); never parsed back."""

    role: str
    index: int

    def __str__(self) -> str:
        return f"{self.role} rank {self.index}"

    @property
    def short(self) -> str:
        return f"{self.role}{self.index}"


def ids(role: str, n: int) -> list[RankId]:
    return [RankId(role, i) for i in range(n)]


class Named:
    """A started rank's names from its role and TP rank (launcher.Rank and raylaunch.RayRank both are one)."""

    role: str
    tp_rank: int

    @property
    def id(self) -> RankId:
        return RankId(self.role, self.tp_rank)

    @property
    def label(self) -> str:
        return str(self.id)


@dataclass(frozen=True)
class Place:
    """Where a rank runs: the address its side channel and NIXL use (None: the scenario's host, as given)
    and the node it runs on, for the report."""

    host: str | None
    node: str


class RankHandle(Protocol):
    """One started rank, as the parent talks to it."""

    role: str
    tp_rank: int
    done: bool  # sent its final message (or ended)
    stopped: str | None  # why pdcheck itself stopped it (an interrupt): its end is not a death to report

    @property
    def id(self) -> RankId: ...

    @property
    def label(self) -> str: ...

    def send(self, msg: m.Msg) -> None: ...

    def ended(self) -> str:
        """How the rank ended, for 'P rank 1 died: it ...'."""
        ...


R = TypeVar("R", bound=RankHandle)


class RankLauncher(Protocol[R]):
    """place(), start(), events(), close() and hold_host: what handshake, live and serve ask of a launcher."""

    hold_host: str | None  # where the parent holds silent side-channel ports; None: the scenario's P host

    def place(self, ranks: list[tuple[str, int]], gpu: bool = False) -> dict[tuple[str, int], Place]: ...

    def start(self, role: str, tp_rank: int, target: Callable[[Connection, bytes], None], spec: bytes,
              log: str | None = None) -> R:
        """Start a rank running target(pipe, spec); log: a file that takes its output."""
        ...

    def events(self, ranks: list[R], deadline: float) -> Iterator[tuple[R, m.Msg | None]]:
        """(rank, message) as they arrive; (rank, None) when a rank ends. Stops at deadline."""
        ...

    def close(self) -> None: ...


def rounds(ranks: Sequence[R], deadline: float) -> Iterator[tuple[list[R], float]]:
    """The rounds of a launcher's events() loop: the ranks not done yet and the seconds left, until every rank is
    done or the deadline passes."""
    while True:
        live = [r for r in ranks if not r.done]
        left = deadline - time.monotonic()
        if not live or left <= 0:
            return
        yield live, left
