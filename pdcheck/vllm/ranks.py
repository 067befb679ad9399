"""vLLM's handshake roles on the rank skeleton (pdcheck.ranks.run_rank): P (PrefillRole, also serve's; serve
only sets its spec's log_requests and tag_blocks) and D (DecodeRole). Every rank is a real NIXL agent
(pdcheck.nixlagent.Agent) talking to the launcher over a pipe with msgspec messages.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np
import zmq

from pdcheck import messages as m
from pdcheck.kvcache import KVCache, block_descs
from pdcheck.launcher import name_this_process
from pdcheck.nixlagent import Agent, no_memory_hooks
from pdcheck.pattern import engine_tag
from pdcheck.progress import log_line
from pdcheck.ranks import Role, fail, run_rank
from pdcheck.sidechannel import Listener, fetch
from pdcheck.vllm import messages as vm
from pdcheck.vllm.engine import Params, run
from pdcheck.vllm.ports import rank_offset
from pdcheck.vllm.releases import CORRECTED, resolve, shapes
from pdcheck.vllm.releases.base import Local, Prepared
from pdcheck.vllm.transfer import LocalLists, prove
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireFormat, encode_reply


def _gpu_index(device_id: int) -> int:
    import torch

    return device_id % max(1, torch.cuda.device_count())


class _HandshakeRole(Role):
    """A handshake or serve rank: a KV cache of the scenario's geometry registered with one NIXL agent."""

    def environment(self) -> None:
        no_memory_hooks(self.spec.device)

    @property
    def agent_name(self) -> str:
        return f"{self.spec.engine_id}-{self.letter.lower()}{self.spec.tp_rank}"

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        spec = self.spec
        self.kv = KVCache(spec.geometry, spec.num_blocks, spec.device,
                          _gpu_index(spec.device_id) if spec.device == "cuda" else 0,
                          spec.memory_layout or spec.kv_cache_layout)
        return self.kv.regions(spec.device_id), self.kv.mem_type


def prefill_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(PrefillRole, conn, spec_bytes)


def decode_main(conn: Connection, spec_bytes: bytes) -> None:
    run_rank(DecodeRole, conn, spec_bytes)


