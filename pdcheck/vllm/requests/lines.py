"""The request lifecycle of each vLLM release line, as data: what P hands out, how D says it is done, when P
frees the blocks, and what a failed load does.

Facts from the release wheels (nixl_connector.py; nixl/pull_scheduler.py, base_scheduler.py, base_worker.py,
pull_worker.py; config/kv_transfer.py), listed in docs/release-models.md and docs/requests.md:
* kv_transfer_params keys: pdcheck.vllm.releases.params, the one table (remote_blocks_expiry_time is None in what P
  returns).
* done notification: 0.9.0 "{req}"; 0.9.1-0.12 "{req}:{tp_ratio}"; 0.13 "{remote_request_id}:{tp_ratio}";
  0.14 "{remote_request_id}:{world}"; 0.34 "{remote_request_id}:{expected_consumers}" (and "HB:<ids>" heartbeats).
* a done notification after the expiry freed the blocks: 0.10.0's P raises KeyError in _get_new_notifs and its
  engine core dies (texts.ENGINE_DIED); 0.10.1+ log it (texts.UNRECOGNIZED) and go on.
* freeing without a notification: never before 0.10 (a leak); VLLM_NIXL_ABORT_REQUEST_TIMEOUT 120 s in 0.10.x
  and 0.11.0, 480 s from 0.11.1 ("Releasing expired KV blocks for request %s which were retrieved by %d decode
  worker(s) within %d seconds."); from 0.22 a lease, kv_lease_duration (30 s), renewed by D's heartbeats every
  lease // 6 s for requests D's scheduler tracks ("... retrieved by %d remote worker(s) before lease expired.").
  (0.15.0 - 0.25.0 wheels, nixl_connector.py / nixl/scheduler.py, worker.py: remote_num_tokens from 0.21.0, the
  lease, HB: and _lease_extension = lease * 2 // 3 from 0.22.0 in place of the abort timeout.)
* a failed load: before 0.11.1 the worker raises (engine crash); 0.11.1 marks the blocks invalid and recomputes
  (#26171); 0.13 kv_load_failure_policy exists (default recompute, still in 0.14.0, 0.15.0, 0.15.1 and
  0.16.0); default fail from 0.17.0 (config/kv_transfer.py of each of those wheels); 0.14+ logs
  "NIXL transfer failure: <failure_type>".
* params without remote_request_id, 0.13 to 0.34: get_num_new_matched_tokens asks for an async load (it looks
  at do_remote_prefill only), then update_state_after_alloc checks every key, logs "Got invalid KVTransferParams:
  ... This request will not utilize KVTransfer" and schedules no receive, so the request waits in
  WAITING_FOR_REMOTE_KVS for a receive that never comes (a hang; P's blocks wait for the timeout or lease).
* a tp_size that is not P's (bad-params:wrong-tp), D already handshook with the engine (the request path's D
  does at each line's start): no line reads it. 0.9.0 has no heterogeneous TP, 0.9.1 takes tp_size from P rank
  0's metadata; 0.9.2 to 0.34 pass the params' tp_size (`.get("tp_size", 1)`) only to the handshake
  (_background_nixl_handshake / _ensure_handshake), which start_load_kv (0.34: _read_blocks_for_req) starts
  only for an engine missing from _remote_agents; the READ uses the TP recorded at that handshake (_tp_size,
  transfer_topo's remote_tp_size). Push mode (0.24+): PUSH_REG's remote_tp_size feeds the same no-op
  _ensure_handshake, and P WRITEs by decode_tp_size. So the request is read and delivered. Only a first contact
  (or a re-handshake: engine_ttl 3600 s, 0.34's registration generation) uses it: hazards H11 / H12, the
  handshake command's territory.
"""

from __future__ import annotations

import msgspec

from pdcheck.releaseline import CORRECTED as LINE_CORRECTED
from pdcheck.releaseline import CORRECTED_VERSION, ReleaseTable, is_corrected, version_tuple
from pdcheck.vllm.releases import params

BASE_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_host",
             "remote_port")
FAILURE_TYPES = ("handshake_setup_failed", "handshake_failed", "transfer_setup_failed", "transfer_failed",
                 "transfer_exception", "transfer_release_failed", "notification_failed")


