"""What runners return and the report renders: typed results, importable by both sides without a cycle
(runners -> results <- report)."""

from __future__ import annotations

import msgspec

from pdcheck.vllm import messages as vm
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.scenario import Scenario

ProbeStatus = str  # "ok" | "wrong_era" | "garbled" | "no_reply"


class Timings(msgspec.Struct):
    start_s: float  # launching every rank until all are registered and listening
    run_s: float  # handshakes and transfers
    total_s: float
    setup_ms: dict[str, float] = {}


class ProbeRank(msgspec.Struct, kw_only=True):
    """One P rank as its side channel answered a read-only probe (pdcheck.vllm.probe)."""

    tp_rank: int
    port: int
    status: ProbeStatus
    message: str | None = None  # why a reply was refused, as the release would raise it
    reply_ms: float | None = None
    frames: int | None = None
    reply_bytes: int | None = None
    era_seen: str | None = None  # the era the reply looks like (tolerant decode), when it is not the expected one
    engine_id: str | None = None
    agent_name: str | None = None
    num_blocks: int | None = None
    block_len: int | None = None
    block_lens: list[int] | None = None
    block_size: int | None = None
    layout: str | None = None
    device_id: int | None = None
    tp_size: int | None = None
    attn_backend: str | None = None
    regions: int | None = None
    compat_hash: str | None = None
    compat_hash_expected: str | None = None  # what a D of this release with the decode configuration computes
    hash_match: bool | None = None
    out_of_bounds: str | None = None  # the advertised field out of bounds, or "reply" over the caps (garbled)
    # P with pipeline stages (probe --prefill-pp): the stage whose metadata answered, asked by number from era H,
    # before it the one the release's listener serves for a TP rank (releases.shapes); None: one stage
    pp_rank: int | None = None
    layers: list[str] | None = None  # the layer names the metadata carries (0.30+ region names), in order


class Live(msgspec.Struct):
    """--prefill-endpoint: what the live P was found to be, and what could be checked."""

    endpoint: str
    prefill_release: str
    prefill_wire: str
    probe: list[ProbeRank]
    skipped: dict[str, str]  # release -> why it was not run against the live P
    content: str  # whether READ blocks could be verified
    notes: list[str] = []


class RunResult(msgspec.Struct, frozen=True):
    """One handshake run as the ranks delivered it (pdcheck.vllm.report.build turns it into the Report)."""

    scenario: Scenario  # as run: with a live P, its probed [prefill]
    releases: list[ReleaseModel]  # the releases run (a live P: those its listener survives)
    device: str
    requests: list[vm.Req]
    decode: dict[int, vm.DecodeResult]  # D rank -> what it reported
    prefill: dict[int, vm.PrefillFinal]  # P rank -> its final message (none with a live P)
    harness: list[str]  # harness errors, in the order seen
    timings: Timings
    nodes: dict[str, str]  # rank label ('P rank 0') -> where it ran
    live: Live | None = None