# ---------------------------------------------------------------------------------------------- prefill
class PrefillRole(_HandshakeRole):
    """P: serves its metadata on the side channel (handshake and serve), tags blocks on request and collects
    READ notifications until Stop."""

    spec_type = vm.PrefillSpec
    letter = "P"

    @property
    def host(self) -> str:
        return str(self.spec.host)

    def ready(self) -> m.Msg:
        spec, agent, kv = self.spec, self.agent, self.kv
        if spec.tag_blocks:
            # A real decode instance reads blocks without asking: tag them before the side channel opens.
            every = np.arange(min(spec.tag_blocks, spec.num_blocks))
            for region in range(len(kv.views)):  # region by region: bounds the pattern's memory
                kv.tag(engine_tag(spec.engine_id), spec.tp_rank, region, every)
        values = served_metadata(spec.engine_id, agent, kv, tp_size=spec.tp_size,
                                 kv_cache_layout=spec.kv_cache_layout, device_id=spec.device_id)
        return m.Ready(spec.tp_rank, agent.name, self.setup_ms(), msgspec.msgpack.encode(values))

    def run(self) -> None:
        spec, conn, agent, kv = self.spec, self.conn, self.agent, self.kv
        serve = self.receive()
        if not isinstance(serve, vm.Serve):
            return
        ctx = zmq.Context()
        listeners: list[Listener] = []
        try:
            per_rank = {r: msgspec.msgpack.decode(raw, type=AnyMeta) for r, raw in serve.values.items()}
            pp, g = spec.pp_size, spec.geometry
            for ls in serve.listeners:
                fmt = FORMATS[ls.wire]

                def stage_frames(stage: int, fmt: WireFormat = fmt, ls: vm.ListenerSpec = ls) -> dict[int, list[bytes]]:
                    return {r: encode_reply(fmt, shapes.stage_metadata(per_rank[r], g, pp, stage), ls.compat_hash)
                            for r in ls.ranks}

                # One stage per TP rank before era H (shapes.served_stage), every stage under (pp_rank, tp_rank) in H
                keyed = ls.wire >= shapes.PP_STAGES_KEYED
                frames = stage_frames(0 if keyed else shapes.served_stage(ls.wire, pp))
                own = frames.get(spec.tp_rank) or frames[ls.ranks[0]]
                later = {s: stage_frames(s) for s in range(1, pp)} if keyed else {}
                # Raw eras (A-E) serve their own rank whatever was asked; F-H look the rank up (KeyError kills it).
                log = _request_log(ls, pp) if spec.log_requests else None
                listeners.append(Listener(ctx, spec.host, ls.bind_port, fmt, replier(fmt, frames, own), log,
                                          stage_reply=_stage_replier(fmt, later) if later else None))
        except Exception as exc:
            for lst in listeners:
                lst.close()
            ctx.destroy(0)
            fail(self, exc)
            return
        m.send(conn, vm.Serving(spec.tp_rank, [lst.port for lst in listeners]))
        name_this_process(f"pdcheck-P{spec.tp_rank}:hs")
        inj = spec.inject
        p_tag = engine_tag(spec.engine_id)  # once: every tag request uses it
        notifs: list[str] = []
        tagging = False
        stopping = False
        poller = zmq.Poller()
        for lst in listeners:
            poller.register(lst.sock, zmq.POLLIN)
        poller.register(conn.fileno(), zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(2))
                for lst in listeners:
                    if lst.sock in events:
                        if spec.tp_rank in inj.die_p:
                            os._exit(17)  # test hook: a rank that dies mid-handshake
                        was_dead = lst.dead
                        lst.handle(mute=spec.tp_rank in inj.mute_p)
                        if spec.log_requests and lst.dead and not was_dead:
                            log_line(f"listener {lst.fmt.name} :{lst.port} died on a request it could not unpack: "
                                      f"{lst.dead} (vLLM's listener thread ends here; later requests time out)")
                if conn.fileno() in events:
                    msg = m.recv(conn)
                    if isinstance(msg, m.TagReq):
                        if not tagging:
                            tagging = True
                            name_this_process(f"pdcheck-P{spec.tp_rank}:xfer")
                        # A D whose geometry differs may ask for regions P does not have: tag_many skips them.
                        kv.tag_many(p_tag, spec.tp_rank, msg.blocks)
                        for p, region, block in inj.corrupt:
                            if p == spec.tp_rank and block in msg.blocks.get(region, []):
                                kv.write_blocks(region, np.asarray([block]),
                                                np.full((1, kv.block_len), 0x5A, np.uint8))
                        m.send(conn, m.Tagged(msg.ticket))
                    elif isinstance(msg, m.Stop):
                        stopping = True
                for peer, got in agent.notifs().items():
                    notifs.extend(x.decode(errors="replace") for x in got)
                    if spec.log_requests:  # serve: a real decode's READ completions, as they arrive
                        for x in got:
                            log_line(f"P rank {spec.tp_rank}: NIXL notification from {peer}: "
                                      f"{x.decode(errors='replace')!r}")
                if stopping:  # after this last look: a READ's notification may land with the Stop
                    break
        finally:
            for lst in listeners:
                lst.close()
            ctx.destroy(0)
        dead = "; ".join(f"{lst.fmt.name}: {lst.dead}" for lst in listeners if lst.dead) or None
        m.send(conn, vm.PrefillFinal(spec.tp_rank, sum(lst.served for lst in listeners), notifs, dead))


def served_metadata(engine_id: str, agent: Agent, kv: KVCache, *, tp_size: int, kv_cache_layout: str,
                    device_id: int) -> AnyMeta:
    """What a P rank serves on its side channel, every era's fields (wire.build_metadata keeps an era's own)."""
    g = kv.geometry
    return AnyMeta(
        engine_id=engine_id, agent_metadata=agent.metadata(), kv_caches_base_addr=kv.base_addrs,
        num_blocks=kv.num_blocks, tp_size=tp_size, block_len=g.block_len,
        block_lens=[g.block_len] * g.num_regions, block_strides=[g.row_len] * g.num_regions,
        attn_backend_name=g.attn_backend, kv_cache_layout=kv_cache_layout,
        device_id=device_id, block_size=g.block_size, ssm_sizes=g.ssm_sizes,
        physical_blocks_per_logical_kv_block=1,
        # 0.30+: the layer each region belongs to (0.30 - 0.33 compare names, 0.34 pairs regions by them)
        region_names=g.region_layers(), region_members=[[n] for n in g.region_layers()],
        region_group_ids=g.region_group_ids() if g.groups else None,
    )


