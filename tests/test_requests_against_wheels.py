"""pdcheck's request-path models (pdcheck.vllm.requests.lines, .model) against vLLM's own request-path code, read from
unpacked wheels (skipped unless they are there; tests/reqkit.py runs the code).

    for v in 0.9.1 0.11.1 0.14.0 0.26.0 0.34.0; do pip download vllm==$v --no-deps -d /tmp/w$v &&
        mkdir -p /tmp/vllm-src/$v && unzip -q /tmp/w$v/*.whl 'vllm/*.py' -d /tmp/vllm-src/$v; done
    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_requests_against_wheels.py

For every release found there:
- P's request_finished: the kv_transfer_params keys and values, whether freeing is delayed, the expiry it stamps;
- D's done notification (the f-string _read_blocks builds) and P's parsing of it (_get_new_notifs);
- the fault grid on P's side (slow decode past the expiry, dropped and delayed notifications, a heartbeat): the
  release's notification handling and expiry sweep on a clock the test moves, against simulate()'s verdict and
  block accounting for one request;
- D's handling of the params a router forwards (dropped, each bad-params kind) through get_num_new_matched_tokens
  and update_state_after_alloc, against decide();
- the failure policy (kv_load_failure_policy's default, the failure_type names, a failed READ before the policy);
- push mode (pdcheck.vllm.requests.push): where NixlPushConnector exists (factory.py), and for 0.24+ its params, PUSH_REG
  fields, P's handshake with D, failure texts, completion notif_msg, heartbeats, matching, watchdog, notif count.
Where the release and the model disagree and the fix is not pdcheck's to make here, the case is an xfail naming
the difference (strict: it fails once the model follows the release).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from reqkit import Blocks, RequestStatus, Wheel, grouped, key, request

from pdcheck.vllm.requests.faults import Fault
from pdcheck.vllm.requests.lines import FAILURE_TYPES, Lifecycle, line_of
from pdcheck.vllm.requests.model import apply_bad, decide, params_for, run_end, simulate

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))
RELEASES = sorted((p.name for p in SRC.glob("0.*") if (p / "vllm/distributed/kv_transfer").is_dir()
                   and key(p.name) >= (0, 9, 1)), key=key)
pytestmark = pytest.mark.skipif(not RELEASES, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")
_WHEELS: dict[str, Wheel] = {}


def wheel(release: str) -> Wheel:
    if release not in _WHEELS:
        _WHEELS[release] = Wheel(SRC, release)
    w = _WHEELS[release]
    w.log.lines.clear()
    return w


def _flat(ids: Any) -> list[int]:
    return [b for g in ids for b in g] if ids and isinstance(ids[0], list) else list(ids)


# ---- P's request_finished
@pytest.mark.parametrize("release", RELEASES)
def test_request_finished_hands_out_the_release_params(release: str) -> None:
    w, line = wheel(release), line_of(release)
    s = w.scheduler()
    delay, params = s.request_finished(request("req-7", {"do_remote_decode": True}),
                                       ([3, 4],) if grouped(w) else [3, 4])
    assert delay is True and params is not None
    assert sorted(params) == sorted(line.keys), f"{release}: release keys {sorted(params)}"
    mine = params_for(line, 7, [3, 4], "P", 5600, 1, None, [1, 1], request_id="req-7")
    # the per-group shape is checked against the connector's wrap in tests/test_params_values.py
    mine = {**mine, "remote_block_ids": _flat(mine["remote_block_ids"])}
    theirs = {**params, "remote_block_ids": _flat(params["remote_block_ids"])}
    for k in ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
              "tp_size", "remote_blocks_expiry_time", "transfer_mode"):
        if k in theirs:
            assert mine[k] == theirs[k], f"{release}: {k}: model {mine[k]!r}, release {theirs[k]!r}"


@pytest.mark.parametrize("release", RELEASES)
def test_blocks_expire_as_the_release_stamps(release: str) -> None:
    w, line = wheel(release), line_of(release)
    s = w.scheduler()
    s.request_finished(request("req-7", {"do_remote_decode": True}), ([3, 4],) if grouped(w) else [3, 4])
    stamped = getattr(s, "_reqs_need_send", {}).get("req-7")
    if line.expiry == "none":
        assert stamped is None and w._expire_fn is None  # nothing ever frees unread blocks
        return
    assert stamped is not None and stamped - w.clock.now == line.expiry_s
    knob = w.lease_default() if line.expiry == "lease" else w.abort_timeout_default()
    assert knob == line.expiry_s
    assert (w.lease_default() is not None) == (line.expiry == "lease") == line.heartbeat


# ---- the done notification
@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("consumers", [1, 2, 4])
def test_done_notification_format_and_parsing(release: str, consumers: int) -> None:
    w, line = wheel(release), line_of(release)
    assert w.notif_format("req-7", consumers) == line.notification("req-7", consumers)
    assert line.parse_notification(line.notification("req-7", consumers)) == ("req-7", consumers)
    wk = w.worker()
    wk._reqs_to_process.add("req-7")
    wk._reqs_to_send["req-7"] = w.clock.now + 100
    done: set[str] = set()
    for i in range(consumers):  # P frees once every consumer has read
        assert not done, f"freed after {i} of {consumers} notifications"
        wk.nixl_wrapper.inbox.append(line.notification("req-7", consumers))
        done = wk._get_new_notifs()
    assert done == {"req-7"}


@pytest.mark.parametrize("release", RELEASES)
def test_a_bare_request_id_is_refused_by_both(release: str) -> None:
    w, line = wheel(release), line_of(release)
    wk = w.worker()
    wk.nixl_wrapper.inbox.append(b"req-7")
    with pytest.raises(ValueError):
        wk._get_new_notifs()
    with pytest.raises(ValueError):
        line.parse_notification(b"req-7")


# ---- the fault grid on P's side: one request, the release's notification handling and expiry sweep
LEASE = 4.0
TICK = 0.25  # P's engine steps (each calls get_finished)
GRID: dict[str, tuple[Fault, ...]] = {
    "none": (),
    "slow-decode-within": (Fault("slow-decode", 1.0),),
    "slow-decode-past-expiry": (Fault("slow-decode", 6.0),),
    "drop-notif": (Fault("drop-notif"),),
    "drop-notif-slow": (Fault("drop-notif"), Fault("slow-decode", 2.0)),
    "delay-notif-past-expiry": (Fault("delay-notif", 6.0),),
    "delay-notif-within": (Fault("delay-notif", 1.0),),
    "heartbeat-then-late-notif": (Fault("slow-decode", 3.0), Fault("delay-notif", 3.0)),
}


def _release_trace(w: Wheel, line: Lifecycle, faults: tuple[Fault, ...]) -> tuple[str, dict[str, int]]:
    """One request through the release's P (and D's heartbeat), in time order: (verdict, accounting)."""
    w.envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT = int(LEASE)
    s, wk = w.scheduler(lease=LEASE), w.worker(lease=LEASE)
    t0, rid = w.clock.now, "req-0"
    _delay, params = s.request_finished(request(rid, {"do_remote_decode": True}), ([0, 1],) if grouped(w) else [0, 1])
    # start_load_kv's bookkeeping of the scheduler's metadata (reqs_in_batch, reqs_to_send)
    wk._reqs_to_process.add(rid)
    wk._reqs_to_send.update(getattr(s, "_reqs_need_send", {}))
    acc = {"freed": 0, "expired": 0, "late_notifs": 0, "leaked": 0, "held": 0, "engine_died": 0}
    slow = sum(f.seconds for f in faults if f.name == "slow-decode")
    delay = sum(f.seconds for f in faults if f.name == "delay-notif")
    dropped = any(f.name == "drop-notif" for f in faults)
    gone = False
    last = 0.0

    def step(t: float) -> None:
        """P's engine loop up to t: get_finished every TICK s (notifications first, then the expiry sweep); what
        is in the inbox arrives at t."""
        nonlocal gone, last
        inbox, wk.nixl_wrapper.inbox = wk.nixl_wrapper.inbox, []
        while last + TICK < t:
            last += TICK
            w.clock.now = t0 + last
            if rid in w.expire(wk):
                acc["expired"] += 1
                gone = True
        last = t
        w.clock.now = t0 + t
        wk.nixl_wrapper.inbox = inbox
        done = wk._get_new_notifs()
        if rid in done:
            acc["freed"] += 1
            gone = True
        if rid in w.expire(wk):
            acc["expired"] += 1
            gone = True

    step(slow)  # D gets the params; blocks still there?
    verdict = "freed-early" if gone else "delivered"
    beats = w.heartbeats(params, LEASE)  # D's scheduler now tracks it: its heartbeat, before the read
    assert bool(beats) == line.heartbeat
    if beats:
        wk.nixl_wrapper.inbox.extend(beats)
        step(slow)
    if not dropped:
        wk.nixl_wrapper.inbox.append(line.notification(rid, 1))
        before = len(w.log.at("ERROR"))
        try:
            step(slow + delay)
        except KeyError as exc:  # 0.10.0: `del self._reqs_to_send[req_id]` for blocks the sweep already freed
            # the engine core dies on it: the notification was a late one, and nothing runs after it
            assert exc.args == (rid,) and gone, exc
            acc["late_notifs"] += 1
            acc["engine_died"] += 1
            return verdict, acc
        # P's own word for a notification of blocks it already released
        acc["late_notifs"] += sum("unrecognized request" in m for m in w.log.at("ERROR")[before:])
    step(run_end(1, 1.0, faults))
    if not gone:
        acc["held" if w._expire_fn is not None else "leaked"] += 1
    return verdict, acc


def _model(line: Lifecycle, faults: tuple[Fault, ...]) -> tuple[str, dict[str, int]]:
    out, acc = simulate(line, 1, 1.0, 2, 8, LEASE, faults)
    return out[0].verdict, {k: getattr(acc, k) for k in ("freed", "expired", "late_notifs", "leaked", "held",
                                                          "engine_died")}


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", list(GRID))
def test_fault_grid_p_side(release: str, case: str) -> None:
    w, line = wheel(release), line_of(release)
    if line.heartbeat:  # what a heartbeat extends the lease by
        assert w.lease_extension(LEASE) == line.lease_extension(LEASE)
    theirs, mine = _release_trace(w, line, GRID[case]), _model(line, GRID[case])
    assert theirs == mine
    assert bool(theirs[1]["engine_died"]) == (line.late_notif == "raises" and theirs[1]["late_notifs"] > 0)


@pytest.mark.parametrize("release", RELEASES)
def test_heartbeat_message(release: str) -> None:
    """0.22+: D's heartbeat names P's request ids after "HB:", as pdcheck's D sends it (f"HB:{rid}")."""
    w, line = wheel(release), line_of(release)
    params = params_for(line, 7, [3, 4], "P", 5600, 1, None, [1, 1], request_id="req-7")
    assert w.heartbeats(params) == ([b"HB:req-7"] if line.heartbeat else [])


