"""TensorRT-LLM's fake generation (decode) rank on pdcheck's rank skeleton, one line (era) after another.

Python lines (docs/trtllm-protocol.md §3.3): REQUEST_INSTANCE_INFO to the ctx's info endpoint on a fresh DEALER
(no timeout, T21), the era's gate (W3's, T70; the corrected one), REGISTER_RANK_INFO to every ctx Sender,
REQUEST_DATA to the ctx ranks it overlaps (T22, T46), then the era's result frames on its Receiver ROUTER until
every overlapping rank answered (T26). Every wait drives the rank's NIXL worker, so the ctx's WRITEs into its pool
complete. A wait ends when its answer comes, when the parent says nothing more can come (TrtGiveUp: the era's
hang, the corrected deadline), or at pdcheck's cap. Then the transfer proof checks every row of the request's
blocks (pdcheck/trtllm/pool.py). The C++ line's conversation lives in pdcheck/trtllm/cpp.py."""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from pdcheck import bounds as b
from pdcheck import messages as m
from pdcheck.ranks import run_rank
from pdcheck.trtllm import checks, cpp, eras, wire
from pdcheck.trtllm.eras.base import PEER_INCOMPATIBLE, RESULT_FAILED, TIMEOUT_CANCEL, TrtLine
from pdcheck.trtllm.layout import peer_ranks, view_of
from pdcheck.trtllm.maps import Req, WireError
from pdcheck.trtllm.messages import GenResult, TrtGenDone, TrtGenGo, TrtGenSpec, TrtGiveUp
from pdcheck.trtllm.pool import prove
from pdcheck.trtllm.rankbase import GIVEN_UP, NOTIF, POLL_MS, Stopped, TrtRole, judge
from pdcheck.trtllm.wire import Facts, Peer


