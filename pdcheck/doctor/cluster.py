"""`pdcheck doctor --ray ADDRESS`: the two-node check between nodes of a Ray cluster, as a matrix.

Pairs: every node offering `pdcheck_prefill` x every other node offering `pdcheck_decode` (the Ray resources of
docs/ray.md), or, when the cluster has no such labels, every pair of nodes. Each pair is one prefill and one
decode transfer-bench rank (pdcheck.bench.rank), Ray actors pinned to the pair's two nodes by pdcheck's one Ray
placement (pdcheck.raylaunch), driven as `doctor --listen`/`--peer` drive theirs (pdcheck.doctor.pair): fill,
READ, every block checked by coordinate, and the payload's transport as the decode rank's UCX protocol tables
name it. At most --pairs pairs run at a time; each pair's actors end when it does.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from pdcheck import messages as m
from pdcheck.bench import messages as bm
from pdcheck.bench.plan import make_plan
from pdcheck.doctor import loopback, pair
from pdcheck.doctor.model import ORDER, Check, Status, check
from pdcheck.errors import BadInput, HarnessError
from pdcheck.placement import RankId

SLOW_FRACTION = 0.5  # a pair under half the median pair's bandwidth is slow (WARN), as NCCL's readiness checks flag


class Node(msgspec.Struct):
    node_id: str
    address: str
    roles: list[str]  # "prefill", "decode" (the pdcheck_* resources it offers)


class PairRow(msgspec.Struct):
    """One pair of nodes: prefill (the node READ from) -> decode (the node that READ)."""

    prefill: str
    decode: str
    status: Status
    gbps: float
    checked: int
    wrong: int
    data: list[str]  # what carried the payload, as the decode rank's UCX tables name it
    notifications: list[str]
    detail: str
    seconds: float


class ClusterResult(msgspec.Struct):
    address: str  # the Ray cluster's address, or the --matrix listeners as given
    selection: str  # "prefill x decode" or "every pair" (--ray); "every pair of listeners" (--matrix)
    nodes: list[Node]
    concurrency: int
    median_gbps: float
    pairs: list[PairRow]  # broken first, then slow, then by bandwidth, lowest first


def _nodes() -> list[Node]:
    import ray

    from pdcheck.raylaunch import RESOURCE

    out = []
    for n in ray.nodes():
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        roles = [("prefill" if role == "P" else "decode") for role, name in RESOURCE.items() if res.get(name, 0) > 0]
        out.append(Node(n["NodeID"], n["NodeManagerAddress"], roles))
    return sorted(out, key=lambda x: (x.address, x.node_id))


def pairs_of(nodes: list[Node]) -> tuple[str, list[tuple[Node, Node]]]:
    """(how they were chosen, [(prefill node, decode node)])."""
    ps = [n for n in nodes if "prefill" in n.roles]
    ds = [n for n in nodes if "decode" in n.roles]
    if ps and ds:
        return "prefill x decode", [(p, d) for p in ps for d in ds if p.node_id != d.node_id]
    return "every pair", [(a, b) for i, a in enumerate(nodes) for b in nodes[i + 1:]]


def label(n: Node) -> str:
    return f"{n.address} ({n.node_id[:8]})"


def run(address: str, pairs_at_once: int, timeout: float, expect: list[str]) -> tuple[ClusterResult, list[Check]]:
    from pdcheck.raylaunch import RayLauncher

    lau = RayLauncher(address, place_timeout_s=timeout)
    try:
        nodes = _nodes()
        how, todo = pairs_of(nodes)
        if not todo:
            raise BadInput(f"--ray {address}: {len(nodes)} live node(s) and no pair of them to test (a pair needs "
                           "two nodes; with pdcheck_prefill/pdcheck_decode resources, one of each)")
        width = max(1, min(pairs_at_once, len(todo)))
        with ThreadPoolExecutor(max_workers=width, thread_name_prefix="pdcheck-doctor-pair") as pool:
            rows = list(pool.map(lambda job: _one(lau, job[0], *job[1], timeout, expect), enumerate(todo)))
    finally:
        lau.close()
    med = order(rows)
    checks = [as_check(r) for r in rows]
    return ClusterResult(address, how, nodes, width, round(med, 4), rows), checks


def order(rows: list[PairRow]) -> float:
    """Mark the slow pairs (under SLOW_FRACTION of the median of the pairs that moved KV) and sort the rows:
    FAIL, WARN, then PASS, each slowest first. Returns the median."""
    med = statistics.median([r.gbps for r in rows if r.status != "FAIL"] or [0.0])
    for r in rows:
        if r.status == "PASS" and med > 0 and r.gbps < SLOW_FRACTION * med:
            r.status = "WARN"
            r.detail += f"; slow: under half the median pair's {med:.2f} GB/s"
    rows.sort(key=lambda r: (ORDER[r.status], r.gbps, r.prefill, r.decode))
    return med


def as_check(r: PairRow, fail_fix: str | None = None) -> Check:
    """A pair's row as a check; fail_fix: what to run for a broken pair (default: --listen/--peer on its nodes)."""
    fix = None
    if r.status == "FAIL":
        fix = fail_fix or (f"run `pdcheck doctor --listen` on {r.prefill.split()[0]} and `pdcheck doctor --peer` "
                           f"on {r.decode.split()[0]} for both ends' evidence")
    elif r.status == "WARN" and "no link exercised" in r.detail:
        fix = "the pair's two ends run on one host: put one per host (a DaemonSet's listeners, Ray nodes) to test a link"
    elif r.status == "WARN":
        fix = "compare this pair's NICs and UCX_NET_DEVICES with a fast pair's (`pdcheck doctor` on both nodes)"
    c = check(f"pair {r.prefill} -> {r.decode}", r.status, r.detail, fix)
    c.seconds = r.seconds
    return c


