"""Fake SGLang P and D ranks, as roles of pdcheck's one rank skeleton (pdcheck.ranks.run_rank).

P: a KV cache of its geometry registered with one NIXL agent, pages coordinate-tagged (pdcheck.kvcache), a real
ZMQ PULL socket registered with the real HTTP bootstrap server (PUT /route, the release's JSON); its listener
parses D's frames as the release does and dies on what the release dies on; each TransferInfo becomes real NIXL
WRITEs into D's memory laid out as P's release computes them (its own item length on both sides), then the
release's completion signal (NIXL notification, or ZMQ KV_STATUS in 0.5.23).
D: discovers P over GET /route with the release's queries and checks, PUSHes the release's frames, waits for
completion the release's way, then checks every written page by coordinate against what a correct transfer
would have put there.

Over the ~500 lines a module keeps to: P and D are the two ends of one exchange (the bootstrap route, the
frames, the WRITEs and the completion signal) and read best side by side; the release rules stay in
pdcheck.sglang.releases, the wire in pdcheck.sglang.wire.
"""

from __future__ import annotations

import time
import urllib.request
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import zmq

from pdcheck import messages as m
from pdcheck.errors import NixlCallError
from pdcheck.kvcache import KVCache
from pdcheck.nixlagent import LOCAL, no_memory_hooks
from pdcheck.pattern import decode_cell, pattern
from pdcheck.ranks import Role, run_rank
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang import wire
from pdcheck.sglang.engine import SgVerdict, Side, ensure_failed, node_failure, wait_text
from pdcheck.sglang.releases import resolve
from pdcheck.sglang.releases.base import DP_CONFLICT, PAGE_COUNT_ASSERT, PAGE_COUNT_WARNING


class SgReq(msgspec.Struct, frozen=True):
    room: int
    p_pages: list[int]
    d_pages: list[int]
    slot: int = 0  # its metadata (aux) and state slot on both sides: the request's index in the plan


class SgPrefillSpec(msgspec.Struct, frozen=True):
    tp_rank: int
    release: str
    side: Side
    bootstrap_port: int
    requests: list[SgReq]
    tag: int
    register: bool = True  # PUT /route (False: a P rank still starting when D asks)
    host: str = "127.0.0.1"
    serve: bool = False  # `serve --sglang`: a room P never planned is served from the same page ids as D's
    pp_rank: int = 0  # every PP stage registers; each fake stage holds (and writes) every layer
    fault: str = "none"  # scenario.Fault
    dp_rank: int = 0  # attention DP group; `requests` are the ones the router dispatched to it
    # serve: the live decode's page size ([decode].page_size; 0: P's own). D's pages hold the request's tokens
    # by D's page size, P's scheduler holds them by its own: a larger D page means more P pages (engine.d_pages_for)
    d_page_size: int = 0


SERVE_TAG = 0x5C1  # the coordinate tag of `serve --sglang` pages: a live D knows it without asking


class SgDecodeSpec(msgspec.Struct, frozen=True):
    tp_rank: int
    release: str
    side: Side
    p_side: Side
    bootstrap_port: int
    requests: list[SgReq]
    tag: int
    hang_s: float  # pdcheck's stand-in for the release's timeout (300 s or forever)
    host: str = "127.0.0.1"
    bootstrap_host: str = ""  # a live P's bootstrap server (--prefill-endpoint); "": host
    fault: str = "none"  # scenario.Fault
    heartbeat_s: float = 0.3  # pdcheck's stand-in for the release's GET /health interval (5 s)


class PFinal(msgspec.Struct):
    tp_rank: int
    listener_dead: str | None = None
    registered: list[str] = []  # D agents registered
    writes: int = 0  # NIXL WRITE requests completed
    errors: list[str] = []  # transfer errors P's release keeps to itself (or reports by KV_STATUS, 0.5.23)
    put_status: int = 0
    logs: list[str] = []  # what P's release logs without failing (0.5.23's aux buffer count skew)
    bootstrapping: list[int] = []  # planned rooms whose TransferInfo never came (still in KVPoll.Bootstrapping)


class DFinal(msgspec.Struct):
    tp_rank: int
    verdict: SgVerdict
    transfer: m.TransferResult | None = None


def sglang_order(kv: KVCache) -> list[int]:
    """SGLang's kv_data_ptrs: K of every layer, then V of every layer (pdcheck's regions interleave K and V)."""
    g = kv.geometry
    if g.use_mla:
        return list(kv.base_addrs)
    return [kv.base_addrs[2 * layer] for layer in range(g.layers)] + [
        kv.base_addrs[2 * layer + 1] for layer in range(g.layers)]


