"""The parent's side of vLLM's handshake runs (handshake, live, serve), on the runtime's waits (pdcheck.orchestrate):
wait until every P rank serves its side channel, hold the layout ports no P rank serves (silent) or all of them for
an explicit base_port, and route each D rank's block-tag requests to its P rank and the answer back until every D
rank has its result."""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Iterable
from contextlib import ExitStack
from typing import TYPE_CHECKING, TypeVar

import msgspec

from pdcheck import messages as m
from pdcheck import orchestrate as orc
from pdcheck.placement import RankHandle
from pdcheck.vllm import messages as vm

if TYPE_CHECKING:
    from pdcheck.vllm.ports import PortPlan

R = TypeVar("R", bound=RankHandle)
Tick = orc.Tick


def await_serving(lau: orc.Events, p_ranks: dict[int, R], listeners: dict[int, list[vm.ListenerSpec]],
                  timeout_s: float, tick: Tick | None = None) -> dict[int, int]:
    """Wait until every P rank listens; layout port -> the port really bound."""
    stage = orc.Stage("{rank} could not open its side channel: {error}",
                  "{rank} died during start-up (opening its side channel): it {ended}",
                  "{ranks} not serving after {timeout:g} s", timeout_s)
    got = orc.gather(lau, list(p_ranks.values()), vm.Serving, timeout_s, stage,
                 tick=(lambda done, total: tick("side channels", done, total)) if tick else None)
    bound: dict[int, int] = {}
    for rank, msg in got.values():
        bound.update(zip([ls.port for ls in listeners[rank.tp_rank]], msg.ports, strict=True))
    return bound

def reserve_layout(held: ExitStack, host: str, plan: PortPlan, contacted: bool = True) -> dict[int, socket.socket]:
    """An explicit base_port: hold every layout port (served and contacted) before any rank starts. A rank's
    UCX listeners and outgoing connections take ports from the kernel's ephemeral range
    (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default), which skips ports already bound: a
    layout inside that range cannot be taken by the run's own ranks. Served ports are released just before
    their P rank binds them (release_served), the others stay held silent for the run. contacted=False: the
    served ports only (serve holds no silent ports)."""
    from pdcheck.sidechannel import hold_silent  # zmq: see hold_the_rest

    served = {ls.port for specs in plan.listeners.values() for ls in specs}
    ports = sorted({*plan.contacted, *served} if contacted else served)
    return {port: held.enter_context(hold_silent(host, port)) for port in ports}

def release_served(reserved: dict[int, socket.socket], plan: PortPlan) -> None:
    for specs in plan.listeners.values():
        for ls in specs:
            sock = reserved.pop(ls.port, None)
            if sock is not None:
                sock.close()  # the P rank binds it next (two listening sockets cannot share a port)

def hold_the_rest(held: ExitStack, host: str, contacted: list[int], fixed: bool, bound: dict[int, int],
                  reserved: dict[int, socket.socket] | None = None) -> m.Go:
    """Hold every contacted layout port no P listener serves (silent), plus one silent catch-all port.
    fixed: the layout ports are bound as they are (explicit base_port), else each maps to the catch-all.
    Ports reserve_layout already holds stay held as they are."""
    # zmq, imported here, when ports are held: the CLI imports this module before the forkserver warm-up
    from pdcheck.sidechannel import hold_silent

    ports = dict(bound)
    reserved = reserved or {}
    catch_all = held.enter_context(hold_silent(host, 0))
    for layout in contacted:
        if layout in ports:
            continue
        if layout in reserved:
            ports[layout] = reserved[layout].getsockname()[1]
        else:
            ports[layout] = held.enter_context(hold_silent(host, layout)).getsockname()[1] if fixed \
                else catch_all.getsockname()[1]
    return m.Go(ports, catch_all.getsockname()[1])

