"""The typed plan of one SGLang run, built once by the command layer: releases resolved, the P/D release pair
per run, the seeded requests (room, P pages, D pages) and the run options."""

from __future__ import annotations

import msgspec
import numpy as np

from pdcheck.errors import BadInput, HarnessError
from pdcheck.sglang.engine import d_pages_for
from pdcheck.sglang.ranks import SgReq
from pdcheck.sglang.releases import resolve, resolve_many
from pdcheck.sglang.releases.base import SglangRelease
from pdcheck.sglang.scenario import SgScenario


class SgOptions(msgspec.Struct, frozen=True):
    hang_timeout_s: float = 3.0  # pdcheck's stand-in for SGLang's 300 s (or forever)
    start_timeout_s: float = 60.0
    run_timeout_s: float = 120.0


class Pair(msgspec.Struct, frozen=True):
    """One run: the release named, what P runs and what D runs (a side's own `sglang` key wins)."""

    name: str
    p: SglangRelease
    d: SglangRelease


class LiveBootstrap(msgspec.Struct, frozen=True):
    """--prefill-endpoint: a live SGLang prefill's bootstrap server; no fake P is started."""

    host: str
    port: int


class SgPlan(msgspec.Struct, frozen=True):
    scenario: SgScenario
    pairs: list[Pair]
    requests: list[SgReq]
    options: SgOptions
    live: LiveBootstrap | None = None

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pairs]


def make_requests(sc: SgScenario) -> list[SgReq]:
    """Seeded page tables; no page is used by two requests on either side (each room owns its pages)."""
    rng = np.random.default_rng(sc.transfer.seed)
    n = sc.transfer.requests
    k = max(1, min(sc.transfer.pages_per_request, sc.prefill.num_pages // n, sc.decode.num_pages // n))
    # D allocates the same tokens by its own page size (engine.d_pages_for): fewer pages when its page is larger
    kd = max(1, min(d_pages_for(sc.prefill.side(), sc.decode.side(), k), sc.decode.num_pages // n))
    p = rng.choice(sc.prefill.num_pages, n * k, replace=False).tolist()
    d = rng.choice(sc.decode.num_pages, n * kd, replace=False).tolist()
    # duplicate_room: the second request reuses the first one's room (a client-supplied bootstrap_room, #40125)
    dup = sc.transfer.fault == "duplicate_room"
    return [SgReq(1000 + (0 if dup and i == 1 else i), sorted(p[i * k:(i + 1) * k]), sorted(d[i * kd:(i + 1) * kd]),
                  i) for i in range(n)]


def build(sc: SgScenario, sglang: str | None, options: SgOptions, live: LiveBootstrap | None = None) -> SgPlan:
    """BadInput for anything wrong; releases are resolved here, once. With a live P, D asks for the same page
    ids P serves from (pdcheck serve --sglang), so its pages can be checked by coordinate."""
    rels = resolve_many(sglang) if sglang is not None else resolve_many(",".join(sc.sglang), f"{sc.source}: sglang")
    p_own = resolve(sc.prefill.sglang, f"{sc.source}: prefill.sglang") if sc.prefill.sglang else None
    if live is not None and p_own is None:
        # The live P's era, from which query form its bootstrap server answers (GETs only: read-only).
        from pdcheck.sglang import bootstrap as bs
        from pdcheck.sglang.probe import recognise

        p_own = recognise(bs.http_get(live.host, live.port, options.hang_timeout_s))[0]
        if p_own is None:
            raise HarnessError(f"--prefill-endpoint: no SGLang bootstrap server answers at "
                               f"http://{live.host}:{live.port}/route")
    d_own = resolve(sc.decode.sglang, f"{sc.source}: decode.sglang") if sc.decode.sglang else None
    pairs = [Pair(r.name, p_own or r, d_own or r) for r in rels]
    if live is not None:  # what the live P advertises is bounded here, before a D rank sizes anything by it
        from pdcheck.netio import deadline_in
        from pdcheck.sglang import bootstrap as bs

        get = bs.http_get(live.host, live.port, options.hang_timeout_s, deadline_in(options.hang_timeout_s))
        bs.vet(get, [pr.d for pr in pairs], sc.decode.side(), f"{live.host}:{live.port}")  # within one hang timeout
    for pair in pairs:
        if sc.prefill.dp_size > 1 and pair.p.bootstrap == "B1":
            raise BadInput(f"{sc.source}: prefill.dp_size: SGLang {pair.p.name} has no DP mapping (PR #5681, 0.4.7)")
    reqs = make_requests(sc)
    if live is not None:
        reqs = [SgReq(r.room, list(r.d_pages), list(r.d_pages), r.slot) for r in reqs]
    return SgPlan(sc, pairs, reqs, options, live)
