"""`pdcheck probe --sglang`: read a live SGLang prefill's bootstrap server, read-only (HTTP GET only: never a
frame on a rank's ZMQ port, which could kill its listener), and report its layout and what a given decode
release would do with it (the decode's discovery and checks, run against the live answers).

The prefill's era is recognised from which query form its server answers (GETs are harmless, so `auto` is safe).
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdcheck import bounds, netio
from pdcheck.errors import BadInput, HarnessError
from pdcheck.sglang import bootstrap as bs
from pdcheck.sglang.engine import Side, ensure_failed
from pdcheck.sglang.releases import MODELLED, resolve
from pdcheck.sglang.releases.base import SglangRelease
from pdcheck.verdict import RankVerdict, exit_code, rank_label

MAX_RANKS = 1024  # per-rank GETs; a layout claiming more is reported, not walked


class ProbeRank(msgspec.Struct):
    tp_rank: int
    pp_rank: int
    status: int
    rank_ip: str | None = None
    rank_port: int | None = None


class DecodeCheck(msgspec.Struct):
    d_release: str
    d_rank: int
    status: str  # ok | assert | error | hang (as in handshake); bootstrap stage only: no frame is sent
    message: str | None = None
    p_ranks: list[int] = []


class SgProbeReport(msgspec.Struct):
    framework: str
    endpoint: str
    era: str | None  # the bootstrap era its answers match (B1 ... B6), None: not an SGLang bootstrap server
    p_release: str | None  # the first modelled release of that era (or the one named)
    info: dict[str, Any]  # the parallel-info answer as served
    ranks: list[ProbeRank]
    decode: list[DecodeCheck]
    notes: list[str]
    exit_code: int
    verdicts: list[RankVerdict] = []  # decode in the shape every command shares (docs/json.md)


def parse_url(text: str) -> tuple[str, int]:
    """http://HOST:PORT[/...] or HOST:PORT of the bootstrap server."""
    t = text.strip()
    try:
        url = urlsplit(t if "://" in t else f"http://{t}")
    except ValueError as exc:  # e.g. "http://[::1": Invalid IPv6 URL
        raise BadInput(f"--sglang probe: {text!r} is not http://HOST:PORT ({exc})") from None
    if url.scheme != "http":
        raise BadInput(f"--sglang probe: {text!r}: the bootstrap server speaks plain HTTP (http://HOST:PORT)")
    try:
        port = url.port
    except ValueError:
        port = None
    if not url.hostname or port is None or not 1 <= port <= 65535:
        raise BadInput(f"--sglang probe: {text!r} is not http://HOST:PORT (SGLang's default port is 8998)")
    return url.hostname, port


def _as_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


_DROPPED_WHEN_NONE = {"kv_layout", "dsv41_spec_layout"}


def recognise(get: bs.Get) -> tuple[SglangRelease | None, dict[str, Any], str]:
    """Which era answers: try each era's parallel-info query, newest first."""
    last = ""
    for rel in reversed(MODELLED):
        if rel.bootstrap == "B1":
            st, text = get({"engine_rank": 0})
            doc = _as_json(text)
            if st == 200 and isinstance(doc, dict) and "agent_name" in doc:
                return rel, doc, ""
            last = f"HTTP {st} {text[:80]}"
            continue
        st, text = get({k: -1 for k in rel.rank_query})
        doc = _as_json(text)
        if st == 503:
            return rel, {}, text[:200]  # B5+: still registering (only those eras answer 503)
        # each era's exact key set; 0.5.23 leaves out the layout keys that are None (R7 common/conn.py:3232-3236)
        if st == 200 and isinstance(doc, dict) and set(doc) <= set(rel.info_keys) and \
                set(rel.info_keys) - set(doc) <= _DROPPED_WHEN_NONE:
            return _first_alike(rel), doc, ""
        last = f"HTTP {st} {text[:80]}"
    return None, {}, last