# ---- D's side: the params a router forwards
D_CASES = ("ok", "drop-params", "missing-request-id", "out-of-range", "wrong-engine", "reused-ids", "wrong-tp")


def _release_d(w: Wheel, params: dict[str, Any] | None, built: list[Any] | None = None) -> tuple[str, str]:
    """What D's scheduler does: ("local", ...) prefill it itself; ("recv", ...) schedule the READ; ("parked",
    warning) ask for an async load but schedule no receive (the request waits in WAITING_FOR_REMOTE_KVS with
    nothing to finish it); ("raise", exc) the scheduler raises. built: gets the worker's metadata."""
    s = w.scheduler()
    r = request("d-3", params, status=RequestStatus.WAITING)
    try:
        if hasattr(s, "on_new_request"):
            s.on_new_request(r)
        n, load_async = s.get_num_new_matched_tokens(r, 0)
        s.update_state_after_alloc(r, Blocks([5, 6], grouped(w)), n)
        if "d-3" in s._reqs_need_recv:  # build_connector_meta's conversion into the worker's metadata
            meta = w.g["NixlConnectorMetadata"]()
            add = getattr(meta, "add_new_req_to_recv", None) or meta.add_new_req
            # block ids per KV cache group where the release groups them (0.32+ read them group by group)
            add(request_id="d-3", local_block_ids=([5, 6],) if grouped(w) else [5, 6],
                kv_transfer_params=r.kv_transfer_params)
            if built is not None:
                built.append(meta)
    except Exception as exc:  # noqa: BLE001 - the release's own exception is the outcome
        return "raise", f"{type(exc).__name__}: {exc}"
    if "d-3" in s._reqs_need_recv:
        return "recv", ""
    if n and load_async:
        return "parked", (w.log.at("WARNING") or [""])[-1]
    return "local", ""


