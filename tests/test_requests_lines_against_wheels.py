"""The request path's last details against vLLM's own code, read from unpacked wheels (issue #37; skipped unless
PDCHECK_VLLM_SRC has them, as tests/test_requests_against_wheels.py): the expiry line's count, the handshake
failure's line, where a failed post is transfer_setup_failed, which requests D's scheduler heartbeats, the
registration generation TP N hands out, and 0.33+'s handshake again after one a heartbeat started.

    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_requests_lines_against_wheels.py
"""

from __future__ import annotations

import ast
from types import SimpleNamespace as NS
from typing import Any

import pytest
from reqkit import grouped, key
from test_requests_against_wheels import RELEASES, _release_d, wheel

from pdcheck.vllm.requests import texts
from pdcheck.vllm.requests.heartbeat import tracks
from pdcheck.vllm.requests.lines import line_of
from pdcheck.vllm.requests.model import params_for

pytestmark = pytest.mark.skipif(not RELEASES, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")
LEASE = 4.0


@pytest.mark.parametrize("release", RELEASES)
def test_the_expiry_line_counts_the_notifications_p_got(release: str) -> None:
    # A request two consumers read: one notification arrives, then the lease (abort timeout) passes. P's sweep
    # logs how many it got (consumer_notification_counts_by_req); 0.10.0 frees without a word; before, nothing
    # expires.
    w, line = wheel(release), line_of(release)
    w.envs.VLLM_NIXL_ABORT_REQUEST_TIMEOUT = int(LEASE)
    wk = w.worker(lease=LEASE)
    wk._reqs_to_process.add("req-7")
    wk._reqs_to_send["req-7"] = w.clock.now + LEASE
    wk.nixl_wrapper.inbox.append(line.notification("req-7", 2))
    assert wk._get_new_notifs() == set()  # the other consumer has not read yet
    w.clock.now += LEASE + 1
    done = w.expire(wk)
    said = w.log.at("WARNING")
    if line.expiry == "none":
        assert done == set() and not said
    elif not line.expiry_log:
        assert done == {"req-7"} and not said, said  # 0.10.0
    else:
        assert done == {"req-7"} and said == [line.expiry_log.format(req="req-7", n=1, s=LEASE)], said


@pytest.mark.parametrize("release", RELEASES)
def test_a_failed_handshakes_line_and_the_skipping_warning(release: str) -> None:
    # request_ready's _log_failure(failure_type="handshake_failed", req_id, error=e, meta=meta): the request's meta in
    # the context, the same keys pdcheck's D puts there (texts.failure_log); from 0.22 get_finished then warns that
    # it skips the failed request's KV post-processing
    w = wheel(release)
    wk = w.worker()
    skip = "Skipping KV post-processing for failed request %s" in w.worker_text
    assert skip == (texts.skipping(release, "r") is not None)
    if not hasattr(wk, "_log_failure"):
        assert texts.failure_log(release, "handshake_failed", {}) is None
        return
    ids = ([5, 6],) if grouped(w) else [5, 6]
    meta = NS(remote=NS(engine_id="P-other", request_id="req-3", host="127.0.0.1", port=5600, block_ids=ids),
              local_block_ids=ids)
    wk._log_failure(failure_type="handshake_failed", req_id="d-3", error=RuntimeError("mismatch"), meta=meta)
    context: dict[str, Any] = {"request_id": "d-3", "engine_id": "P", "remote_engine_id": "P-other",
                               "remote_request_id": "req-3", "remote_host": "127.0.0.1", "remote_port": 5600,
                               "num_local_blocks": 2, "num_remote_blocks": 2, "local_block_ids_sample": [5, 6]}
    assert w.log.at("ERROR") == [texts.failure_log(release, "handshake_failed", context)]


def _calls_in(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr
               for n in ast.walk(node))


@pytest.mark.parametrize("release", RELEASES)
def test_a_post_that_raises_is_transfer_setup_failed(release: str) -> None:
    # _read_blocks posts inside one try (make_prepped_xfer, then transfer): whatever it raises, a peer gone at post
    # time included (NIXL_ERR_REMOTE_DISCONNECT), is logged as transfer_setup_failed; transfer_failed is
    # _pop_done_transfers' for a state that came back failed
    w = wheel(release)
    if key(release) < texts.FAILURE_LOG_SINCE:
        return
    fn = ast.parse(w.worker_src["_read_blocks"])
    tries = [t for t in ast.walk(fn) if isinstance(t, ast.Try) and any(_calls_in(s, "transfer") for s in t.body)]
    assert tries, release
    for t in tries:
        text = "".join(ast.unparse(h) for h in t.handlers)
        assert 'failure_type="transfer_setup_failed"' in text.replace("'", '"'), text
    assert 'failure_type="transfer_failed"' in w.worker_src["_pop_done_transfers"].replace("'", '"')


PARAMS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port", "tp_size")


@pytest.mark.parametrize("release", RELEASES)
def test_which_requests_ds_scheduler_heartbeats(release: str) -> None:
    w, line = wheel(release), line_of(release)
    p = params_for(line, 3, [3, 4], "P", 5600, 1, None, [1, 1], "req-3")
    p.setdefault("tp_size", 1)  # 0.9.1 hands out none
    assert bool(w.heartbeats(dict(p), LEASE)) == tracks(line, p) == line.heartbeat
    for k in PARAMS:  # on_new_request tracks only params with every one of these
        q = {a: b for a, b in p.items() if a != k}
        assert bool(w.heartbeats(q, LEASE)) == tracks(line, q), k


@pytest.mark.parametrize("release", RELEASES)
def test_the_registration_generation_counts_every_workers_metadata(release: str) -> None:
    # set_xfer_handshake_metadata: one increment per (PP, TP) rank whose payload changed, all ranks passed at once at
    # start-up: a P of TP N hands out N (pdcheck's P: its tp_size)
    w, line = wheel(release), line_of(release)
    src = w.sched_src.get("set_xfer_handshake_metadata", "")
    has = "remote_registration_generation" in line.keys
    assert ("_registration_generation += 1" in src) == has
    if has:
        loops = [n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.For) and "metadata.items()" in ast.unparse(
            n.iter) and "_registration_generation += 1" in ast.unparse(n)]
        assert loops, src


@pytest.mark.parametrize("release", RELEASES)
def test_a_second_handshake_after_one_a_heartbeat_started(release: str) -> None:
    # A heartbeat's _ensure_handshake loads the engine but records no registration generation; the request's READ
    # (_read_blocks_for_req, 0.33+) finds the params' generation newer than the none recorded, drops the engine
    # (_cleanup_remote_engine) and handshakes again. pdcheck's D (RequestsD.generation) does so exactly where the
    # params carry a generation.
    w, line = wheel(release), line_of(release)
    p = params_for(line, 3, [3, 4], "P", 5600, 2, None, [1, 1], "req-3", 2)
    built: list[Any] = []
    assert _release_d(w, dict(p), built)[0] == "recv"
    remote = {"P": {0: "P-agent"}}
    gone: list[str] = []

    def cleanup(engine: str, **_k: Any) -> None:
        gone.append(engine)
        remote.pop(engine, None)

    what, _ = w.load(built[0], known=True, _remote_agents=remote, _remote_registration_generations={},
                     _cleanup_remote_engine=cleanup)
    again = "remote_registration_generation" in line.keys
    assert (what, gone) == (("handshake", ["P"]) if again else ("read", [])), (what, gone)
    # a READ after a handshake of the request's own (the generation recorded then): no second one
    assert w.load(built[0], known=True, _remote_registration_generations={"P": 2})[0] == "read"
