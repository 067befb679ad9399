"""D's heartbeats as vLLM sends them (0.22+), pure: which requests D's scheduler tracks, when a heartbeat goes out and
what it names, and each request's counts per D rank (docs/requests.md, "Heartbeats and handshakes").

Read in the 0.22.0, 0.26.0, 0.33.0 and 0.34.0 wheels (nixl/base_scheduler.py, nixl/base_worker.py or nixl/worker.py,
nixl/pull_worker.py, nixl/push_scheduler.py):
* on_new_request tracks a request whose params ask for a remote prefill and carry remote_engine_id, remote_request_id,
  remote_host, remote_port and tp_size (any of them None: never tracked, so never heartbeated);
* build_connector_meta packages every tracked request, grouped by engine, once `now - last >= heartbeat_interval`
  (`kv_lease_duration // 6`; last starts at 0, so the first goes at once), for every worker of D: every D rank sends
  the same heartbeats, `HB:<ids>` to each P agent of the engine it handshook with, after the step's READs;
* _send_heartbeats first ensures a handshake with the engine: one it has to start (or that is still running) sends
  nothing this time (`continue  # handshake is still pending`);
* update_connector_output stops a request's heartbeats once it is in finished_recving, which the scheduler's
  output aggregator reports only once every D worker finished it (its READ done or failed; push: P's WRITE
  completed); request_finished (an abort, a refusal) stops them too. Until then every D rank keeps sending them, the
  ranks that finished included. Push mode keeps them while D waits for P's WRITE, however long.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdcheck.vllm.requests.lines import Lifecycle

_REQUIRED = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


def tracks(line: Lifecycle, params: dict[str, Any] | None) -> bool:
    """Whether D's scheduler heartbeats a request with these params (on_new_request)."""
    return (line.heartbeat and isinstance(params, dict) and bool(params.get("do_remote_prefill"))
            and all(params.get(k) is not None for k in _REQUIRED))


class Tracked(msgspec.Struct):
    request: int
    rid: str  # remote_request_id: what HB names
    engine: str
    port: int | None
    lost: bool  # heartbeat-loss: what this D rank sends for it never reaches P


class Beats:
    """One D rank's heartbeat state for a line: the tracked requests (in the order the scheduler took them), the
    throttle, and per request the heartbeats that named it and the handshakes made for it."""

    def __init__(self) -> None:
        self.tracked: dict[int, Tracked] = {}
        self.last = 0.0
        self.named: dict[int, int] = {}  # request -> heartbeats from this D rank that named it (and were sent)
        self.shakes: dict[int, int] = {}  # request -> handshakes this D rank made for it (its own or its heartbeats')
        self.sent = 0  # HB messages this D rank sent (one per P agent)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def track(self, req: Tracked) -> None:
        self.tracked.setdefault(req.request, req)

    def stop(self, request: int) -> None:
        self.tracked.pop(request, None)

    def due(self, now: float, interval: float) -> dict[str, list[Tracked]]:
        """The heartbeat this turn, by engine (empty: none due). interval: the lease / 6."""
        if not self.tracked or interval <= 0 or now - self.last < interval:
            return {}
        self.last = now
        out: dict[str, list[Tracked]] = {}
        for t in self.tracked.values():
            out.setdefault(t.engine, []).append(t)
        return out

    @staticmethod
    def message(reqs: list[Tracked]) -> bytes | None:
        """`HB:id1,id2` of the requests whose heartbeats reach P (None: every one's is lost)."""
        ids = [t.rid for t in reqs if not t.lost]
        return ("HB:" + ",".join(ids)).encode() if ids else None

    def count_sent(self, reqs: list[Tracked], agents: int) -> None:
        self.sent += agents
        for t in reqs:
            if not t.lost:
                self.named[t.request] = self.named.get(t.request, 0) + 1

    def count_shake(self, requests: list[int]) -> None:
        for q in requests:
            self.shakes[q] = self.shakes.get(q, 0) + 1
