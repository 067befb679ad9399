"""What every doctor check returns, how a check runs against its deadline, and the exit rule."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import msgspec

from pdcheck import verdict
from pdcheck.errors import PdcheckError, one_line

Status = Literal["PASS", "WARN", "FAIL", "SKIP"]
ORDER: dict[str, int] = {"FAIL": 0, "WARN": 1, "PASS": 2, "SKIP": 3}


class Check(msgspec.Struct):
    """One check: its name, the verdict, what it found, the one-line fix when it is not PASS, its seconds."""

    name: str
    status: Status
    detail: str
    fix: str | None = None
    seconds: float = 0.0


def check(name: str, status: Status, detail: str, fix: str | None = None) -> Check:
    return Check(name, status, one_line(detail), one_line(fix) if fix else None)


def exit_code(checks: list[Check]) -> int:
    """0 when every check is PASS, WARN or SKIP; 1 when any is FAIL (bad input and harness failures raise)."""
    return verdict.exit_code(c.status != "FAIL" for c in checks)


def summary(checks: list[Check]) -> str:
    """'12 checks: 9 PASS, 2 WARN, 1 SKIP' (FAILs named first)."""
    counts = {s: sum(c.status == s for c in checks) for s in ORDER}
    parts = [f"{n} {s}" for s, n in counts.items() if n]
    failed = [c.name for c in checks if c.status == "FAIL"]
    head = f"{len(checks)} checks: {', '.join(parts)}"
    return head + (f" (failed: {', '.join(failed)})" if failed else "")


def within(name: str, deadline_s: float, fn: Callable[[], Any]) -> tuple[Any, Check | None]:
    """Run a pure check (sysfs, environment, metadata) on a daemon thread, at most deadline_s: (its value,
    None), or (None, a FAIL naming the deadline or the error). A check that overruns is abandoned, never joined:
    a stuck read of a sysfs file must not hang the doctor."""
    out: list[Any] = []
    err: list[BaseException] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - reported as the check's FAIL
            err.append(exc)

    t0 = time.monotonic()
    t = threading.Thread(target=body, name=f"pdcheck-doctor-{name}", daemon=True)
    t.start()
    t.join(deadline_s)
    secs = time.monotonic() - t0
    if t.is_alive():
        c = check(name, "FAIL", f"did not finish within {deadline_s:g} s",
                  "look for a hung filesystem or driver call (sysfs, /proc) on this node")
        c.seconds = secs
        return None, c
    if err:
        e = err[0]
        text = str(e) if isinstance(e, PdcheckError) else f"{type(e).__name__}: {e}"
        c = check(name, "FAIL", f"the check itself failed: {text}")
        c.seconds = secs
        return None, c
    return out[0], None


def timed(checks: list[Check], seconds: float) -> list[Check]:
    """Spread the seconds a group of checks took over them (they were computed together)."""
    for c in checks:
        c.seconds = round(seconds / max(1, len(checks)), 4)
    return checks