def reserve_head_node(held: ExitStack, p_host: dict[int, str], listeners: dict[int, list[vm.ListenerSpec]]
                      ) -> dict[int, list[vm.ListenerSpec]]:
    """A P spanning nodes: every listener of a P rank on another node takes its port from the head node (P rank
    0's address), where pdcheck holds it silent for the run, before that rank binds the same number on its own
    address. A release that dials the head node for that rank (releases.multinode) then reaches pdcheck's
    silent socket, never another process of this machine; and holding first means no other process can have
    taken the port on the head node in between. bind_port 0: a port the OS picks; else that port."""
    from pdcheck.sidechannel import hold_silent  # zmq: see hold_the_rest

    head = p_host[0]
    out: dict[int, list[vm.ListenerSpec]] = {}
    for r, specs in listeners.items():
        if p_host[r] == head:
            out[r] = specs
            continue
        out[r] = [msgspec.structs.replace(ls, bind_port=held.enter_context(hold_silent(head, ls.bind_port))
                                          .getsockname()[1]) for ls in specs]
    return out

def route_tags(lau: orc.Events, p_ranks: dict[int, R], d_ranks: dict[int, R], run_timeout_s: float,
               harness: list[str], *, expected_dead: Iterable[int] = (), tick: Tick | None = None,
               ) -> tuple[dict[int, vm.DecodeResult], dict[int, vm.PrefillFinal]]:
    """Run the handshakes and transfer proof to the end: route each D rank's TagReq to its P rank and the
    Tagged reply back, collect every DecodeResult (then Stop the P ranks) and PrefillFinal. A dead rank goes
    into `harness`; one nobody meant to kill (expected_dead: P ranks a test hook kills) stops the run at once."""
    results: dict[int, vm.DecodeResult] = {}
    finals: dict[int, vm.PrefillFinal] = {}
    expected = set(expected_dead)
    # This side issues its own ticket ids: each D rank numbers its requests from 1, so two D ranks reading one
    # P rank would otherwise collide and one would wait forever.
    owner: dict[int, tuple[int, R, int]] = {}  # global ticket -> (P rank, D rank, the D rank's ticket)
    next_ticket = 0
    everyone = [*p_ranks.values(), *d_ranks.values()]
    phase = {r.id: "handshake" for r in everyone}  # -> "transfer" at the rank's first block-tag request
    for rank, msg in lau.events(everyone, time.monotonic() + run_timeout_s):
        if msg is None:
            if rank.tp_rank in (results if rank.role == "D" else finals):
                continue
            how = f"{rank.id} died during {phase[rank.id]}: it {rank.ended()}"
            harness.append(how)
            if not (rank.role == "P" and rank.tp_rank in expected):
                # A rank nobody meant to kill: its sentinel fired now, so say so now, stop everything and
                # report what the other ranks delivered (exit 3) instead of waiting for --timeout. One that
                # pdcheck stopped (Ctrl-C in smoke's other threads: launcher.abort_all) did not die: no line.
                if rank.stopped is None:
                    print(f"pdcheck: {how}; stopping the run", file=sys.stderr, flush=True)
                break
            # A D rank waiting for tags from a dead P gets an answer so it can report the failed READ.
            for gid, (p_rank, d_rank, ticket) in list(owner.items()):
                if rank.role == "P" and p_rank == rank.tp_rank:
                    d_rank.send(m.Tagged(ticket))
                    owner.pop(gid)
        elif isinstance(msg, m.TagReq):
            phase[rank.id] = "transfer"
            target = p_ranks.get(msg.p_rank)
            if target is None or target.done:
                rank.send(m.Tagged(msg.ticket))
            else:
                next_ticket += 1
                phase[target.id] = "transfer"
                owner[next_ticket] = (msg.p_rank, rank, msg.ticket)
                target.send(m.TagReq(next_ticket, msg.p_rank, msg.blocks))
        elif isinstance(msg, m.Tagged):
            entry = owner.pop(msg.ticket, None)
            if entry is not None:
                entry[1].send(m.Tagged(entry[2]))
        elif isinstance(msg, vm.DecodeResult):
            results[rank.tp_rank] = msg
            rank.done = True
            if tick:
                tick("handshakes + transfer proof", len(results), len(d_ranks))
            if len(results) == len(d_ranks):
                orc.send_all(p_ranks.values(), m.Stop())
        elif isinstance(msg, vm.PrefillFinal):
            finals[rank.tp_rank] = msg
            rank.done = True
    for r in d_ranks.values():
        if r.tp_rank not in results and not any(str(r.id) in h for h in harness):
            harness.append(f"{r.id} did not report within {run_timeout_s:g} s")
    return results, finals