@pytest.mark.parametrize("release", RELEASES)
@pytest.mark.parametrize("case", D_CASES)
def test_d_side_params(release: str, case: str, request: pytest.FixtureRequest) -> None:
    w, line = wheel(release), line_of(release)
    p: dict[str, Any] | None = params_for(line, 3, [3, 4], "P", 5600, 1, None, [1, 1])
    if case == "drop-params":
        p = None
    elif case != "ok":
        p = apply_bad(p, case, 8, [1, 2])
    mine = decide(line, 3, None if p is None else dict(p), "P", 8, 0.0)
    theirs, detail = _release_d(w, None if p is None else dict(p))
    if theirs == "parked":
        # update_state_after_alloc refuses params without remote_request_id after get_num_new_matched_tokens
        # asked for an async load: no receive is scheduled and the request waits in WAITING_FOR_REMOTE_KVS.
        assert mine is not None and mine[0] == "hang" and "WAITING_FOR_REMOTE_KVS" in mine[1], mine
    elif theirs == "local":
        assert mine is not None and mine[0] == "recomputed", (theirs, mine)
    elif theirs == "raise":
        assert mine is not None and mine[0] == "error" and detail.split(":")[0] in mine[1], (detail, mine)
    elif theirs == "recv":
        # The release reads; the model either reads too, or (wrong engine) fails the handshake as the release's
        # worker does when it checks the engine id of the metadata it receives.
        if case == "wrong-engine" and w.engine_id_checked():
            assert mine is not None and "engine" in mine[1].lower(), mine
        else:
            assert mine is None, (case, mine)
    else:
        assert mine is not None and mine[0] == "hang", (theirs, detail, mine)