def _first_alike(rel: SglangRelease) -> SglangRelease:
    """The first release whose server answers exactly as rel's does (same era, same keys): the answer cannot tell
    them apart, and the report names that release (0.5.8 and 0.5.9 both answer as B4)."""
    k = MODELLED.index(rel)
    while k > 0 and (MODELLED[k - 1].bootstrap, MODELLED[k - 1].info_keys) == (rel.bootstrap, rel.info_keys):
        k -= 1
    return MODELLED[k]


def layout(rel: SglangRelease, info: dict[str, Any]) -> tuple[int, int]:
    """(tp, pp) the bootstrap server advertises."""
    def num(*keys: str) -> int:
        for k in keys:
            v = info.get(k)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return 1
    return num("attn_tp_size", "prefill_attn_tp_size", "prefill_tp_size"), num("pp_size", "prefill_pp_size")


def run(host: str, port: int, p_release: str | None, d_text: str | None, decode: Side,
        timeout_s: float = 2.0) -> SgProbeReport:
    """Recognise the era, walk P's ranks once and run each decode release's discovery against the answers,
    every exchange within one deadline of timeout_s for the whole probe. HarnessError (exit 3) when nothing
    answers as an SGLang bootstrap server, the answers do not finish in time, or a value is out of bounds."""
    from pdcheck.sglang.releases import resolve_many

    endpoint = f"http://{_bracket(host)}:{port}"
    get = bs.http_get(host, port, timeout_s, netio.deadline_in(timeout_s))
    try:
        return _run(get, endpoint, f"{host}:{port}", p_release, d_text, decode, resolve_many)
    except netio.ReplyTimeout:
        raise HarnessError(f"probe --sglang: {endpoint} did not finish answering within {timeout_s:g} s "
                           "(--timeout bounds the whole probe)") from None
    except netio.PeerError as exc:
        raise HarnessError(f"probe --sglang: {exc}") from None


