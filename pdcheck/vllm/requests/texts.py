"""The request path's log lines as each vLLM release prints them, so a user can grep their own logs for what
pdcheck shows: D's `NIXL transfer failure: ... | Context: {...}` (the worker's _log_failure), its `Skipping KV
post-processing` warning for a failed request, and P's error for a done notification that arrives after the
blocks expired. Keyed by the release that first prints each text (read in the `nixl_connector.py`,
`nixl/worker.py`, `nixl/base_worker.py` and `nixl/pull_worker.py` of every x.y.0 wheel 0.9.0-0.34.0); see
docs/requests.md."""

from __future__ import annotations

from typing import Any

from pdcheck.releaseline import Version, version_tuple

# _log_failure and its "NIXL transfer failure: %s | Context: %s" line (0.11.1-0.13 logged free text instead).
FAILURE_LOG_SINCE: Version = (0, 14, 0)
# What _read_blocks' transfer_setup_failed adds: blocks marked invalid at once, or (0.30+) the failure held back
# until the request's other READs finish; a failed or raising transfer state says "Marking blocks as invalid"
# until 0.29 and nothing after.
SETUP_MSG: tuple[tuple[Version, str], ...] = (
    ((0, 14, 0), "Marking blocks as invalid"),
    ((0, 30, 0), "Deferring failure reporting until outstanding transfers finish"),
)
STATE_MSG: tuple[tuple[Version, str], ...] = (((0, 14, 0), "Marking blocks as invalid"), ((0, 30, 0), ""))
# get_finished: a failed request's received KV is not post-processed (logger.warning).
SKIP_SINCE: Version = (0, 22, 0)
SKIP = "Skipping KV post-processing for failed request {req}"
# P's _get_new_notifs: a done notification for a request it no longer holds (the abort timeout or lease freed
# its blocks first; logger.error).
UNRECOGNIZED_SINCE: Version = (0, 10, 1)
UNRECOGNIZED = ("Potentially invalid KV blocks for unrecognized request {req} were retrieved by a decode worker. "
                "They may have expired.")
# 0.10.0's P for the same notification (lines.Lifecycle.late_notif "raises"): `del self._reqs_to_send[req_id]`
# raises, and run_engine_core's logger.exception ends the engine core.
ENGINE_DIED = ("EngineCore encountered a fatal error. KeyError: '{req}' (_get_new_notifs: del "
               "self._reqs_to_send[req_id], blocks the abort timeout already freed)")
ENGINE_DIED_HEAD = ENGINE_DIED.split(" KeyError", 1)[0]


def _at(table: tuple[tuple[Version, str], ...], v: Version) -> str | None:
    found = None
    for since, text in table:
        if v >= since:
            found = text
    return found


def failure_log(release: str, failure_type: str, context: dict[str, Any]) -> str | None:
    """D's _log_failure line for failure_type (transfer_setup_failed, transfer_failed, transfer_exception,
    handshake_failed, handshake_setup_failed), or
    None before the release had it. context: the keys after failure_type, in _log_failure's order (request_id,
    engine_id, the request's remote_* and block counts, then the call's extra context)."""
    v = version_tuple(release)
    if v < FAILURE_LOG_SINCE:
        return None
    # the msg each call site passes: _read_blocks' for a setup failure, _pop_done_transfers' for a failed state;
    # the handshake's request_ready and done_callback pass none
    table = {"transfer_setup_failed": SETUP_MSG, "transfer_failed": STATE_MSG, "transfer_exception": STATE_MSG}
    msg = _at(table.get(failure_type, ()), v) or ""
    shown = f"{failure_type}. {msg}" if msg else failure_type
    return f"NIXL transfer failure: {shown} | Context: {({'failure_type': failure_type, **context})!r}"


def skipping(release: str, req: str) -> str | None:
    return SKIP.format(req=req) if version_tuple(release) >= SKIP_SINCE else None


def unrecognized(release: str, req: str) -> str | None:
    return UNRECOGNIZED.format(req=req) if version_tuple(release) >= UNRECOGNIZED_SINCE else None


def engine_died(req: str) -> str:
    return ENGINE_DIED.format(req=req)


def engine_deaths(errors: list[str]) -> int:
    """How many of P's logged errors are its engine core dying (at most one per P process)."""
    return sum(e.startswith(ENGINE_DIED_HEAD) for e in errors)