class GenRole(TrtRole):
    spec_type = TrtGenSpec
    letter = "gen"

    def run(self) -> None:
        try:
            while True:
                msg = self.receive()
                if isinstance(msg, m.Stop):
                    return
                if isinstance(msg, TrtGenGo):
                    self.reset_counters()
                    self.pool.clear()
                    self.logs: list[str] = []
                    self.notes: list[bytes] = []  # NIXL notifications received, in order
                    line = eras.line(msg.line)
                    result = cpp.gen_line(self, msg, line) if line.runtime == "cpp" else self.python_line(msg, line)
                    result.logs = self.logs
                    m.send(self.conn, TrtGenDone(self.spec.tp_rank, result))
        except Stopped:
            return
        finally:
            self.zctx.destroy(0)

    # ---- waiting ----------------------------------------------------------------------------------------
    def wait(self, stage: str, socks: dict[zmq.Socket, str], on: Callable[[zmq.Socket, list[bytes]], Any],
             on_notif: Callable[[bytes], Any] | None = None) -> Any:
        """Poll `socks` (socket -> its counter key) and the parent, driving NIXL; `on` returns a result to end
        the wait (None: go on). GIVEN_UP when the parent says nothing more can come or the cap passes."""
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        poller.register(self.conn.fileno(), zmq.POLLIN)
        cap = time.monotonic() + self.spec.cap_s
        while True:
            for got in self.agent.notifs().values():
                for note in got:
                    self.count_received(NOTIF + self.agent.name)
                    self.notes.append(note)
                    if on_notif is not None:
                        out = on_notif(note)
                        if out is not None:
                            return out
            events = dict(poller.poll(POLL_MS))
            for s, key in socks.items():
                if s in events:
                    frames = TrtRole.read(s)
                    self.count_received(key)
                    out = on(s, frames)
                    if out is not None:
                        return out
            if self.conn.fileno() in events:
                msg = m.recv(self.conn)
                if isinstance(msg, m.Stop):
                    raise Stopped
                if isinstance(msg, TrtGiveUp):
                    return GIVEN_UP
            if time.monotonic() > cap:
                self.logs.append(f"pdcheck: {self.spec.cap_s:g} s cap on one wait reached")
                return GIVEN_UP
            self.report("gen", stage)

    # ---- a Python line ------------------------------------------------------------------------------------
    def python_line(self, go: TrtGenGo, line: TrtLine) -> GenResult:
        receiver, self_ep = self.router()
        socks: list[zmq.Socket] = [receiver]
        try:
            return self.python_flow(go, line, receiver, self_ep, socks)
        finally:
            for s in socks:
                s.close()

    def hang(self, line: TrtLine, stage: str, what: str, timeout_ms: int | None, contacted: list[int],
             bounded: bool = True) -> GenResult:
        """The gen's wait can only end by a timeout: the era's (none: forever), or corrected's deadline."""
        if line.checks == "corrected":
            return GenResult("error", stage, f"fails at its deadline, naming the wait: {what}",
                             exception="TimeoutError", contacted=contacted)
        if not bounded or timeout_ms is None:
            text = f"waits forever: {what}" + ("" if bounded else "; no timeout applies to this wait")
        else:
            text = (f"waits {timeout_ms / 1000:g} s: {what}; then {TIMEOUT_CANCEL.format(rid=self.rid)} "
                    "(kv_transfer_timeout_ms, T66)")
        return GenResult("hang", stage, text, contacted=contacted, timeout_ms=timeout_ms if bounded else None)

    def python_flow(self, go: TrtGenGo, line: TrtLine, receiver: zmq.Socket, self_ep: str,
                    socks: list[zmq.Socket]) -> GenResult:
        spec, w = self.spec, line.wire
        self.rid = go.unique_rid
        if not go.info_endpoint:  # a C++ ctx publishes no disagg_info_endpoint (T15)
            return GenResult("error", "info", "ValueError: ctx_info_endpoint is required (a C++ ctx publishes no "
                             "info endpoint; Receiver._extract_info_endpoint, T15)", exception="ValueError")
        info = self.dealer(go.info_endpoint)
        socks.append(info)
        info.send_multipart([wire.INFO])
        self.count_sent(go.info_endpoint)
        got = self.wait("info", {info: "reply:" + go.info_endpoint}, lambda _s, frames: frames)
        if got is GIVEN_UP:
            return self.hang(line, "info", f"Receiver._get_sender_info blocks in recv_multipart() on "
                             f"{go.info_endpoint}, which has no timeout (T21)", go.timeout_ms, [0], bounded=False)
        try:
            ctx = wire.decode_info_reply(w, got[0])
        except WireError as exc:
            return GenResult("error", "info", f"{exc} (RankInfo.from_bytes of the info reply escapes dispatch_task)",
                             exception=str(exc).split(":")[0], contacted=[0])
        own = Facts(instance_name=spec.instance_name, rank=spec.tp_rank,
                    view=view_of(spec.side, spec.tp_rank, self.pool.addr), pp_size=spec.side.pp_size,
                    sender_endpoints=[], self_endpoint=self_ep, blob=cpp.agent_blob(self, spec.agent),
                    dtype=spec.side.dtype)
        targets = peer_ranks(own.view, ctx.view.layer_num_per_pp, ctx.view.tp_size)
        bad = [r for r in targets if r >= len(ctx.sender_endpoints)]
        if bad or not ctx.sender_endpoints:
            return GenResult("error", "info", f"the info reply lists {len(ctx.sender_endpoints)} sender endpoints; "
                             f"ctx rank {bad[0] if bad else 0} has none (IndexError)", exception="IndexError")
        if line.checks == "corrected":
            reason = checks.corrected_gate(ctx.view, own.view, ctx.dtype, spec.side.dtype)
            if reason is not None:
                return GenResult("error", "register", PEER_INCOMPATIBLE.format(endpoint=go.info_endpoint,
                                                                               error=reason),
                                 exception="PeerIncompatibleError", contacted=[0])
        dealers: dict[str, zmq.Socket] = {}
        for ep in dict.fromkeys(ctx.sender_endpoints):  # T21.5: every sender endpoint, no answer awaited
            dealers[ep] = self.dealer(ep)
            socks.append(dealers[ep])
            if go.fault == "unknown_type":
                # A gen of the W1a variant registers first with b"REQUEST_RANK_INFO" (T10); sent on this same
                # connection, so that the ctx reads it before this gen's frames (two connections keep no order).
                dealers[ep].send_multipart([wire.W1A_VARIANT_REGISTER, wire.rank_info("W1a", own)])
                self.count_sent(ep)
            dealers[ep].send_multipart([wire.ERAS[w].register, wire.rank_info(w, own)])
            self.count_sent(ep)
        ids = list(spec.gen_blocks)
        if go.fault == "block_id_oob":
            ids[-1] = spec.side.num_blocks  # one past the gen's pool: nothing bounds it on the ctx (T74)
        req = wire.recv_req(w, Req(sender_req_id=go.ctx_req_id, instance_name=spec.instance_name,
                                   instance_rank=spec.tp_rank, block_ids=ids, unique_rid=go.unique_rid))
        for r in targets:
            ep = ctx.sender_endpoints[r]
            dealers[ep].send_multipart([wire.REQUEST_DATA, req])
            self.count_sent(ep)
        return self.await_results(go, line, ctx, targets, receiver, self_ep)

    def await_results(self, go: TrtGenGo, line: TrtLine, ctx: Peer, targets: list[int], receiver: zmq.Socket,
                      self_ep: str) -> GenResult:
        w = line.wire
        done: set[int] = set()
        count = [0]
        failed: list[GenResult] = []

        def result(r: wire.Result) -> Any:
            if r.rid != go.unique_rid:
                self.logs.append(f"_process_kv_agent_result: session {r.rid} not found (already closed?), "
                                 "dropping status")
                return None
            if r.status != "SUCCESS":
                text = RESULT_FAILED.format(rid=r.rid, slice=0, peer=r.rank, last=r.last)
                failed.append(GenResult("error", "transfer", text, exception="RuntimeError", contacted=targets))
                return True
            if r.last:
                count[0] += 1
                done.add(r.rank)
            return True if (len(done) if w == "corrected" else count[0]) >= len(targets) else None

        def on_frames(_s: zmq.Socket, frames: list[bytes]) -> Any:
            rest = frames[1:]
            if rest and rest[0] == wire.REFUSED and w == "corrected":
                why = rest[1].decode("utf-8", "replace") if len(rest) > 1 else ""
                failed.append(GenResult("error", "register", f"the ctx refused the registration: "
                                        f"{b.peer_text(why, 200)}",
                                        exception="PeerIncompatibleError", contacted=targets))
                return True
            try:
                return result(wire.decode_result(w, rest))
            except WireError as exc:
                self.logs.append(f"Receiver: error handling {b.peer_text(rest[0] if rest else b'', 40)}: {exc}")
                return None

        def on_notif(note: bytes) -> Any:
            if w != "corrected":
                return None
            try:
                return result(wire.decode_result("W3", [b"KV_AGENT_RESULT", note]))
            except WireError:
                return None

        got = self.wait("transfer", {receiver: self_ep}, on_frames, on_notif)
        if failed:
            return failed[0]
        proof = prove(self.spec.side, self.spec.tp_rank, self.pool, self.spec.ctx_side, self.spec.gen_blocks,
                      self.spec.ctx_blocks)
        if got is GIVEN_UP:
            kind = wire.ERAS[w].result.decode()
            missing = [r for r in targets if r not in done] if w == "corrected" else targets[count[0]:]
            what = (f"no {kind} from ctx rank{'s' if len(missing) > 1 else ''} "
                    f"{', '.join(map(str, missing))} since REQUEST_DATA")
            if proof.status == "ok":
                what += f"; yet all {proof.rows} rows arrived right: only the completion is missing"
            res = self.hang(line, "transfer", what, go.timeout_ms, targets)
            res.proof = proof
            return res
        return judge(self.spec.side.dtype, self.spec.ctx_side.dtype, proof, targets)


def gen_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(GenRole, conn, spec_bytes)