def _run(get: bs.Get, endpoint: str, addr: str, p_release: str | None, d_text: str | None, decode: Side,
         resolve_many: Any) -> SgProbeReport:
    notes: list[str] = []
    rel, info, why = recognise(get)
    if p_release is not None:
        named = resolve(p_release)
        if rel is not None and rel.bootstrap != named.bootstrap:
            notes.append(f"the server answers as bootstrap era {rel.bootstrap} ({rel.name}), not {named.name}'s "
                         f"{named.bootstrap}")
        rel = named if rel is None or rel.bootstrap == named.bootstrap else rel
    if rel is None:
        raise HarnessError(f"probe --sglang: no SGLang bootstrap answer at {endpoint}/route "
                           f"({bounds.peer_text(why or 'nothing understood', 120)})")
    if rel.bootstrap in ("B5", "B6") and info:
        bounds.peer_doc(info, bs.ServerInfo, bs.WHERE)  # before layout() sizes the walk
    d_releases = resolve_many(d_text or rel.name, "--decode-releases")
    if why:
        notes.append(f"not every P rank has registered yet: {bounds.peer_text(why, 120)}")
    ranks: list[ProbeRank] = []
    tp, pp = layout(rel, info)
    if rel.bootstrap == "B1":
        tp, pp = MAX_RANKS, 1  # no layout in the answer: walk engine ranks until one is missing
    if tp * pp > MAX_RANKS and rel.bootstrap != "B1":
        notes.append(f"P advertises {tp} x {pp} ranks; pdcheck reads at most {MAX_RANKS}")
    else:
        for p in range(pp):
            for t in range(tp):
                q = dict(zip(rel.rank_query, {"B1": [t], "B2": [t, 0], "B3": [t, 0, p], "B4": [t, 0, p]}.get(
                    rel.bootstrap, [0, 0, t, p]), strict=False))
                st, text = get(q)
                doc = _as_json(text)
                if rel.bootstrap == "B1" and st != 200:
                    break
                if st == 200 and isinstance(doc, dict):
                    at = bounds.peer_doc(doc, bs.RankEntry, f"{bs.WHERE} for P rank {t} (pp {p})")
                    ranks.append(ProbeRank(t, p, st, at.rank_ip, at.rank_port))
                else:
                    ranks.append(ProbeRank(t, p, st))
    checks: list[DecodeCheck] = []
    for d_rel in d_releases:
        for r in range(decode.tp_size):
            try:
                found = bs.discover(d_rel, get, tp_rank=r, tp_size=decode.tp_size, pp_size=decode.pp_size,
                                    page_size=decode.page_size, kv_cache_dtype=decode.kv_cache_dtype, mla=decode.mla,
                                    addr=addr)
            except bs.DiscoveryError as e:
                if e.info and d_rel.ensure_retries is not None:  # the verdict engine.decide gives it
                    checks.append(DecodeCheck(d_rel.name, r, "error", ensure_failed(d_rel, addr, "R",
                                                                                   e.message).message))
                    continue
                status = "hang" if e.retry else "assert" if e.exc == "AssertionError" else "error"
                checks.append(DecodeCheck(d_rel.name, r, status, e.message))
                continue
            checks.append(DecodeCheck(d_rel.name, r, "ok", found.warning, [t[0] for t in found.targets]))
    code = exit_code(c.status == "ok" for c in checks)
    return SgProbeReport("sglang", endpoint, rel.bootstrap, rel.name, info, ranks, checks, notes, code, [RankVerdict(
        release=c.d_release, rank=rank_label(c.d_rank), status=c.status, detail=c.message or "", stage="bootstrap",
        contacted=c.p_ranks) for c in checks])


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def render(rep: SgProbeReport, console: Any) -> None:
    """The report as tables. Every string a peer sent is printed cut to bounds.MAX_PEER_STR, as plain text:
    no markup, no highlighter (rich's regex highlighter takes minutes over a 60,000-character value)."""
    from rich.markup import escape
    from rich.table import Table

    def cell(v: Any) -> str:
        return bounds.peer_text(v)

    console.print(f"SGLang bootstrap server {rep.endpoint}: era {rep.era or '-'} (as {rep.p_release or '-'})",
                  markup=False, highlight=False)
    if rep.info:
        console.print("  " + ", ".join(f"{cell(k)}={cell(v)}" for k, v in rep.info.items() if v is not None),
                      markup=False, highlight=False)
    if rep.ranks:
        t = Table(title="P ranks (GET /route)", highlight=False)
        for col in ("tp", "pp", "HTTP", "rank_ip", "rank_port"):
            t.add_column(col)
        for r in rep.ranks:
            t.add_row(str(r.tp_rank), str(r.pp_rank), str(r.status), escape(cell(r.rank_ip or "-")),
                      str(r.rank_port or "-"))
        console.print(t)
    if rep.decode:
        t = Table(title="what a decode would do (its discovery and checks; no frame sent)", highlight=False)
        for col in ("decode", "D", "verdict", "detail"):
            t.add_column(col)
        for c in rep.decode:
            t.add_row(c.d_release, str(c.d_rank), c.status,
                      escape(cell(c.message or f"targets P ranks {c.p_ranks}")))
        console.print(t)
    for n in rep.notes:
        console.print(f"[yellow]note:[/] {escape(cell(n))}", highlight=False)


def probe_report(endpoint: str, p_release: str, decode_releases: str | None, scenario: Any,
                 timeout_s: float) -> SgProbeReport:
    """The `probe --sglang` command body: the report (the command layer prints it)."""
    from pdcheck.sglang.releases import resolve_many
    from pdcheck.sglang.scenario import load

    host, port = parse_url(endpoint)
    bounds.check_seconds("--timeout", timeout_s, bounds.PROBE_TIMEOUT_S)
    named = None if p_release.strip() == "auto" else resolve(p_release).name
    if decode_releases is not None:
        resolve_many(decode_releases, "--decode-releases")  # bad input before any request
    decode = load(scenario).decode.side() if scenario is not None else Side()
    return run(host, port, named, decode_releases or named, decode, timeout_s)
