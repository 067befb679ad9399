"""TensorRT-LLM's fake context (prefill) rank on pdcheck's rank skeleton, one line (era) after another.

Python lines (docs/trtllm-protocol.md §3): a Sender and a Receiver ROUTER per rank and, on global rank 0, the
RankInfoServer; the Sender listener decodes REGISTER_RANK_INFO and REQUEST_DATA as the era does, runs the era's
checks (only logged, T69), loads the gen's agent, and WRITEs the request's blocks into the gen's pool with the
mappers' descriptors (T50-T52), then answers the era's result frames on the gen's Receiver. What the era's listener
does with a frame it cannot handle (T43-T45) is modelled: its thread ends, its messenger stops, or it logs.
The C++ line's conversation lives in pdcheck/trtllm/cpp.py."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import zmq

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.ranks import run_rank
from pdcheck.trtllm import checks, cpp, eras, wire
from pdcheck.trtllm.eras.base import AGENT_FAILED, MESSENGER_STOPS, SENDER_ERROR, UNKNOWN, W1A_UNKNOWN
from pdcheck.trtllm.layout import fragments, merge, should_write, view_of
from pdcheck.trtllm.maps import Req, WireError
from pdcheck.trtllm.messages import (
    CtxResult,
    TrtArmed,
    TrtCtxDone,
    TrtCtxSpec,
    TrtCtxUp,
    TrtEndLine,
    TrtLine,
    TrtPeers,
)
from pdcheck.trtllm.rankbase import NOTIF, POLL_MS, Stopped, TrtRole
from pdcheck.trtllm.wire import Facts, Peer, Result


class CtxRole(TrtRole):
    spec_type = TrtCtxSpec
    letter = "ctx"

    def ready(self) -> m.Msg:
        self.pool.tag(self.spec.ctx_blocks)
        return super().ready()

    def run(self) -> None:
        try:
            while True:
                msg = self.receive()
                if isinstance(msg, m.Stop):
                    return
                if isinstance(msg, TrtLine):
                    self.line_ = msg
                    self.result = CtxResult()
                    self.reset_counters()
                    if eras.line(msg.line).runtime == "cpp":
                        cpp.ctx_line(self)
                    else:
                        self.python_line()
        except Stopped:
            return
        finally:
            self.zctx.destroy(0)

    def log(self, text: str) -> None:
        self.result.logs.append(text)

    # ---- a Python line ------------------------------------------------------------------------------------
    def python_line(self) -> None:
        spec, msg = self.spec, self.line_
        self.era = eras.line(msg.line)
        self.wire = self.era.wire
        self.sender, sender_ep = self.router()
        self.receiver, receiver_ep = self.router()
        self.info = None
        info_ep = ""
        if spec.tp_rank == 0:
            self.info, info_ep = self.router(spec.info_port)
        socks = [s for s in (self.sender, self.receiver, self.info) if s is not None]
        self.dealers: dict[str, zmq.Socket] = {}
        try:
            m.send(self.conn, TrtCtxUp(spec.tp_rank, sender_ep, receiver_ep, info_ep))
            peers = self.receive()
            if isinstance(peers, m.Stop):
                raise Stopped
            assert isinstance(peers, TrtPeers), peers
            self.facts = Facts(instance_name=spec.instance_name, rank=spec.tp_rank,
                               view=view_of(spec.side, spec.tp_rank, self.pool.addr), pp_size=spec.side.pp_size,
                               sender_endpoints=peers.sender_endpoints, self_endpoint=receiver_ep,
                               blob=self.agent.metadata(), dtype=spec.side.dtype)
            self.sender_ep, self.info_ep = sender_ep, peers.info_endpoint
            self.peers: dict[tuple[str, int], tuple[Peer, str]] = {}  # PeerRegistrar: (name, rank) -> RankInfo
            self.stored: list[tuple[Req, str]] = []
            self.frozen = False
            self.serve_loop(socks)
        finally:
            for s in [*socks, *self.dealers.values()]:
                s.close()

    def serve_loop(self, socks: list[zmq.Socket]) -> None:
        poller = zmq.Poller()
        for s in socks:
            poller.register(s, zmq.POLLIN)
        poller.register(self.conn.fileno(), zmq.POLLIN)
        self.state()
        while True:
            events = dict(poller.poll(POLL_MS))
            if self.info is not None and self.info in events:
                self.on_info(TrtRole.read(self.info))
            if self.sender in events:
                frames = TrtRole.read(self.sender)
                if self.result.listener_dead is None and not self.frozen:
                    self.count_received(self.sender_ep)
                    self.on_sender(frames[1:])
                    if self.result.listener_dead is not None:  # the thread ends: nothing reads this socket
                        poller.unregister(self.sender)
                        self.sinks.append(self.sender_ep)
            if self.receiver in events:
                TrtRole.read(self.receiver)  # a ctx receives no results; CANCEL_SESSION and the like are dropped
            if self.conn.fileno() in events:
                msg = m.recv(self.conn)
                if isinstance(msg, m.Stop):
                    if self.spec.serve:  # serve's one line ends with the run: what this rank did, then exit
                        m.send(self.conn, TrtCtxDone(self.spec.tp_rank, self.result))
                    raise Stopped
                if isinstance(msg, TrtEndLine):
                    m.send(self.conn, TrtCtxDone(self.spec.tp_rank, self.result))
                    return
            self.state()

    def state(self) -> None:
        if not self.spec.serve:  # serve's parent only waits for a signal: nothing decides quiescence there
            self.report("ctx")

    def on_info(self, frames: list[bytes]) -> None:
        """RankInfoServer: REQUEST_INSTANCE_INFO -> [identity, this instance's RankInfo / InstanceInfo] (T21)."""
        self.count_received(self.info_ep)
        if self.line_.fault == "info_silent":
            return  # read, never answered: the gen's recv_multipart has no timeout (T21)
        if len(frames) < 2 or frames[1] != wire.INFO:
            got = frames[1] if len(frames) > 1 else b""
            self.log(f"Instance info server received unknown message type: {got[:64]!r}")
            return
        self.info.send_multipart([frames[0], wire.info_reply(self.wire, self.facts)])
        self.count_sent("reply:" + self.info_ep)

    def on_sender(self, rest: list[bytes]) -> None:
        era = wire.ERAS[self.wire]
        if not rest:  # an identity alone: msg[0] raises IndexError outside the handlers' try (T45)
            self.fail("listener", "IndexError: list index out of range")
            return
        kind = rest[0]
        if kind == era.register:
            self.guarded("REGISTER_RANK_INFO", lambda: self.on_register(rest))
        elif kind == wire.REQUEST_DATA:
            self.guarded("REQUEST_DATA", lambda: self.on_request(rest))
        elif kind in era.sender_types:
            return  # TERMINATION, CANCEL_SESSION: nothing pending in a line to stop or cancel
        elif self.era.listener == "dies":
            self.result.listener_dead = f"ValueError: {W1A_UNKNOWN.format(type=kind.decode('ascii', 'replace'))}"
            self.log(self.result.listener_dead + " (the sender loop has no try: its thread ends, T43)")
        elif self.era.listener == "stops":
            self.fail("listener", f"ValueError: {UNKNOWN.format(type=kind)}", UNKNOWN.format(type=kind))
        else:
            self.log(UNKNOWN.format(type=kind))

    def guarded(self, kind: str, handler: Any) -> None:
        """A handler as the era wraps it: W2b/W3 catch and log `{e}` (T45); W1b raises to its messenger (T44);
        W1a's loop has no try (T43)."""
        try:
            handler()
        except (WireError, ValueError, KeyError, NixlCallError) as exc:
            typed = str(exc) if isinstance(exc, WireError) else f"{type(exc).__name__}: {exc}"
            head, sep, tail = typed.partition(": ")
            plain = tail if sep and head.isidentifier() and head.lower().endswith("error") else typed  # `{e}`
            self.fail(kind, typed, plain)

    def fail(self, kind: str, typed: str, plain: str | None = None) -> None:
        if self.era.listener == "dies":
            self.result.listener_dead = typed
            self.log(f"{typed} (W1a's sender loop has no try: the thread ends, T43)")
        elif self.era.listener == "stops":
            self.result.listener_dead = typed
            self.log(MESSENGER_STOPS.format(error=plain or typed) + " (ZMQMessenger@65b31db1 stops its listener, "
                     "T44)")
        else:
            self.log(SENDER_ERROR.format(type=kind, error=plain or typed))

    def on_register(self, rest: list[bytes]) -> None:
        if len(rest) < 2:
            raise ValueError("not enough values to unpack (expected 2, got 1)")
        peer = wire.decode_rank_info(self.wire, rest[1])
        own = self.facts.view
        verdict = checks.on_register(self.era, own, peer.view, peer.instance_name, peer.rank)
        for text in verdict.logs[:-1] if verdict.refused else verdict.logs:
            self.log(text)
        try:
            if verdict.refused:
                raise ValueError(verdict.logs[-1])
            name = self.load_blob(peer)
        except (ValueError, NixlCallError) as exc:
            if self.wire == "corrected":  # the corrected ctx answers a registration it refuses, with why
                why = verdict.logs[0] if verdict.refused else str(exc)
                self.send_to(peer.self_endpoint, [wire.REFUSED, why.encode()])
            raise
        self.peers[(peer.instance_name, peer.rank)] = (peer, name)
        self.result.registered.append(f"{peer.instance_name[:8]}{peer.rank}")

    def load_blob(self, peer: Peer) -> str:
        """agent.load_remote_agent(name + rank, transfer_engine_info) (T23, T41): the pure-Python agent loads
        the raw NIXL blob; the C++ binding agent's AgentDesc wraps it and checks the agent name."""
        want = f"{peer.instance_name}{peer.rank}"
        if self.spec.agent == "cpp":
            inner = cpp.unwrap_agent_desc(peer.blob)
            name = self.load(inner)
            if name != want:
                raise ValueError(f"loadRemoteAgent gets error agent name: {name} != {want}")
            return name
        return self.load(peer.blob)

    def on_request(self, rest: list[bytes]) -> None:
        if len(rest) < 2:
            raise ValueError("not enough values to unpack (expected 2, got 1)")
        req = wire.decode_recv_req(self.wire, rest[1])
        key = (req.instance_name, req.instance_rank)
        if key not in self.peers:  # _save_peer_req_info looks the peer up: a rejected one is a KeyError (T24)
            raise KeyError(f"{req.instance_name}{req.instance_rank}")
        if self.line_.fault == "ctx_dies":
            self.frozen = True  # registered, REQUEST_DATA stored: the parent kills this instance now
            m.send(self.conn, TrtArmed(self.spec.tp_rank))
            return
        if req.unique_rid != self.line_.unique_rid and not self.spec.serve:
            self.stored.append((req, "unknown session"))  # no TxSession: kept until one comes (T24)
            return
        self.deliver(req, *self.peers[key])

    def deliver(self, req: Req, peer: Peer, agent: str) -> None:
        """The TxSession's WRITE for one gen rank (T25), then its result frame (T35-T37)."""
        own = self.facts.view
        ctx_blocks = list(self.spec.ctx_blocks) if not self.spec.serve else list(range(len(req.block_ids)))
        gen_blocks = list(req.block_ids)
        rid = req.unique_rid
        status, size = "SUCCESS", 0
        if self.wire in ("W1a", "W1b") and len(gen_blocks) == len(ctx_blocks) + 1:
            gen_blocks = gen_blocks[:-1]  # "maybe it is due to draft tokens, remove the last block" (T54)
            self.log("src_block_num is one less than dst_block_num, maybe it is due to draft tokens, remove the "
                     "last block from dst_block_ids")
        if len(gen_blocks) > len(ctx_blocks):
            self.log(f"src/dst block count mismatch: {len(ctx_blocks)} vs {len(gen_blocks)} (dst must not exceed "
                     "src)")
            status = "FAILED"
        elif self.wire == "corrected" and any(not 0 <= b < peer.view.num_slots for b in gen_blocks):
            bad = next(b for b in gen_blocks if not 0 <= b < peer.view.num_slots)
            self.log(f"corrected: gen block id {bad} outside its {peer.view.num_slots} slots: refused")
            status = "FAILED"
        elif should_write(own, peer.view):
            segs = merge(fragments(own, peer.view, ctx_blocks[-len(gen_blocks):] if gen_blocks else [],
                                   gen_blocks))
            notif = b""
            if self.wire == "corrected":  # the completion bound to the WRITE (trtllm#17665's proposal)
                notif = wire.result_frames("W3", Result(self.spec.tp_rank, rid, True, "SUCCESS",
                                                        sum(n for _s, _d, n in segs)))[1]
            try:
                self.write(agent, segs, notif, f"unique_rid={rid}")
                size = sum(n for _s, _d, n in segs)
                self.result.writes += 1
                if notif:
                    self.count_sent(NOTIF + agent)
            except NixlCallError as exc:
                self.log(AGENT_FAILED.format(rid=rid, slice=0, peer=peer.rank, status=exc.status))
                status = "FAILED"
        frames = wire.result_frames(self.wire, Result(self.spec.tp_rank, rid, True, status, size))
        if self.line_.fault == "completion_lost" and status == "SUCCESS":
            self.log(f"pdcheck: the {frames[0].decode()} frame to gen rank {peer.rank} was lost (fault "
                     "completion_lost, trtllm#17665)")
            return
        self.send_to(peer.self_endpoint, frames)

    def send_to(self, endpoint: str, frames: list[bytes]) -> None:
        if endpoint not in self.dealers:
            self.dealers[endpoint] = self.dealer(endpoint)
        self.dealers[endpoint].send_multipart(frames)
        self.count_sent(endpoint)


def ctx_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(CtxRole, conn, spec_bytes)