def _request_log(ls: vm.ListenerSpec, pp_size: int = 1) -> Any:
    fmt = FORMATS[ls.wire]
    keyed = ls.wire >= shapes.PP_STAGES_KEYED

    def log(identity: bytes, request: bytes, rank: int | None, nbytes: int) -> None:
        # Raw eras (A-E) do not name a rank: the listener answers for its own.
        served = ls.ranks[0] if rank is None else rank
        # With stages, the one that answered: asked by number from era H (a request logged there parsed),
        # before it the one the listener serves (shapes.answered_stage)
        stage = (f"pp_rank {shapes.answered_stage(ls.wire, fmt.parse_stage(request) if keyed else 0, pp_size)} "
                 if pp_size > 1 else "")
        log_line(f"era {ls.wire} :{ls.port} peer {identity.hex()} request {readable(request)} {stage}"
                  f"tp_rank {served} -> reply {nbytes} bytes")

    return log


def readable(request: bytes, most: int = 120) -> str:
    """A side-channel request as a log reader knows it: the era's text ('get_meta_msg'), or its msgpack message
    decoded (plain values only: msgpack, never pickle), else hex."""
    if request.isascii() and request.decode().isprintable():
        return repr(request.decode()[:most])
    try:
        value = msgspec.msgpack.decode(request)
    except (msgspec.DecodeError, RecursionError, ValueError):
        return request[:most].hex()

    def plain(v: Any) -> Any:
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        return [plain(x) for x in v] if isinstance(v, list) else v

    return repr(plain(value))[:most]


def replier(fmt: WireFormat, frames: dict[int, list[bytes]], own: list[bytes]) -> Any:
    def reply(rank: int | None) -> list[bytes]:
        out = own if rank is None else frames[rank]
        if fmt.reply_frames == 2:  # era H: the listener's perf_counter at reply time, for D's clock sync
            return [out[0], msgspec.msgpack.encode(time.perf_counter())]
        return out

    return reply


def _stage_replier(fmt: WireFormat, later: dict[int, dict[int, list[bytes]]]) -> Any:
    def reply(stage: int, rank: int | None) -> list[bytes]:
        return replier(fmt, later[stage], [])(rank)  # KeyError on a stage or rank P lacks, as encoded_data[...]

    return reply


# ----------------------------------------------------------------------------------------------- decode
class RealIO:
    """HandshakeIO over a real REQ socket and a real NIXL agent."""

    def __init__(self, zctx: zmq.Context, spec: vm.DecodeSpec, agent: Agent, kv: KVCache, rel: vm.DRelease,
                 go: m.Go) -> None:
        self.zctx, self.spec, self.agent, self.kv, self.rel, self.go = zctx, spec, agent, kv, rel, go
        self.handles: dict[int, Any] = {}

    def fetch(self, fmt: WireFormat, p_rank: int, timeout_ms: int | None, pp_rank: int = 0) -> list[bytes]:
        # D addresses P by its own era's port scheme; P may speak another era (cross-release pairs).
        layout = self.rel.p_base_port + rank_offset(fmt.name, p_rank)
        # Only ports this run bound: a layout port no listener of ours serves goes to our silent port. Against a
        # live P (--prefill-endpoint) the user named the instance, and its layout ports are its real ports.
        port = layout if self.spec.live else self.go.ports.get(layout, self.go.silent)
        # On several nodes each P rank listens on its own node's address; held ports live where the parent runs.
        host = self.spec.p_host if self.spec.live else self.go.hosts.get(layout, self.go.host or self.spec.p_host)
        if self.rel.head_host:  # a P spanning nodes: the release dials remote_host, the head node, for every rank
            host = self.spec.p_host
        return fetch(self.zctx, host, port, fmt, p_rank, timeout_ms or self.spec.hang_timeout_ms, pp_rank)

    def add_remote_agent(self, blob: bytes) -> str:
        return self.agent.add_remote(blob)

    def prep_remote(self, prepared: Prepared, mem_type: str) -> None:
        # per region: its blocks (K halves first, then V halves when the release splits a block into two)
        descs = block_descs(prepared.base_addrs, prepared.dlist_blocks, prepared.remote_block_len,
                            prepared.block_len, prepared.device_id, offset=prepared.rank_offset,
                            halves=prepared.halves, stride=prepared.remote_stride)
        self.handles[prepared.p_rank] = self.agent.prep(
            prepared.agent, descs, self.kv.mem_type, f"remote descriptors for P rank {prepared.p_rank}")


