"""How long the machine stalled a request line, and when that voids the line's timing (docs/requests.md, "Slow
motion").

A line's verdicts rest on its lengths (the lease, a fault's seconds) being long next to what the machine takes to
turn the ranks' loops. On a 2-core machine beside a second copy of the test suite a sleeping thread woke over 0.3 s
late in 23 of 132 windows of 5 s (at worst 0.94 s), every process of a run late together: a 0.5 s lease then
expires while P's handshake with D waits for its turn, and the real run disagrees with the model. So the parent
measures it: a thread that sleeps TICK_S at a time records its worst oversleep over the line. A stall longer than
SHARE of the line's shortest length voids the line's timing, and the line runs again at AGAIN times the time scale
(at most MAX_VOIDED times, within the bound), where the same stall is a smaller share; the verdicts are those of
the run that was steady. A stall is measured, never inferred from a verdict: a steady line that disagrees with the
model stays a harness error."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import msgspec

from pdcheck import bounds

TICK_S = 0.01  # the sampler's sleep: ~100 wake-ups a second, noise next to a rank's polls
# A stall over a third of the shortest length voids the line: the failures it explains outgrew 80% of a 0.5 s lease,
# and several stalls can fall in one exchange (PUSH_REG, P's handshake with D, the WRITE).
SHARE, SHARE_TEXT = 1 / 3, "a third"
AGAIN = 1.5  # the time scale of a line's next run, per voided run: enough for a stall that is an episode, not a trend
MAX_VOIDED = 3  # runs of a line voided at most (K, 1.5K, 2.25K); the fourth stands, its stall reported


class Voided(msgspec.Struct):
    """A run of a line whose timing the machine voided: the time scale it ran at, the worst stall, and the
    length the stall outgrew."""

    time_scale: float
    stall_s: float
    length_s: float


class StallClock:
    """The worst oversleep of a thread sleeping TICK_S at a time, from enter to exit (a process that is not
    given a core, in the parent: the ranks of the run share its machine)."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="pdcheck-stall-clock", daemon=True)

    def _sample(self) -> None:
        before = time.monotonic()
        while not self._stop.wait(TICK_S):
            now = time.monotonic()
            self.worst = max(self.worst, now - before - TICK_S)
            before = now

    def __enter__(self) -> StallClock:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()


def shortest(lease_s: float | None, fault_seconds: list[float]) -> float | None:
    """The shortest length a line's verdicts rest on: the scenario's lease and each timed fault's seconds, as run
    (None: no such length; a release's own lease of minutes is never one)."""
    lengths = [s for s in [lease_s, *fault_seconds] if s is not None and s > 0]
    return min(lengths) if lengths else None


def voids(stall_s: float, length_s: float | None, time_scale: float, voided: int) -> bool:
    """Whether a line that stalled stall_s runs again: the stall outgrew SHARE of its shortest length, fewer than
    MAX_VOIDED runs of it were voided, and AGAIN times the time scale is within the bound (else the run stands, its
    stall reported)."""
    return (length_s is not None and stall_s > SHARE * length_s and voided < MAX_VOIDED
            and time_scale * AGAIN <= bounds.TIME_SCALE[1])


def void_note(v: Voided) -> str:
    """What the report says of a voided run."""
    return (f"the machine stalled the run {v.stall_s:.2f} s at x{v.time_scale:g}, over {SHARE_TEXT} of its shortest "
            f"length ({v.length_s:g} s): that run's timing is void, the line ran again at x{AGAIN * v.time_scale:g}")