def region_of(index: int, layers: int, mla: bool) -> int:
    """pdcheck's region of SGLang's pointer index."""
    return index if mla else 2 * (index % layers) + index // layers


def _cache(side: Side) -> KVCache:
    return KVCache(side.geometry(), side.num_pages, "cpu", 0, "HND")


# Metadata (aux) buffers: AUX_SLOTS request slots of AUX_ITEM bytes each, in one DRAM region after the KV cache.
# Slot s of buffer b holds the pattern of region AUX_REGION + b, block s, P rank 0 (every TP rank holds the same
# metadata), so D can tell which buffer and slot landed where.
AUX_SLOTS, AUX_ITEM, AUX_REGION = 16, 64, 4000


def _aux(side: Side) -> np.ndarray:
    return np.zeros((side.aux_buffers, AUX_SLOTS, AUX_ITEM), dtype=np.uint8)


def aux_ptrs(aux: np.ndarray) -> list[int]:
    return [aux.ctypes.data + b * AUX_SLOTS * AUX_ITEM for b in range(aux.shape[0])]


def aux_pattern(tag: int, buffer: int, slots: list[int]) -> np.ndarray:
    return pattern(tag, 0, AUX_REGION + buffer, np.asarray(slots), 0, AUX_ITEM)


# A hybrid model's state pool (one per side when `hybrid`): STATE_SLOTS slots of STATE_ITEM bytes, slot s tagged
# as region STATE_REGION, block s.
STATE_SLOTS, STATE_ITEM, STATE_REGION = 16, 256, 4090


def _state(side: Side) -> np.ndarray:
    return np.zeros((1 if side.hybrid else 0, STATE_SLOTS, STATE_ITEM), dtype=np.uint8)


def _extra_regions(aux: np.ndarray, state: np.ndarray) -> list[tuple[int, int, int]]:
    return [(aux.ctypes.data, aux.nbytes, 0)] + ([(state.ctypes.data, state.nbytes, 0)] if state.size else [])


def state_pattern(tag: int, slots: list[int]) -> np.ndarray:
    return pattern(tag, 0, STATE_REGION, np.asarray(slots), 0, STATE_ITEM)