class DecodeRole(_HandshakeRole):
    """D: runs every requested release model's handshake for real against the P ranks, then the transfer proof."""

    spec_type = vm.DecodeSpec
    letter = "D"

    @property
    def host(self) -> str:
        return str(self.spec.p_host)

    def ready(self) -> m.Msg:
        spec, agent, kv = self.spec, self.agent, self.kv
        self.lists = LocalLists(agent, kv, spec.device_id)
        if spec.transfer:
            self.lists.get(kv.block_len, 0)  # vLLM prepares the local list at registration
        return m.Ready(spec.tp_rank, agent.name, self.setup_ms())

    def run(self) -> None:
        spec, conn, agent, kv, lists = self.spec, self.conn, self.agent, self.kv, self.lists
        g = kv.geometry
        go = self.receive()
        if not isinstance(go, m.Go):
            return
        name_this_process(f"pdcheck-D{spec.tp_rank}:hs")
        t1 = time.perf_counter()
        zctx = zmq.Context()
        local = Local(spec.engine_id, spec.tp_rank, spec.tp_size, spec.num_blocks, g, spec.kv_cache_layout,
                      spec.device_id, pp_size=spec.pp_size, memory_layout=spec.memory_layout,
                      permute_local_kv=spec.permute_local_kv)
        verdicts: dict[str, vm.Verdict] = {}
        bypassed: dict[str, vm.Verdict] = {}
        transfers: dict[str, m.TransferResult] = {}
        ticket = [0]

        def tag(p_rank: int, blocks: dict[int, list[int]]) -> None:
            if ticket[0] == 0:
                name_this_process(f"pdcheck-D{spec.tp_rank}:xfer")
            ticket[0] += 1
            m.send(conn, m.TagReq(ticket[0], p_rank, blocks))
            reply = m.recv(conn)
            assert isinstance(reply, m.Tagged) and reply.ticket == ticket[0]

        tp_ratio = max(1, spec.tp_size // max(1, spec.params_tp_size))
        try:
            for rel in spec.releases:
                name = rel.name
                model = resolve(name)
                params = Params(spec.remote_engine_id, spec.params_tp_size, rel.p_wire, rel.local_hash,
                                pp_size=spec.p_pp_size)
                io = RealIO(zctx, spec, agent, kv, rel, go)
                out = run(model, local, params, io, hang_timeout_ms=spec.hang_timeout_ms)
                verdicts[name] = out.verdict()
                if not spec.transfer:
                    continue
                if model is not CORRECTED and out.status in ("assert",):
                    # Show what the release would have delivered with its asserts stripped (python -O).
                    io = RealIO(zctx, spec, agent, kv, rel, go)
                    out = run(model, local, params, io, bypass_asserts=True, hang_timeout_ms=spec.hang_timeout_ms)
                    bypassed[name] = out.verdict()
                if out.status in ("ok", "silent"):
                    transfers[name] = prove(
                        agent, kv, local, out, corrected=model is CORRECTED, remote_handles=io.handles,
                        lists=lists, requests=spec.requests, p_tag=spec.p_engine_tag, notif=model.notif,
                        tp_ratio=tp_ratio, tag=tag, live=spec.live, release=model)
                else:
                    transfers[name] = m.TransferResult("skipped", message=f"handshake ended in {out.status}")
        finally:
            zctx.destroy(0)
        m.send(conn, vm.DecodeResult(spec.tp_rank, spec.num_blocks, verdicts, transfers if spec.transfer else None,
                                   bypassed, (time.perf_counter() - t1) * 1e3))