@pytest.mark.parametrize("release", RELEASES)
def test_wrong_tp_never_reaches_the_read(release: str) -> None:
    """bad-params:wrong-tp (tp_size 2, P runs TP 1): the release's scheduler schedules the READ, its worker's
    start_load_kv reads with the TP recorded at the handshake when the engine is known (the request path's D
    handshook at the line's start), and hands the params' tp_size only to a first handshake. pdcheck: read,
    delivered; the corrected path refuses it."""
    w, line = wheel(release), line_of(release)
    p = apply_bad(params_for(line, 3, [3, 4], "P", 5600, 1, None, [1, 1]), "wrong-tp", 8, None)
    built: list[Any] = []
    assert _release_d(w, dict(p), built) == ("recv", "")
    what, looked = w.load(built[0], known=True)
    assert what == "read", (what, looked)
    for fn in ("_read_blocks_for_req", "_read_blocks"):  # the READ itself never looks at the params' tp_size
        assert "meta.tp_size" not in w.worker_src.get(fn, ""), fn
    assert w.load(built[0], known=False) == ("handshake", None if key(release) < (0, 9, 2) else 2)
    assert decide(line, 3, dict(p), "P", 8, 0.0) is None
    out, _acc = simulate(line, 4, 10.0, 2, 8, 0.5, (Fault("bad-params", kind="wrong-tp", request=1),))
    assert [o.verdict for o in out] == ["delivered"] * 4
    corrected = line_of("corrected")
    assert decide(corrected, 3, params_for(corrected, 3, [3, 4], "P", 5600, 2, None, [1, 1]), "P", 8, 0.0) == (
        "recomputed", "kv_transfer_params say tp_size 2, but engine P's handshake recorded TP 1: refused, recomputed")


# ---- the failure policy
@pytest.mark.parametrize("release", RELEASES)
def test_failure_policy(release: str) -> None:
    w, line = wheel(release), line_of(release)
    default = w.failure_policy_default()
    if default is not None:  # 0.13+: kv_load_failure_policy's default decides
        assert line.on_failure == default, f"{release}: kv_load_failure_policy defaults to {default!r}"
    else:  # before it: a failed transfer state either raises (engine crash) or marks the blocks invalid
        wk = w.worker()
        wk.nixl_wrapper.states[11] = "ERR"
        wk.nixl_wrapper.get_xfer_telemetry = lambda h: None
        wk._recving_transfers["d-3"].append((11, 0.0))
        wk._recving_metadata["d-3"] = type("M", (), {"local_block_ids": [5, 6]})()
        try:
            wk._pop_done_transfers(wk._recving_transfers)
            seen = "recompute" if wk._invalid_block_ids == {5, 6} else "?"
        except RuntimeError:
            seen = "crash"
        assert line.on_failure == seen
    types_ = w.failure_types()
    if types_:  # 0.14+: NIXL transfer failure: <failure_type>
        assert types_ <= set(FAILURE_TYPES), types_ - set(FAILURE_TYPES)
        assert (w.failure_log() or "").startswith("NIXL transfer failure: %s")
        assert line.failure_log.startswith("NIXL transfer failure: ")
    else:
        assert not line.failure_log.startswith("NIXL transfer failure")


# ---- push mode: D's PUSH_REG names D's side channel; P handshakes with D there before its WRITE
def _push_releases() -> list[str]:
    from pdcheck.vllm.requests import push

    return [r for r in RELEASES if push.available(key(r))
            and (SRC / r / "vllm/distributed/kv_transfer/kv_connector/v1/nixl/push_worker.py").is_file()]


# None found (only releases before NixlPushConnector unpacked): one case that says why, not an empty set
PUSH_RELEASES = _push_releases() or [pytest.param(None, marks=pytest.mark.skip(
    reason="no unpacked release has NixlPushConnector (nixl/push_worker.py, 0.24+)"))]