# ---------------------------------------------------------------------------------------------- prefill
class SgPrefillRole(Role):
    spec_type = SgPrefillSpec
    letter = "P"

    def environment(self) -> None:
        no_memory_hooks("cpu")

    @property
    def agent_name(self) -> str:
        return f"sglang-p{self.spec.tp_rank}" + (f"-pp{self.spec.pp_rank}" if self.spec.pp_rank else "")

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.kv, self.aux, self.state = _cache(self.spec.side), _aux(self.spec.side), _state(self.spec.side)
        return [*self.kv.regions(0), *_extra_regions(self.aux, self.state)], self.kv.mem_type

    def ready(self) -> m.Msg:
        spec, side = self.spec, self.spec.side
        self.rel = resolve(spec.release)
        pages = sorted({p for r in spec.requests for p in r.p_pages})
        self.kv.tag_many(spec.tag, spec.tp_rank, {r: pages for r in range(side.num_ptrs)})
        for b in range(side.aux_buffers):
            self.aux[b] = aux_pattern(spec.tag, b, list(range(AUX_SLOTS)))
        if side.hybrid:
            self.state[0] = state_pattern(spec.tag, list(range(STATE_SLOTS)))
        self.infos: dict[int, dict[str, tuple[wire.Transfer, wire.Registration, str]]] = {}  # transfer_infos
        self.received: set[int] = set()  # rooms whose TransferInfo came
        self.n_infos = 0  # TransferInfo messages (two requests of one room: two messages)
        self.frozen = False  # kill_prefill: waiting to be killed after a partial WRITE
        self.zctx = zmq.Context()
        self.sock = self.zctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, 1 << 24)
        port = self.sock.bind_to_random_port(f"tcp://{spec.host}")
        self.final = PFinal(spec.tp_rank)
        if self.rel.dp_conflict_check and side.dp_size > 1:  # the sender's follow_bootstrap_room check
            for r in spec.requests:
                if r.room % side.dp_size != spec.dp_rank:
                    self.final.errors.append(DP_CONFLICT.format(x=spec.dp_rank, room=r.room, y=r.room % side.dp_size))
        if spec.register:
            body = bs.put_body(self.rel, rank=spec.tp_rank, tp=side.tp_size, pp_rank=spec.pp_rank, pp=side.pp_size,
                               ip=spec.host, port=port, page_size=side.page_size,
                               kv_cache_dtype=side.kv_cache_dtype, agent_name=self.agent.name,
                               dp_rank=spec.dp_rank, dp=side.dp_size)
            self.final.put_status = bs.http_put(spec.host, spec.bootstrap_port, body)[0]
        return m.Ready(spec.tp_rank, self.agent.name, self.setup_ms())

    def run(self) -> None:
        regs: dict[str, tuple[wire.Registration, str]] = {}
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.conn.fileno(), zmq.POLLIN)
        push: dict[str, Any] = {}
        try:
            while True:
                events = dict(poller.poll(50))
                if self.sock in events:
                    frames = self.sock.recv_multipart()
                    if self.final.listener_dead is None and not self.frozen:  # a dead thread reads no more
                        self._on_frames(frames, regs, push)
                if self.conn.fileno() in events and isinstance(m.recv(self.conn), m.Stop):
                    break
        finally:
            for s in push.values():
                s.close(0)
            self.sock.close(0)
            self.zctx.term()
        self.final.bootstrapping = sorted({r.room for r in self.spec.requests} - self.received)
        m.send(self.conn, m.FrameworkFinal(self.spec.tp_rank, msgspec.msgpack.encode(self.final)))

    def _on_frames(self, frames: list[bytes], regs: dict[str, tuple[wire.Registration, str]],
                   push: dict[str, Any]) -> None:
        try:
            got = wire.decode(self.rel, frames)
        except Exception as exc:  # the release's bootstrap thread dies here
            self.final.listener_dead = wire.death(exc)
            return
        if isinstance(got, wire.Registration):
            mine = len(sglang_order(self.kv))
            if self.rel.fewer_regions_raise and got.agent_name not in regs and len(got.kv_ptrs) < mine:
                self.final.listener_dead = self.rel.fewer_regions_raise.format(d=len(got.kv_ptrs), p=mine)
                return
            if got.agent_name not in regs:  # "Peer X was already registered, ignoring."
                regs[got.agent_name] = (got, self.agent.add_remote(got.agent_metadata))
                self.final.registered.append(got.agent_name)
            return
        if got is None:
            return
        if got.inline is not None and got.inline.agent_name not in regs:
            peer = self.agent.add_remote(got.inline.agent_metadata)
            regs[got.inline.agent_name or peer] = (got.inline, peer)
        key = got.agent_name or (got.inline.agent_name if got.inline else "")
        if key not in regs and got.inline is not None:
            key = next(iter(regs))
        if key not in regs:
            self.final.errors.append(f"AssertionError: assert req.agent_name in self.decode_kv_args_table "
                                     f"({got.agent_name!r})")
            return
        reg, peer = regs[key]
        self.received.add(got.room)
        self.n_infos += 1
        if self.rel.aux_skew_log and len(reg.aux_ptrs) != self.spec.side.aux_buffers and not self.final.logs:
            n, p = len(reg.aux_ptrs), self.spec.side.aux_buffers
            self.final.logs.append(self.rel.aux_skew_log.format(peer=reg.agent_name, d=n, p=p, n=min(n, p)))
        if self.spec.fault == "duplicate_room":
            # transfer_infos[room][agent]: a later TransferInfo for the same room replaces the earlier one; P's
            # forward finishes after every request bootstrapped, then sends request by request
            self.infos.setdefault(got.room, {})[key] = (got, reg, peer)
            if self.n_infos == len(self.spec.requests):
                self._serve_in_order(push)
            return
        req = next((r for r in self.spec.requests if r.room == got.room), None)
        slot = req.slot if req is not None else 0
        if req is None and self.spec.serve and got.pages:
            # A live decode's room: P "prefilled" the same page ids (tagged now, with serve's own tag), as many as
            # P's page size needs for the tokens of D's pages (more ids past D's when D's page is larger).
            req = SgReq(got.room, self._own_pages(list(got.pages)), list(got.pages))
            self.kv.tag_many(self.spec.tag, self.spec.tp_rank, {r: req.p_pages for r in range(self.spec.side.num_ptrs)})
        if req is None or not got.pages:
            return  # a dummy request (empty indices), or a room this P never prefilled
        if self.spec.fault == "kill_prefill":
            # chunk 0 of 2 (not last: no aux, no completion), then the parent SIGKILLs every P rank
            half = max(1, len(got.pages) // 2)
            self._write(reg, peer, req.p_pages[:half], got.pages[:half], got.room, slot, got.aux_index, last=False)
            self.frozen = True
            m.send(self.conn, m.Armed())
            return
        self._serve(got, reg, peer, req, slot, push)

    def _own_pages(self, d_pages: list[int]) -> list[int]:
        side = self.spec.side
        n = -(-len(d_pages) * (self.spec.d_page_size or side.page_size) // side.page_size)
        taken = set(d_pages)
        extra = [pg for pg in range(side.num_pages) if pg not in taken]
        return (d_pages + extra)[:n]

    def _serve_in_order(self, push: dict[str, Any]) -> None:
        """duplicate_room: P's scheduler sends each planned request in order; the room's entry after its
        first request's last chunk is the release's (RoomReuse)."""
        done: set[int] = set()
        for req in self.spec.requests:
            slot = req.slot
            if req.room in done and self.rel.room_reuse != "kept":
                room = req.room
                if self.rel.room_reuse == "keyerror":
                    self._err(f"KeyError: {room} (add_transfer_request: transfer_infos[{room}] was deleted after "
                              "the room's last chunk; P's scheduler raises)")
                    return
                if self.rel.room_reuse == "assert":
                    self._err(f"AssertionError: assert room in self.transfer_infos (transfer worker: room {room} "
                              "marked Failed on P; D is not told)")
                else:
                    self.final.logs.append(f"room {room}: add_transfer_request returned None (transfer_infos "
                                           "already cleared): nothing sent")
                continue
            for got, reg, peer in self.infos.get(req.room, {}).values():
                self._serve(got, reg, peer, req, slot, push)
            done.add(req.room)

    def _serve(self, got: wire.Transfer, reg: wire.Registration, peer: str, req: SgReq, slot: int,
               push: dict[str, Any]) -> None:
        if len(got.pages) < len(req.p_pages):  # D allocated by a larger page size: fewer pages than P's
            if self.rel.page_count_assert:  # add_transfer_request, P's scheduler: nothing written, D not told
                self._err(f"AssertionError: {PAGE_COUNT_ASSERT} (add_transfer_request, room {got.room}: D offered "
                          f"{len(got.pages)} pages for P's {len(req.p_pages)})")
                return
            self.final.logs.append(PAGE_COUNT_WARNING.format(d=len(got.pages), p=len(req.p_pages)))
        reason = self._write(reg, peer, req.p_pages[:len(got.pages)], got.pages, got.room, slot, got.aux_index,
                             state=got.state_indices)
        if self.rel.completion == "kv_status":
            s = push.get(got.endpoint + str(got.port))
            if s is None:
                s = push[got.endpoint + str(got.port)] = self.zctx.socket(zmq.PUSH)
                s.setsockopt(zmq.LINGER, 1000)
                s.connect(f"tcp://{got.endpoint}:{got.port}")
            s.send_multipart(wire.kv_status(got.room, "Failed" if reason else "Success", self.spec.tp_rank,
                                            reason or ""))

    def _write(self, reg: wire.Registration, peer: str, p_pages: list[int], d_pages: list[int], room: int,
               slot: int, d_slot: int, *, last: bool = True, state: list[int] | None = None) -> str | None:
        """One request's WRITEs as P's release lays them out (KV, then with the last chunk the metadata
        buffers); the error text when it fails (D is told only by 0.5.23's KV_STATUS)."""
        side, rel = self.spec.side, self.rel
        src_ptrs, item = sglang_order(self.kv), self.kv.block_len
        hb = side.head_dim * side.geometry().elem_size
        p_heads = side.geometry().local_kv_heads
        d_tp = reg.decode_tp_size or side.tp_size
        sliced = (rel.hetero_tp in ("slice", "slice_pp_hang", "fixed") and d_tp != side.tp_size and not side.mla)
        local, remote = [], []
        try:
            for idx, sp in enumerate(src_ptrs):
                dp = reg.kv_ptrs[idx]  # P pairs its pointers with D's by index: IndexError when D has fewer
                for ps, ds in zip(p_pages, d_pages, strict=False):
                    if not sliced:  # P's own item length on both sides (no release compares D's)
                        local.append((sp + ps * item, item))
                        remote.append((dp + ds * item, item))
                        continue
                    if d_tp > side.tp_size:  # P sends D rank r's slice of its heads: dst_heads from (r * dst_heads)
                        d_heads = max(1, p_heads // (d_tp // side.tp_size))
                        d_item = reg.item_len or item // (d_tp // side.tp_size)
                        off = ((reg.decode_tp_rank or 0) * d_heads) % p_heads * hb
                        for t in range(side.page_size):
                            local.append((sp + ps * item + t * p_heads * hb + off, d_heads * hb))
                            remote.append((dp + ds * d_item + t * d_heads * hb, d_heads * hb))
                        continue
                    d_heads = p_heads * (side.tp_size // d_tp)
                    d_item = reg.item_len or item * (side.tp_size // d_tp)
                    off = (self.spec.tp_rank % (side.tp_size // d_tp)) * p_heads * hb
                    for t in range(side.page_size):  # one descriptor per token slot (send_kvcache_slice)
                        local.append((sp + ps * item + t * p_heads * hb, p_heads * hb))
                        remote.append((dp + ds * d_item + t * d_heads * hb + off, p_heads * hb))
        except IndexError as exc:
            return self._err(f"IndexError: {exc} (P pairs its {len(src_ptrs)} KV pointers with D's "
                             f"{len(reg.kv_ptrs)})")
        notif = b""
        if rel.completion != "kv_status":
            key = 0 if rel.completion in ("notif", "notif_pp") else self.spec.tp_rank
            notif = wire.kv_notif(rel, room, 0, last, key).encode()
        try:
            self._post(local, remote, peer, notif, room)
        except NixlCallError as exc:
            return self._err(f"NIXL transfer encountered ERR room={room}: {exc.status}")
        self.final.writes += 1
        if not last:
            return None
        if rel.aux_needs_state and not (rel.sends_state and side.hybrid and state):
            return None  # 0.5.12: no aux WRITE and no `{room}_aux` without a state (releases.base.aux_needs_state)
        if not self.spec.serve:  # a live decode's metadata buffers are its own size: only the notification
            src = aux_ptrs(self.aux)
            n = {"first": 1, "decode_count": len(reg.aux_ptrs), "shorter": min(len(src), len(reg.aux_ptrs))}[
                rel.aux_pairing]
            if n > len(src):  # send_aux: prefill_aux_item_lens[i] for each of D's pointers
                where = "transfer worker" if rel.records_reason else "add_transfer_request (P's scheduler)"
                return self._err(f"IndexError: list index out of range (send_aux in P's {where}: D registered "
                                 f"{len(reg.aux_ptrs)} metadata buffers, P has {len(src)})")
            try:
                self._post([(src[b] + slot * AUX_ITEM, AUX_ITEM) for b in range(n)],
                           [(reg.aux_ptrs[b] + d_slot * AUX_ITEM, AUX_ITEM) for b in range(n)], peer, b"", room)
                if rel.sends_state and side.hybrid and state and reg.state_ptrs:  # maybe_send_extra, last chunk
                    notif = wire.state_notif(room, self.spec.tp_rank).encode() if rel.completion != "kv_status" \
                        else b""
                    self._post([(self.state.ctypes.data + slot * STATE_ITEM, STATE_ITEM)],
                               [(reg.state_ptrs[0] + state[0] * STATE_ITEM, STATE_ITEM)], peer, notif, room)
            except NixlCallError as exc:
                return self._err(f"NIXL transfer encountered ERR room={room}: {exc.status}")
        if rel.completion != "kv_status":
            try:
                self.agent.send_notif(peer, wire.aux_notif(room).encode())
            except NixlCallError as exc:  # D already gone (hetero TP: it may finish on the other P rank's pages)
                return self._err(f"NIXL transfer encountered ERR room={room}: {exc.status}")
        return None

    def _post(self, local: list[tuple[int, int]], remote: list[tuple[int, int]], peer: str, notif: bytes,
              room: int) -> None:
        ids = np.arange(len(local))
        lh = self.agent.prep(LOCAL, _descs(local), "DRAM", "P's source pages")
        rh = self.agent.prep(peer, _descs(remote), "DRAM", f"D's pages ({peer})")
        self.agent.read(lh, ids, rh, ids, notif, op="WRITE", timeout_s=10.0, context=f"room {room}")

    def _err(self, text: str) -> str:
        self.final.errors.append(text)
        return text


def _descs(segs: list[tuple[int, int]]) -> np.ndarray:
    out = np.zeros((len(segs), 3), dtype=np.uint64)
    if segs:
        out[:, :2] = np.asarray(segs, dtype=np.uint64)
    return out


def sglang_prefill_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(SgPrefillRole, conn, spec_bytes)


# ----------------------------------------------------------------------------------------------- decode
class SgDecodeRole(Role):
    spec_type = SgDecodeSpec
    letter = "D"

    def environment(self) -> None:
        no_memory_hooks("cpu")

    @property
    def agent_name(self) -> str:
        return f"sglang-d{self.spec.tp_rank}"

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        self.kv, self.aux, self.state = _cache(self.spec.side), _aux(self.spec.side), _state(self.spec.side)
        return [*self.kv.regions(0), *_extra_regions(self.aux, self.state)], self.kv.mem_type

    def ready(self) -> m.Msg:
        return m.Ready(self.spec.tp_rank, self.agent.name, self.setup_ms())

    def run(self) -> None:
        if not isinstance(self.receive(), m.Go):
            return
        zctx = zmq.Context()
        try:
            verdict, transfer = self._request(zctx)
        finally:
            zctx.destroy(0)
        m.send(self.conn, m.FrameworkFinal(self.spec.tp_rank, msgspec.msgpack.encode(
            DFinal(self.spec.tp_rank, verdict, transfer))))
        # SGLang's decode loop keeps polling its transfers after a request is done, which drives its UCX worker:
        # a P rank still WRITing (a duplicate room's second request) completes against it, as against a real
        # decode, instead of timing out against a target nobody progresses (the skeleton's wait for Stop).
        super().run()

    def _request(self, zctx: zmq.Context) -> tuple[SgVerdict, m.TransferResult | None]:
        spec, side = self.spec, self.spec.side
        rel = resolve(spec.release)
        bhost = spec.bootstrap_host or spec.host
        get = bs.http_get(bhost, spec.bootstrap_port)
        deadline = time.monotonic() + spec.hang_s
        founds: dict[int, bs.Found] = {}  # room -> its P ranks (the DP group room % dp_size)
        fetches = 0  # 0.5.13+: D scheduler's attempts at P's parallel info (SglangRelease.ensure_retries)
        while any(r.room not in founds for r in spec.requests):
            try:
                for r in spec.requests:
                    founds[r.room] = bs.discover(
                        rel, get, tp_rank=spec.tp_rank, tp_size=side.tp_size, pp_size=side.pp_size,
                        page_size=side.page_size, kv_cache_dtype=side.kv_cache_dtype, mla=side.mla,
                        addr=f"{bhost}:{spec.bootstrap_port}", room=r.room)
            except bs.DiscoveryError as e:
                if e.info and rel.ensure_retries is not None:
                    # The release's attempts, scaled into pdcheck's hang window: only their count decides (the
                    # server never appears in a run), so the verdict keeps the release's own seconds.
                    fetches += 1
                    if fetches >= rel.ensure_retries:
                        addr = f"{bhost}:{spec.bootstrap_port}"
                        return ensure_failed(rel, addr, spec.requests[0].room, e.message, spec.tp_rank), None
                    time.sleep(min(rel.ensure_retry_s, spec.hang_s / rel.ensure_retries))
                    continue
                if e.retry and time.monotonic() < deadline:
                    time.sleep(0.1)
                    continue
                if e.retry:
                    t = rel.bootstrap_timeout_s
                    return SgVerdict(status="hang", stage="bootstrap", timeout_s=t,
                                     exception=None if e.exc == "retry" else e.exc,
                                     message=f"{e.message}; D retried for pdcheck's {spec.hang_s:g} s, SGLang "
                                     f"{rel.name} keeps the request in KVPoll.Bootstrapping"
                                     + (f" until {t:g} s" if t else " forever")), None
                return SgVerdict(status="assert" if e.exc == "AssertionError" else "error", stage="bootstrap",
                                 exception=e.exc, message=e.message), None
        pull = zctx.socket(zmq.PULL)
        pull.setsockopt(zmq.MAXMSGSIZE, 1 << 16)
        port = pull.bind_to_random_port(f"tcp://{spec.host}")
        ptrs = sglang_order(self.kv)
        facts = wire.DFacts(spec.host, port, self.agent.name, self.agent.metadata(), ptrs, aux_ptrs(self.aux), 0,
                            side.tp_size, spec.tp_rank, self.kv.block_len,
                            [self.state.ctypes.data] if side.hybrid else [], STATE_ITEM)
        found = founds[spec.requests[0].room]
        targets = [t[0] for t in found.targets]
        trackers = {r.room: wire.Tracker(rel, founds[r.room].required, side.hybrid) for r in spec.requests}
        socks: dict[tuple[str, int], Any] = {}  # one PUSH per P endpoint; the registration once on each
        try:
            for r in spec.requests:
                for _rank, ip, p_port in founds[r.room].targets:
                    new = (ip, p_port) not in socks
                    if new:
                        s = socks[(ip, p_port)] = zctx.socket(zmq.PUSH)
                        s.setsockopt(zmq.LINGER, 1000)
                        s.connect(f"tcp://{ip}:{p_port}")
                    msgs = wire.encode(rel, facts, wire.Request(r.room, r.d_pages, r.slot, state_indices=[r.slot] if side.hybrid
                                                                else []), register=new)
                    if spec.fault == "no_transfer_info":  # D stops after its registration (0.4.9+), or sends nothing
                        msgs = msgs[:-1]
                    for frames in msgs:
                        socks[(ip, p_port)].send_multipart(frames)
        finally:
            for s in socks.values():
                s.close()
        if spec.fault == "no_transfer_info":
            time.sleep(min(spec.hang_s, 1.0))  # D stays up (P adds its agent); the request never proceeds
            pull.close(0)
            return SgVerdict(status="hang", stage="bootstrap", p_ranks=targets,
                             message="D sent no TransferInfo"), None
        addr = f"{bhost}:{spec.bootstrap_port}"
        beat, misses = time.monotonic() + spec.heartbeat_s, 0
        while not all(t.done() for t in trackers.values()) and time.monotonic() < deadline:
            if rel.heartbeat_s is not None and time.monotonic() >= beat:
                # the release's heartbeat thread, at pdcheck's interval: GET /health
                beat = time.monotonic() + spec.heartbeat_s
                misses = 0 if _healthy(addr, 2.0) else misses + 1  # SGLang: timeout=(2, 3)
                if misses >= rel.heartbeat_failures:
                    pull.close(0)
                    pending = sum(not t.done() for t in trackers.values())
                    return node_failure(rel, addr, spec.requests[0].room, pending, p_ranks=targets), None
            if pull.poll(20):
                frames = pull.recv_multipart()
                room = int(frames[1]) if len(frames) > 1 and frames[1].isdigit() else -1
                if room in trackers:
                    trackers[room].status(frames)
            for got in self.agent.notifs().values():
                for x in got:
                    text = x.decode(errors="replace")
                    room = int(text.split("_", 1)[0]) if text.split("_", 1)[0].isdigit() else -1
                    if room in trackers:
                        trackers[room].notif(text)
            failed = next((t.failed for t in trackers.values() if t.failed is not None), None)
            if failed is not None:
                return SgVerdict(status="error", stage="transfer", exception="KVTransferError", p_ranks=targets,
                                 message=f"KVTransferError(bootstrap_room={spec.requests[0].room}): {failed}"), None
        pull.close(0)
        if not all(t.done() for t in trackers.values()):
            t, text = wait_text(rel)
            return SgVerdict(status="hang", stage="completion", timeout_s=t, p_ranks=targets, warning=found.warning,
                             message=f"no completion within pdcheck's {spec.hang_s:g} s; {text}"), None
        if spec.fault == "duplicate_room":  # D decodes a moment later: P's writes for the second request land
            time.sleep(min(spec.hang_s, 0.5))
        transfer = self._verify(targets)
        if transfer.status != "ok":
            return SgVerdict(status="silent", stage="transfer", p_ranks=targets, warning=found.warning,
                             message=(f"completed, but {transfer.wrong} of {transfer.blocks} pages hold wrong bytes: "
                                      if transfer.wrong else f"completed, {transfer.blocks} KV pages right, but ")
                             + f"{transfer.message}"), transfer
        return SgVerdict(status="ok", p_ranks=targets, warning=found.warning), transfer

    def _verify(self, targets: list[int]) -> m.TransferResult:
        """Every D page of every request against what a correct transfer puts there: the P page of the same
        layer and K/V, P rank by P rank across D's heads when P's TP is larger."""
        spec, side, p = self.spec, self.spec.side, self.spec.p_side
        g, pg = side.geometry(), p.geometry()
        hb = side.head_dim * g.elem_size
        d_item = self.kv.block_len
        checked = wrong = 0
        first: m.Mismatch | None = None
        wrong_regions: set[int] = set()
        for r in spec.requests:
            # D allocated by its own page size: page i of D pairs with P's page i; D pages past P's count (a
            # smaller D page) cannot hold what P's larger pages carry and count as wrong
            k = min(len(r.d_pages), len(r.p_pages))
            d_pages, p_pages, extra = r.d_pages[:k], r.p_pages[:k], len(r.d_pages) - k
            for idx in range(side.num_ptrs):
                region = region_of(idx, side.layers, side.mla)
                got = self.kv.read_blocks(region, np.asarray(d_pages))
                want = np.zeros_like(got)
                p_region = region_of(idx, p.layers, p.mla)
                if p.tp_size < side.tp_size and not p.mla and not side.mla:  # this rank's slice of P's heads
                    src = pattern(spec.tag, targets[0], p_region, np.asarray(p_pages), 0, pg.block_len)
                    dh, ph = g.local_kv_heads * hb, pg.local_kv_heads * hb
                    off = (spec.tp_rank * g.local_kv_heads) % pg.local_kv_heads * hb
                    for t in range(side.page_size):
                        want[:, t * dh:(t + 1) * dh] = src[:, t * ph + off:t * ph + off + dh]
                elif len(targets) == 1 or p.mla:
                    n = min(d_item, pg.block_len)
                    want[:, :n] = pattern(spec.tag, targets[0], p_region, np.asarray(p_pages), 0, n)
                else:  # P TP > D TP: each token slot holds every target P rank's heads in rank order
                    ph = pg.local_kv_heads * hb
                    for i, pr in enumerate(targets):
                        src = pattern(spec.tag, pr, p_region, np.asarray(p_pages), 0, pg.block_len)
                        for t in range(side.page_size):
                            dst = t * len(targets) * ph + i * ph
                            want[:, dst:dst + ph] = src[:, t * ph:(t + 1) * ph]
                bad = np.flatnonzero((got != want).any(axis=1))
                checked += len(r.d_pages)
                wrong += len(bad) + extra
                if len(bad) or extra:
                    wrong_regions.add(region)
                    if first is None and len(bad):
                        b = int(bad[0])
                        cell = int(np.flatnonzero(got[b] != want[b])[0]) // 16 * 16
                        first = m.Mismatch(region, d_pages[b], p_pages[b], targets[0],
                                           decode_cell(want[b, cell:cell + 16]).describe(g),
                                           decode_cell(got[b, cell:cell + 16]).describe(g))
        aux_bad = self._verify_aux() + self._verify_state() if not spec.bootstrap_host else []
        if not wrong and not aux_bad:
            return m.TransferResult("ok", blocks=checked)
        msg = (f"D page {first.local_block} {g.region_name(first.region)} +cell: expected {first.expected}, "
               f"found {first.found}") if first else None
        if aux_bad:
            msg = "; ".join(x for x in (msg, f"{len(aux_bad)} metadata or state slot(s) wrong, first {aux_bad[0]}") if x)
        return m.TransferResult("wrong", blocks=checked, wrong=wrong, first_mismatch=first,
                                wrong_regions=sorted(wrong_regions), message=msg)


    def _verify_aux(self) -> list[str]:
        """Slot i of each of D's metadata buffers against P's slot i of the same buffer (P has none: wrong)."""
        spec, bad = self.spec, []
        for r in spec.requests:
            i = r.slot
            for b in range(spec.side.aux_buffers):
                got = self.aux[b, i]
                if b >= spec.p_side.aux_buffers or (got != aux_pattern(spec.tag, b, [i])[0]).any():
                    cell = decode_cell(got[:16])
                    held = (f"P buffer {cell.region - AUX_REGION} slot {cell.block}" if cell.valid and
                            cell.region >= AUX_REGION else cell.describe())
                    bad.append(f"D buffer {b} slot {i}: " + (f"P has no buffer {b}; " if b >= spec.p_side.aux_buffers
                                                            else "") + f"holds {held}")
        return bad


    def _verify_state(self) -> list[str]:
        """A hybrid model's state slot i against P's state slot i (P without state: wrong)."""
        spec, bad = self.spec, []
        if not spec.side.hybrid:
            return bad
        for r in spec.requests:
            i = r.slot
            got = self.state[0, i]
            if not spec.p_side.hybrid or (got != state_pattern(spec.tag, [i])[0]).any():
                bad.append(f"D state slot {i}: holds {decode_cell(got[:16]).describe()}")
        return bad


def _healthy(addr: str, timeout_s: float) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=timeout_s) as r:
            return r.status == 200
    except OSError:
        return False


def sglang_decode_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(SgDecodeRole, conn, spec_bytes)