def _one(lau: Any, i: int, p_node: Node, d_node: Node, timeout: float, expect: list[str]) -> PairRow:
    """One pair, start to end; anything that goes wrong is this pair's FAIL, never the whole matrix's."""
    from pdcheck.bench.runner import Ranks

    t0 = time.monotonic()
    pk, dk = ("P", i), ("D", i)
    prid, drid = RankId("P", i), RankId("D", i)
    from pdcheck import lifecycle

    logs = lifecycle.scratch_dir("pdcheck-doctor-ray-")
    try:
        try:
            where = lau.place([pk, dk], nodes={pk: p_node.node_id, dk: d_node.node_id})
            plan = make_plan(loopback.config("cpu", timeout))
            row = pair._row_msg(plan)
            ranks = Ranks(lau, logs)
            ucx = pair._ucx_env()
            for rid, key, arena in ((prid, pk, plan.pool_p[0]), (drid, dk, plan.pool_d[0])):
                spec = pair._spec(rid.role, where[key].host or "127.0.0.1", arena, ucx)
                ranks.start(rid, msgspec.structs.replace(spec, agent_name=f"pdcheck-doctor-{rid.short}-{i}"))
            ready = ranks.gather([prid, drid], bm.BenchReady, timeout, "creating agents and registering memory")
            rp = ready[prid]
            ranks.send([prid], row)
            ranks.gather([prid], bm.Filled, timeout, "filling the KV blocks")
            ranks.send([drid], bm.Peers([bm.PeerInfo(0, rp.agent_name, rp.metadata, rp.addr, rp.dev)]))
            ranks.gather([drid], m.Ack, timeout, "loading the prefill node's agent metadata")
            ranks.send([drid], row)
            ranks.gather([drid], m.Armed, timeout, "READing the prefill node's blocks (warm-up)")
            ranks.send([drid], bm.Measure())
            got: bm.RankRow = ranks.gather([drid], bm.RankRow, timeout, "READing the prefill node's blocks")[drid]
            ranks.send([prid, drid], m.Stop())
            ranks.gather([prid, drid], bm.Bye, timeout, "stopping")
        except HarnessError as exc:
            lau.release([pk, dk])
            d_end = pair._evidence(logs / f"{drid.short}.log", d_node.address, "")
            return PairRow(label(p_node), label(d_node), "FAIL", 0.0, 0, 0, d_end.data, d_end.notifications,
                           f"no KV moved: {str(exc)[:400]}", round(time.monotonic() - t0, 3))
        lau.release([pk, dk])  # their logs come back whole: the decode rank's UCX protocol tables
        d_end = pair._evidence(logs / f"{drid.short}.log", d_node.address, ready[drid].ucx_version)
        gbps = round(got.nbytes * got.iters / got.wall_ns, 4) if got.wall_ns else 0.0  # as the matrix shows it
        status, detail, _ = pair.transfer_verdict(got.checked, got.wrong, got.first_wrong, gbps, d_end.data,
                                                  rdma=False, expect=expect, env={}, own_lanes=False)
        if status == "PASS":
            detail = detail.replace(" (UCX protocol table of the decode end)", "") + \
                f"; notifications over {', '.join(d_end.notifications) or '-'}"
        return PairRow(label(p_node), label(d_node), status, gbps, got.checked, got.wrong, d_end.data,
                       d_end.notifications, detail, round(time.monotonic() - t0, 3))
    finally:
        lifecycle.remove_scratch(logs)