@pytest.mark.parametrize("release", PUSH_RELEASES)
def test_push_registration_names_ds_side_channel_and_p_handshakes_there(release: str) -> None:
    import ast

    import msgspec

    from pdcheck.vllm.requests import push

    nixl = SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
    staged = next(n.value for n in ast.walk(ast.parse((nixl / "push_scheduler.py").read_text()))
                  if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)
                  and "_push_pending_registrations" in ast.unparse(n.targets[0]))
    fields = {ast.literal_eval(k): ast.unparse(v) for k, v in zip(staged.keys, staged.values, strict=True) if k}
    line = line_of(release)
    reg = push.registration("r-0a1b2c3d", "D", "h", 7, [1], {}, line)
    ours = msgspec.msgpack.decode(reg[len(push.PUSH_REG_PREFIX):])
    assert set(fields) == set(ours)
    assert (fields["decode_host"], fields["decode_port"]) == ("self.side_channel_host", "self.side_channel_port")
    worker = (nixl / "push_worker.py").read_text()
    start = worker[worker.index("def _do_start_push_kv"):]
    start = start[:start.index("\n    def ", 10)]
    assert 'registration_data["decode_host"]' in start or "decode_host," in start  # P dials D's side channel
    if push.handshake_joins(line):  # the handshake executor's future; the WRITE deferred until it is done
        assert "self._ensure_handshake(" in start and 'failure_type="push_handshake_failed"' in start
    else:  # 0.24-0.26: blocking on the writer, one try per request
        assert "_ensure_d_handshake(" in start and '"Failed handshake to D %s for push %s"' in worker


def _push_sources(release: str) -> tuple[str, str]:
    nixl = SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
    return (nixl / "push_scheduler.py").read_text(), (nixl / "push_worker.py").read_text()


@pytest.mark.parametrize("release", RELEASES)
def test_push_mode_exists_where_the_model_says(release: str) -> None:
    """push.available against the wheel: factory.py registers NixlPushConnector exactly from PUSH_SINCE."""
    from pdcheck.vllm.requests import push

    factory = (SRC / release / "vllm/distributed/kv_transfer/kv_connector/factory.py").read_text()
    assert push.available(key(release)) == ('"NixlPushConnector"' in factory)


@pytest.mark.parametrize("release", PUSH_RELEASES)
def test_push_params_are_the_release_params(release: str) -> None:
    """The keys of the dict push request_finished returns, against push.keys (0.24/0.25: no pp_size)."""
    import ast

    from pdcheck.vllm.requests import push

    scheduler, _ = _push_sources(release)
    fn = next(n for n in ast.walk(ast.parse(scheduler))
              if isinstance(n, ast.FunctionDef) and n.name == "request_finished")
    returned = next(n.value.elts[1] for n in ast.walk(fn) if isinstance(n, ast.Return)
                    and isinstance(n.value, ast.Tuple) and isinstance(n.value.elts[1], ast.Call))
    assert {k.arg for k in returned.keywords} == set(push.keys(line_of(release)))
    # D-side finishing (abort-d): not a P-side request, so the blocks are not kept for the WRITE to come
    body = ast.unparse(fn)
    assert "if not is_p_node:\n        return (False, None)" in body


@pytest.mark.parametrize("release", PUSH_RELEASES)
def test_push_texts_and_completion(release: str) -> None:
    """The failure_type texts, the completion notif_msg, the heartbeat forwarding, the id matching, the watchdog's
    default and D's count of completion notifications, against push.py."""
    from pdcheck.vllm.requests import push

    scheduler, worker = _push_sources(release)
    line = line_of(release)
    for failure in ("push_reg_handshake_failed", "push_reg_notif_failed", "transfer_setup_failed"):
        assert f'failure_type="{failure}"' in worker
    assert f'msg="{push.WRITE_FAIL_LOG.split(". ", 1)[1]}"' in worker
    assert push.completion("R", 2) == b"R:2" and 'notif_id = f"{remote_request_id}:{self.world_size}"' in worker
    assert 'if msg.startswith("HB:"):\n' in worker and "self._handle_heartbeat(msg[3:])" in worker
    assert "get_base_request_id(reg_id) == base_id" in worker and push.base_id("r-0a1b2c3d") == "r"
    assert '"push_registration_timeout",\n                self.decoder_kv_blocks_ttl,' in scheduler
    counts = "expected_notifs = meta.pp_size * producers_per_consumer" in worker
    assert counts == push.has_pp(line)
    assert push.expected_notifs(4, 1, 2, line) == (8 if counts else 1)
