"""SGLang's HTTP bootstrap server, as a pure table per era (docs/sglang-protocol.md §3), the real server over it, and D's
discovery (GET /route) against any `get` callable: the engine passes the table, a D rank real HTTP.

The table answers as the release's aiohttp handler does: a missing PUT key is a KeyError (HTTP 500); a per-rank
GET before that rank registered is 404 (B1), 500 (B2-B4, KeyError) or 503 (B5+, until every rank registered).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Annotated, Any
from urllib.parse import parse_qsl, urlsplit

import msgspec

from pdcheck import bounds, netio
from pdcheck.sglang.releases.base import HETERO_TP_ASSERT, NOT_REGISTERED_503, SglangRelease

MAX_BODY = 64 * 1024  # a PUT /route body is a few hundred bytes
Get = Callable[[dict[str, int]], tuple[int, str]]  # query -> (HTTP status, body text)


class DiscoveryError(Exception):
    """D's receiver stops here, as the release raises (exc names the Python exception type)."""

    def __init__(self, exc: str, message: str, *, retry: bool = False, info: bool = False) -> None:
        super().__init__(message)
        self.exc, self.message, self.retry = exc, message, retry
        self.info = info  # the parallel-info fetch (GET /route with -1s) failed: see SglangRelease.ensure_retries