class Lifecycle(msgspec.Struct, frozen=True):
    """One release line's request path (pull mode)."""

    line: str  # first release of the line, e.g. "0.11.1"
    first: tuple[int, int, int]
    keys: tuple[str, ...]  # kv_transfer_params P returns from request_finished
    notif: str  # D's done notification; {req} {n}
    expiry: str  # "none" | "abort-timeout" | "lease"
    expiry_s: float | None  # the release's default (None: never freed without a notification)
    expiry_knob: str  # the env var or config key that sets it
    expiry_log: str  # P's warning when it frees unread blocks
    heartbeat: bool  # D renews the lease of requests its scheduler tracks
    on_failure: str  # "crash" | "recompute" | "fail": what a failed READ does to the request
    failure_log: str  # what the release logs for a failed READ
    missing_request_id: str  # "n/a" | "hang" | "recompute": params without remote_request_id
    engine_id_checked: bool  # 0.10+: the handshake refuses metadata of another engine id
    # A done notification for blocks the expiry already freed: "logged" (P logs it and goes on; 0.10.1+), or
    # "raises" (0.10.0: _get_new_notifs' `del self._reqs_to_send[req_id]` raises KeyError, the engine core dies).
    late_notif: str = "logged"

    @property
    def notif_key(self) -> str:
        return "remote_request_id" if "remote_request_id" in self.keys else "request_id"

    def lease(self, asked: float | None) -> float | None:
        """The lease P runs with: none where the release frees no unread blocks (before 0.10), else the one asked
        for (--lease, a scenario's lease), else the release's default."""
        if self.expiry == "none":
            return None
        return asked if asked is not None else self.expiry_s

    def lease_extension(self, lease: float, time_scale: float = 1.0) -> float:
        """How far past now a heartbeat pushes the lease (never shortening it): vLLM's `_lease_extension =
        kv_lease_duration * 2 // 3` (0.22+ worker; whole seconds, so a 1 s lease is never extended); a
        sub-second --lease (time scaled down for a test) keeps the 2/3; the corrected path renews the whole lease.
        time_scale: the run in slow motion; the whole seconds are the scenario's, before it stretched."""
        if is_corrected(self):
            return lease
        own = lease / time_scale
        return time_scale * (own * 2 // 3 if own >= 1 else own * 2 / 3)

    def notification(self, req: str, consumers: int = 1) -> bytes:
        return self.notif.format(req=req, n=consumers).encode()

    def parse_notification(self, raw: bytes) -> tuple[str, int]:
        """P's side: (request id, consumers) as the release unpacks it (rsplit(":", 1) from 0.9.1)."""
        text = raw.decode(errors="replace")
        if "{n}" not in self.notif:
            return text, 1
        req, n = text.rsplit(":", 1)  # a bare id raises ValueError, as vLLM's P does (0.9.0 D, 0.9.1+ P)
        return req, int(n)


_NOTIF_N = "{req}:{n}"
_ABORT_LOG = ("Releasing expired KV blocks for request {req} which were retrieved by {n} decode worker(s) within "
              "{s:g} seconds.")
_LEASE_LOG = "Releasing expired KV blocks for request {req} which were retrieved by {n} remote worker(s) before " \
             "lease expired."
_CRASH = "_read_blocks does not catch it: the worker raises and the engine dies"
_RECOMPUTE = "Handshake/transfer failed for request {req}, marking blocks as invalid (recomputed)"
_FAILURE = "NIXL transfer failure: transfer_failed | Context: {{'request_id': '{req}'}}"

# Each line's facts from its first release on; `keys` is filled from the one params table (releases.params),
# and a release where the params keys change starts a line of its own (see LINES below).
_FACTS: tuple[Lifecycle, ...] = (
    Lifecycle("0.9.0", (0, 9, 0), (), "{req}", "none", None, "-", "", False, "crash", _CRASH, "n/a", False),
    Lifecycle("0.9.1", (0, 9, 1), (), _NOTIF_N, "none", None, "-", "", False, "crash", _CRASH, "n/a", False),
    # 0.10.0 frees expired blocks without a word (get_finished: `del self._reqs_to_send[req_id]`); 0.10.1 logs them
    Lifecycle("0.10.0", (0, 10, 0), (), _NOTIF_N, "abort-timeout", 120.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              "", False, "crash", _CRASH, "n/a", True, late_notif="raises"),
    # the same facts; _get_new_notifs logs a notification for a request it no longer holds (texts.UNRECOGNIZED)
    Lifecycle("0.10.1", (0, 10, 1), (), _NOTIF_N, "abort-timeout", 120.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "crash", _CRASH, "n/a", True),
    Lifecycle("0.11.1", (0, 11, 1), (), _NOTIF_N, "abort-timeout", 480.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "recompute", _RECOMPUTE, "n/a", True),
    Lifecycle("0.13.0", (0, 13, 0), (), _NOTIF_N, "abort-timeout", 480.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "recompute", _RECOMPUTE, "hang", True),
    Lifecycle("0.14.0", (0, 14, 0), (), _NOTIF_N, "abort-timeout", 480.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "recompute", _FAILURE, "hang", True),
    # the same request path as 0.14; an aborted request's blocks wait for its READ (ABORT_WAITS_READ_SINCE)
    Lifecycle("0.16.0", (0, 16, 0), (), _NOTIF_N, "abort-timeout", 480.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "recompute", _FAILURE, "hang", True),
    Lifecycle("0.17.0", (0, 17, 0), (), _NOTIF_N, "abort-timeout", 480.0, "VLLM_NIXL_ABORT_REQUEST_TIMEOUT",
              _ABORT_LOG, False, "fail", _FAILURE, "hang", True),
    Lifecycle("0.22.0", (0, 22, 0), (), _NOTIF_N, "lease", 30.0, "kv_lease_duration", _LEASE_LOG, True,
              "fail", _FAILURE, "hang", True),
    # the same request path as 0.22; push mode (NixlPushConnector, push.PUSH_SINCE) starts here
    Lifecycle("0.24.0", (0, 24, 0), (), _NOTIF_N, "lease", 30.0, "kv_lease_duration", _LEASE_LOG, True,
              "fail", _FAILURE, "hang", True),
    # the same facts; push mode's handshake with D joins one future (push.handshake_joins) from here
    Lifecycle("0.27.0", (0, 27, 0), (), _NOTIF_N, "lease", 30.0, "kv_lease_duration", _LEASE_LOG, True,
              "fail", _FAILURE, "hang", True),
    # the same facts; the pull worker reads per request (_read_blocks_for_req) and D's notification names the
    # expected consumers, which the model counts as before
    Lifecycle("0.34.0", (0, 34, 0), (), _NOTIF_N, "lease", 30.0, "kv_lease_duration", _LEASE_LOG, True,
              "fail", _FAILURE, "hang", True),
)


def _lines() -> tuple[Lifecycle, ...]:
    """A line from every release where a fact or the params keys (pull or push) change."""
    firsts = sorted({ln.first for ln in _FACTS} | set(params.changes()))
    out = []
    for first in firsts:
        facts = [ln for ln in _FACTS if ln.first <= first][-1]
        name = ".".join(map(str, first))
        out.append(msgspec.structs.replace(facts, line=name, first=first, keys=params.pull_keys(first)))
    return tuple(out)


LINES: tuple[Lifecycle, ...] = _lines()
_TABLE: ReleaseTable[Lifecycle] = ReleaseTable.from_firsts([(ln.first, ln) for ln in LINES], last=params.PULL.last)

# The corrected request path: a lease renewed by D's heartbeats from the moment the router hands D the params,
# an expiry time and a per-block generation in the params (D refuses blocks P may have freed and recomputes),
# every key checked before a READ, a clear failure_type, and P frees unread blocks only at the lease.
CORRECTED = Lifecycle(LINE_CORRECTED, CORRECTED_VERSION, (*params.pull_keys(params.PULL.last), "block_generations"),
                      _NOTIF_N, "lease", 30.0, "kv_lease_duration", _LEASE_LOG, True, "recompute", _FAILURE,
                      "recompute", True)


# abort-d: from 0.16.0 the scheduler's finish_requests keeps the blocks of a request aborted in
# WAITING_FOR_REMOTE_KVS until its READ is done (delay_free_blocks); 0.14.0's and 0.15.0's free them at once,
# under the READ (vllm/v1/core/sched/scheduler.py of every x.y.0 wheel from 0.14.0 to 0.26.0).
ABORT_WAITS_READ_SINCE = (0, 16, 0)


def abort_waits_read(line: Lifecycle) -> bool:
    return line is CORRECTED or line.first >= ABORT_WAITS_READ_SINCE


POLICIES = ("fail", "recompute")
POLICY_SINCE = (0, 13, 0)  # kv_load_failure_policy exists from here (config/kv_transfer.py)


def with_policy(line: Lifecycle, policy: str | None) -> Lifecycle:
    """The line as deployed with kv_load_failure_policy set (lines before 0.13 and corrected have none)."""
    if policy is None or line is CORRECTED or line.first < POLICY_SINCE:
        return line
    return msgspec.structs.replace(line, on_failure=policy)


def line_of(version: str) -> Lifecycle:
    """The lifecycle line of a release ('0.14.1', 'corrected')."""
    if is_corrected(version):
        return CORRECTED
    return _TABLE.clamped(version_tuple(version))
