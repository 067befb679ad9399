"""What a snapshot of a pdcheck document keeps: everything a run decides (verdicts, texts, counts, models,
accounting), nothing the machine decides (times, ports the OS picked, the order in which concurrent ranks
happened to answer, which free block a racing allocation took). tests/test_snapshots.py."""

from __future__ import annotations

import os
import re
from typing import Any

# Measured or OS-given: dropped wherever they appear.
DROP = {
    "seconds", "latency_s", "router_lag_s", "stall_s", "timeline", "timings", "remote_port", "endpoint",
    "remote_blocks_expiry_time", "version",
    # a request line a stall voided ran again in slower motion (docs/requests.md, "Stalls"): same verdicts
    "time_scale", "voided",
    # Racy by nature in real processes: how many heartbeats fit in a wait, which free block an allocation that
    # raced an expiry took, which request a late READ found there.
    "heartbeats", "remote_block_ids", "block_generations", "found_request",
    # whether a delivered request's done notification beat its lease, per P rank (accounting merges the two)
    "late_notifs",
}
# Lists whose order is arrival order of concurrent ranks: compared as sets.
UNORDERED = {"notifications", "registered"}
# P's log lines on expiries and notifications: each distinct line (request ids aside) once. A delivered request
# whose done notification a loaded machine delays past its lease adds an expiry line and a late-notification
# warning for its id: the same lines the scenario's own late requests print.
LOG_LISTS = {"expiry_log", "notif_errors"}
_SUBS = [
    (re.compile(r"(127\.0\.0\.1|localhost):\d+"), r"\1:PORT"),
    (re.compile(r"'remote_port': \d+"), "'remote_port': PORT"),
    (re.compile(r"'remote_host': '[^']*'"), "'remote_host': HOST"),
    # the NIXL READ's state when an abort lands: PROC or DONE as the transfer raced it
    (re.compile(r"the READ's state at the abort: [A-Z]+"), "the READ's state at the abort: STATE"),
    # measured lengths in a text ("P freed the blocks (expired) 0.70 s before D read them")
    (re.compile(r"\b\d+\.\d+ s\b"), "T s"),
    # which request a freed block went to next, and its generation: the allocation that raced the expiry
    (re.compile(r"block \d+ holds request \d+'s KV \(generation \d+\)"), "block B holds request R's KV (generation G)"),
]


_REQ_ID = re.compile(r"req-\d+\.\d+")


def _text(s: str) -> str:
    for pat, rep in _SUBS:
        s = pat.sub(rep, s)
    # P's request ids name the run of a line (req-RUN.REQUEST): a line a stall voided runs again with new ones
    return _REQ_ID.sub("req-ID", s)


def normalize(doc: Any, key: str = "") -> Any:
    if isinstance(doc, dict):
        if key == "accounting" and {"freed", "expired", "late_notifs"} <= doc.keys():
            # P's block accounting: whether a delivered request's done notification beat its lease (freed) or
            # came after it (expired, a late notification) is the machine's timing; their sum is the run's
            doc = {**doc, "freed": doc["freed"] + doc["expired"], "expired": "in freed"}
        if isinstance(doc.get("time_scale"), (int, float)) and isinstance(doc.get("expiry_s"), (int, float)):
            # a line that ran again in slower motion states its lease stretched: the scenario's, as written
            doc = {**doc, "expiry_s": round(doc["expiry_s"] / doc["time_scale"], 6)}
        return {k: normalize(v, k) for k, v in doc.items() if k not in DROP}
    if isinstance(doc, list):
        items = [normalize(v) for v in doc]
        if key in LOG_LISTS:  # P's lines on expiries and late notifications: which delivered requests came late is timing
            return sorted({_REQ_ID.sub("req-ID", x) if isinstance(x, str) else repr(x) for x in items})
        return sorted(items, key=repr) if key in UNORDERED else items
    if isinstance(doc, str):
        return _text(doc)
    return doc


def env() -> dict[str, str]:
    """The environment a golden run gets: the suite's slow motion (tests/loadkit.py) scales a request run's
    lengths, which its document reports; smoke and the command are compared at the lengths written."""
    from pdcheck.vllm.requests.plan import TIME_SCALE_ENV

    return {k: v for k, v in os.environ.items() if k != TIME_SCALE_ENV}


def source(path: str) -> str:
    """A scenario file's path as the snapshot names it: from the scenarios directory on."""
    return path[path.index("scenarios/"):] if "scenarios/" in path else path