class Table:
    """P's bootstrap table for one release (`rel`: the release P runs), expecting `world` rank registrations."""

    def __init__(self, rel: SglangRelease, world: int) -> None:
        self.rel, self.world = rel, world
        self.entries: dict[tuple[int, ...], dict[str, Any]] = {}
        self.info: dict[str, Any] = {}
        self.count = 0
        self.lock = threading.Lock()

    def put(self, body: dict[str, Any]) -> tuple[int, str]:
        try:
            vals = {k: body[k] for k in self.rel.put_keys}  # data["..."]: KeyError -> aiohttp's 500
        except KeyError as exc:
            return 500, f"500 Internal Server Error\n\nServer got itself in trouble ({type(exc).__name__}: {exc})"
        with self.lock:
            self.count += 1  # B5+: counts registrations, not distinct ranks (R7 common/conn.py:3172)
            b = self.rel.bootstrap
            if b == "B1":
                key: tuple[int, ...] = (int(vals["engine_rank"]),)
            elif b == "B2":
                # engine_rank spans every DP group: dp_group = engine_rank // (tp_size // dp_size) (R2 common/conn.py)
                per = max(1, int(vals["tp_size"]) // max(1, int(vals["dp_size"])))
                key = (int(vals["engine_rank"]) // per, int(vals["engine_rank"]) % per)
            elif b in ("B3", "B4"):
                key = (int(vals["attn_dp_rank"]), int(vals["attn_tp_rank"]), int(vals["pp_rank"]))
            else:
                key = (int(vals["attn_dp_rank"]), int(vals["attn_cp_rank"]), int(vals["attn_tp_rank"]),
                       int(vals["pp_rank"]))
            self.entries[key] = {"rank_ip": vals["rank_ip"], "rank_port": vals["rank_port"],
                                 **({"agent_name": vals["agent_name"]} if b == "B1" else {})}
            for k, v in vals.items():  # the first registration wins for the topology
                self.info.setdefault(k, v)
        return 200, "OK"

    def get(self, q: dict[str, int]) -> tuple[int, str]:
        b, rel = self.rel.bootstrap, self.rel
        if any(k not in q for k in rel.rank_query):
            return 400, "Missing rank" if b == "B1" else "Missing inputs for bootstrap server."
        vals = [q[k] for k in rel.rank_query]
        with self.lock:
            if b == "B1":
                e = self.entries.get((vals[0],))
                return (200, json.dumps(e)) if e else (404, "Not Found")
            if b in ("B5", "B6") and self.count < self.world:
                return 503, NOT_REGISTERED_503.format(n=self.count)
            if all(v == -1 for v in vals):
                return 200, json.dumps(self._info())
            e = self.entries.get(self._key(vals))
            if e is None:
                if b in ("B5", "B6"):
                    dp, cp, tp, pp = vals
                    return 404, f"Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}"
                return 500, "500 Internal Server Error\n\nServer got itself in trouble"  # uncaught KeyError
            return 200, json.dumps(e)

    def _key(self, vals: list[int]) -> tuple[int, ...]:
        b = self.rel.bootstrap
        if b == "B2":
            return (vals[1], vals[0])  # target_dp_group, engine_rank (the TP rank within the group)
        if b in ("B3", "B4"):
            return (vals[1], vals[0], vals[2])  # dp group, tp rank, pp rank
        return (vals[0], vals[1], vals[2], vals[3])

    def _info(self) -> dict[str, Any]:
        i, b = self.info, self.rel.bootstrap
        if b == "B2":
            return {"prefill_tp_size": i.get("tp_size"), "prefill_dp_size": i.get("dp_size")}
        if b in ("B3", "B4"):
            out = {"prefill_attn_tp_size": i.get("attn_tp_size"), "prefill_dp_size": i.get("attn_dp_size"),
                   "prefill_pp_size": i.get("pp_size")}
            if b == "B4":
                out["prefill_page_size"] = i.get("page_size")
            return out
        out = {k: None for k in self.rel.info_keys}
        out.update(attn_tp_size=i.get("attn_tp_size"), attn_cp_size=i.get("attn_cp_size"),
                   dp_size=i.get("attn_dp_size"), pp_size=i.get("pp_size"), page_size=i.get("page_size"),
                   kv_cache_dtype=i.get("kv_cache_dtype"), follow_bootstrap_room=True)
        if b == "B6":
            out.update(enable_dsa_cache_layer_split=False, decode_allocation_policy="early",
                       enable_kv_cache_sharding=False)
        return out


def put_body(rel: SglangRelease, *, rank: int, tp: int, pp_rank: int, pp: int, ip: str, port: int, page_size: int,
             kv_cache_dtype: str, agent_name: str, dp_rank: int = 0, dp: int = 1) -> dict[str, Any]:
    """What one P rank of `rel` PUTs to /route (docs/sglang-protocol.md §3.2). tp: attention TP (per DP group); with DP
    attention SGLang's tp_size is tp * dp and engine_rank counts across the groups."""
    full = {"role": "Prefill", "rank_ip": ip, "rank_port": port, "engine_rank": dp_rank * tp + rank,
            "agent_name": agent_name, "tp_size": tp * dp, "dp_size": dp, "attn_tp_size": tp, "attn_tp_rank": rank,
            "attn_dp_size": dp, "attn_dp_rank": dp_rank, "attn_cp_size": 1, "attn_cp_rank": 0, "pp_size": pp, "pp_rank": pp_rank,
            "system_dp_size": 1, "system_dp_rank": 0, "page_size": page_size, "kv_cache_dtype": kv_cache_dtype,
            "load_balance_method": "follow_bootstrap_room", "kv_layout": None, "dsv41_spec_layout": None,
            "enable_dsa_cache_layer_split": False, "enable_kv_cache_sharding": False, "prefill_http_port": None,
            "decode_allocation_policy": "early"}
    return {k: full[k] for k in rel.put_keys}


# ----------------------------------------------------------------------------------------- the real server
class _Handler(BaseHTTPRequestHandler):
    table: Table

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass

    def _answer(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json" if text.startswith("{") else "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        url = urlsplit(self.path)
        if url.path == "/health" and self.table.rel.bootstrap not in ("B1", "B2"):
            return self._answer(200, "OK")
        if url.path != "/route":
            return self._answer(404, "Not Found")
        try:
            q = {k: int(v) for k, v in parse_qsl(url.query)}
        except ValueError:
            return self._answer(500, "500 Internal Server Error\n\nServer got itself in trouble")
        self._answer(*self.table.get(q))

    def do_PUT(self) -> None:  # noqa: N802
        n = int(self.headers.get("Content-Length") or 0)
        if urlsplit(self.path).path != "/route" or n > MAX_BODY:
            return self._answer(404 if n <= MAX_BODY else 413, "Not Found" if n <= MAX_BODY else "Too large")
        try:
            body = json.loads(self.rfile.read(n))
        except ValueError:
            return self._answer(500, "500 Internal Server Error\n\nServer got itself in trouble")
        self._answer(*self.table.put(body if isinstance(body, dict) else {}))


class _Quiet(ThreadingHTTPServer):
    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that hung up before its answer (a rank ended or timed out mid-GET) is not the server's
        error: no traceback on stderr; anything else still prints."""
        import sys

        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class Server:
    """P's bootstrap server on loopback at a port the OS picks, in a thread of the parent (SGLang runs it in
    P's tokenizer-manager process, one per P server)."""

    def __init__(self, table: Table, host: str = "127.0.0.1", port: int = 0) -> None:
        handler = type("Handler", (_Handler,), {"table": table})
        self.httpd = _Quiet((host, port), handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def http_get(host: str, port: int, timeout_s: float = 5.0, deadline: float | None = None) -> Get:
    """A D rank's GET /route (SGLang uses requests), answering (status, body): one bounded exchange each
    (pdcheck.netio: lookup, connect, headers and body within timeout_s, and before `deadline` when given).
    No connection is status 0 and the reason, as requests names it (D retries it); a peer that does not
    speak HTTP, answers too slowly or too much raises netio.PeerError (exit 3)."""
    from urllib.parse import urlencode

    base = f"http://{_bracket(host)}:{port}/route"

    def get(q: dict[str, int]) -> tuple[int, str]:
        try:
            st, body = netio.http_exchange(f"{base}?{urlencode(q)}", timeout_s, MAX_BODY, deadline=deadline)
        except netio.Unreachable as e:
            return 0, f"ConnectionError: {e}"
        except netio.PeerError as e:
            raise type(e)(f"the bootstrap server {host}:{port}: {e}") from None
        return st, body.decode(errors="replace")

    return get


def http_put(host: str, port: int, body: dict[str, Any], timeout_s: float = 5.0) -> tuple[int, str]:
    """A P rank's PUT /route; (0, reason) when the exchange fails."""
    try:
        st, text = netio.http_exchange(f"http://{_bracket(host)}:{port}/route", timeout_s, MAX_BODY, method="PUT",
                                       body=json.dumps(body).encode())
    except netio.PeerError as e:
        return 0, f"{type(e).__name__}: {e}"
    return st, text.decode(errors="replace")


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host


# ------------------------------------------------------------------------------------------ D's discovery
class Found:
    """Where D's target P ranks listen, what P advertised, and how many responses D waits for."""

    def __init__(self, targets: list[tuple[int, str, int]], info: dict[str, Any], required: int,
                 warning: str | None) -> None:
        self.targets, self.info, self.required, self.warning = targets, info, required, warning


class RankEntry(msgspec.Struct):
    """What D reads of one P rank's GET /route answer."""

    rank_ip: bounds.PeerStr
    rank_port: bounds.PeerPort


class ServerInfo(msgspec.Struct):
    """What D of B5+ reads of the parallel-info answer (PrefillServerInfo), bounded before it sizes anything."""

    attn_tp_size: bounds.PeerTp
    pp_size: bounds.PeerPp
    page_size: bounds.PeerPageSize | None = None
    kv_cache_dtype: bounds.PeerStr | None = None
    dp_size: bounds.PeerDp | None = None


_WholeTp = Annotated[int, msgspec.Meta(ge=1, le=bounds.HARD_MAX_TP * (bounds.MAX_DP_RANK + 1))]


class ParallelInfo(msgspec.Struct):
    """B2-B4's parallel info after the release's own int() of each value (prefill_tp_size: B2's whole TP,
    attention TP times DP)."""

    prefill_tp_size: _WholeTp | None = None
    prefill_attn_tp_size: bounds.PeerTp | None = None
    prefill_pp_size: bounds.PeerPp | None = None
    prefill_page_size: bounds.PeerPageSize | None = None
    prefill_dp_size: bounds.PeerDp | None = None


WHERE = "P's bootstrap server advertises"


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def discover(rel: SglangRelease, get: Get, *, tp_rank: int, tp_size: int, pp_size: int, page_size: int,
             kv_cache_dtype: str, mla: bool, addr: str = "127.0.0.1:8998", room: int = 0) -> Found:
    """D of `rel` asks P's bootstrap server where its target P ranks listen, checks what P advertised in the
    release's order, and maps its TP rank onto P's, in the DP group the room implies (room % prefill DP size:
    follow_bootstrap_room). Raises DiscoveryError as the release stops."""
    b = rel.bootstrap
    if b == "B1":
        st, text = get({"engine_rank": tp_rank})
        e = _json(text) if st == 200 else None
        if not isinstance(e, dict):
            # logs "Could not fetch bootstrap info for engine rank: E", then asserts (R1 nixl/conn.py:417)
            raise DiscoveryError("AssertionError", f"assert self.bootstrap_info is not None (Could not fetch "
                                 f"bootstrap info for engine rank: {tp_rank}; HTTP {st} {text[:80]})")
        at = bounds.peer_doc(e, RankEntry, f"{WHERE} for engine rank {tp_rank}")
        return Found([(tp_rank, at.rank_ip, at.rank_port)], e, 1, None)
    q = {k: -1 for k in rel.rank_query}
    st, text = get(q)
    info = _json(text) if st == 200 else None
    if b in ("B5", "B6"):
        if st == 0:
            raise DiscoveryError("retry", f"Error fetching prefill server info from bootstrap: {text[:120]}",
                                 retry=True, info=True)
        if st == 503:
            raise DiscoveryError("retry", f"HTTP {st} {text[:120]}", retry=True, info=True)
        if not isinstance(info, dict):
            raise DiscoveryError("retry", f"Error fetching prefill server info from bootstrap: HTTP {st} {text[:120]}",
                                 retry=True, info=True)
        allowed = set(rel.info_keys)
        unknown = [k for k in info if k not in allowed]
        missing = [k for k in rel.info_required if k not in info]
        if unknown or missing:
            # PrefillServerInfo(**data) raises TypeError; caught, logged, D retries and never proceeds
            why = (f"PrefillServerInfo.__init__() got an unexpected keyword argument {unknown[0]!r}" if unknown else
                   f"PrefillServerInfo.__init__() missing {len(missing)} required positional argument"
                   f"{'s' if len(missing) > 1 else ''}: {', '.join(repr(k) for k in missing)}")
            raise DiscoveryError("TypeError", f"Error fetching prefill server info from bootstrap: {why}", retry=True,
                                 info=True)
        si = bounds.peer_doc(info, ServerInfo, WHERE)
        p_tp, p_pp, p_page, p_dtype = si.attn_tp_size, si.pp_size, si.page_size, si.kv_cache_dtype
        p_dp = si.dp_size or 1
    else:
        keys = {"B2": ("prefill_tp_size",), "B3": ("prefill_attn_tp_size", "prefill_pp_size"),
                "B4": ("prefill_attn_tp_size", "prefill_pp_size", "prefill_page_size")}[b]
        try:
            vals = [int(info[k]) for k in keys] if isinstance(info, dict) else None  # int(None): TypeError
        except (TypeError, KeyError, ValueError) as exc:
            vals, err = None, f"{type(exc).__name__}: {exc}"
        else:
            err = f"HTTP {st} {text[:80]}"
        if vals is None:
            if rel.tag in ("R2", "R3"):
                raise DiscoveryError("TypeError", "cannot unpack non-iterable NoneType object (Error fetching "
                                     f"prefill parallel info from bootstrap: {err})")
            if rel.tag == "R4":  # Failed is lost by max(); bootstrap_infos stays unset
                raise DiscoveryError("AttributeError", "'NixlKVReceiver' object has no attribute 'bootstrap_infos'"
                                     f" (Error fetching prefill parallel info from bootstrap: {err})")
            raise DiscoveryError("Failed", f"Could not fetch prefill parallel info from bootstrap_addr: {addr}")
        pi = bounds.peer_doc({"prefill_dp_size": info.get("prefill_dp_size") if isinstance(info, dict) else None,
                         **dict(zip(keys, vals, strict=True))}, ParallelInfo, WHERE)
        p_dp = pi.prefill_dp_size or 1
        p_tp = vals[0] // p_dp if b == "B2" else vals[0]  # B2 advertises the whole tp_size
        if not 1 <= p_tp <= bounds.HARD_MAX_TP:
            raise netio.PeerError(f"{WHERE}: prefill_tp_size {vals[0]} over prefill_dp_size {p_dp}: "
                                  f"{p_tp} ranks per DP group (1 to {bounds.HARD_MAX_TP})")
        p_pp = vals[1] if len(vals) > 1 else 1
        p_page = vals[2] if len(vals) > 2 else None
        p_dtype = None
    for check in rel.checks:
        p, d = {"page_size": (p_page, page_size), "kv_dtype": (p_dtype, kv_cache_dtype)}[check.id]
        if p is not None and p != d:
            raise DiscoveryError(check.exc, check.text.format(p=p, d=d))
    if rel.pp_assert and pp_size not in (1, p_pp):
        raise DiscoveryError("AssertionError", f"('Decode pp size ({pp_size}) should be equal to prefill pp size "
                             f"({p_pp}) or 1',)")
    warning = None
    if p_tp != tp_size and not mla:
        if rel.hetero_tp == "assert_mla":
            raise DiscoveryError("AssertionError", HETERO_TP_ASSERT)
        if rel.hetero_tp in ("slice", "slice_pp_hang"):
            warning = "Performance is NOT guaranteed when using different TP sizes for non-MLA models. "
    if tp_size >= p_tp:
        ranks, required = [tp_rank // max(1, tp_size // p_tp)], 1
    else:
        ratio = p_tp // tp_size
        ranks = list(range(tp_rank * ratio, tp_rank * ratio + ratio))
        required = ratio if not mla else 1
    pp_ranks = list(range(p_pp)) if (pp_size != p_pp) else [0]
    g = room % max(1, int(p_dp))
    targets = []
    for r in ranks:
        for pp in pp_ranks:
            q = dict(zip(rel.rank_query, [r, g, pp] if b in ("B2", "B3", "B4") else [g, 0, r, pp], strict=False))
            st, text = get(q)
            e = _json(text) if st == 200 else None
            if not isinstance(e, dict):
                if b in ("B5", "B6"):
                    raise DiscoveryError("retry", f"Could not fetch bootstrap info for: prefill_dp_rank: {g} "
                                         f"target_tp_rank: {r} target_pp_rank: {pp} (HTTP {st} {text[:80]})",
                                         retry=st == 503)
                raise DiscoveryError("AssertionError", f"assert len(self.bootstrap_infos) > 0 (HTTP {st} from "
                                     f"GET /route for P rank {r})")
            at = bounds.peer_doc(e, RankEntry, f"{WHERE} for P rank {r} (pp {pp})")
            targets.append((r, at.rank_ip, at.rank_port))
    return Found(targets, info if isinstance(info, dict) else {}, required, warning)


def vet(get: Get, d_releases: list[SglangRelease], side: Any, addr: str) -> None:
    """Run each decode release's discovery for every D rank of `side` against a live bootstrap server (GETs
    only), before any rank starts: netio.PeerError (exit 3, one line) for an answer out of bounds. What the
    release itself would do with the answers (DiscoveryError) is left to the ranks to show."""
    for rel in d_releases:
        for r in range(side.tp_size):
            try:
                discover(rel, get, tp_rank=r, tp_size=side.tp_size, pp_size=side.pp_size, page_size=side.page_size,
                         kv_cache_dtype=side.kv_cache_dtype, mla=side.mla, addr=addr)
            except DiscoveryError:
                pass
