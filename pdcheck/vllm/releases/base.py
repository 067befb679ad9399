"""What a release model is: data (wire era, handshake flow, timeouts) plus an ordered list of steps.

A step is either a Check (an assert or raise exactly as the release's source has it) or an Action (a
state change such as recording num_blocks, or a real NIXL call routed through the HandshakeIO).
The engine (pdcheck.vllm.engine) walks these in order and stops where the release stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

from pdcheck.geometry import Geometry
from pdcheck.kvsplit import topology_replicated
from pdcheck.releaseline import version_tuple
from pdcheck.vllm.wire import AnyMeta

if TYPE_CHECKING:
    from pdcheck.vllm.wire import WireFormat


@dataclass(frozen=True)
class Local:
    """The D worker's own facts, as its connector sees them after register_kv_caches."""

    engine_id: str
    tp_rank: int
    tp_size: int
    num_blocks: int
    geometry: Geometry
    kv_cache_layout: str
    device_id: int
    model: str = "pdcheck/fake-model"
    pp_size: int = 1  # the D engine's pipeline parallel stages (decode-side PP: refused from 0.26)
    # The layout the D's bytes really have when its attention backend ignores the connector's (vLLM #46204);
    # None: kv_cache_layout. No release sees it: only the corrected model checks it.
    memory_layout: str | None = None
    permute_local_kv: bool = False  # kv_transfer_config enable_permute_local_kv (0.11.1+)

    @property
    def block_len(self) -> int:
        return self.geometry.block_len

    @property
    def block_size(self) -> int:
        return self.geometry.block_size

    @property
    def use_mla(self) -> bool:
        return self.geometry.use_mla

    @property
    def backend_name(self) -> str:
        return self.geometry.attn_backend


@dataclass
class Prepared:
    """One remote descriptor list, as the release prepared it (dlist of one P rank)."""

    p_rank: int
    agent: str
    dlist_blocks: int  # blocks per region in the dlist: the remote rank's own advertised count
    block_len: int  # bytes read per block (local block_len: the D rank's head slice)
    remote_block_len: int  # bytes of a whole P block
    rank_offset: int  # byte offset of the D slice inside a P block
    local_offset: int = 0  # byte offset inside the local block (P TP > D TP: one chunk per P rank)
    device_id: int = 0  # device id used in the remote descriptors
    base_addrs: list[int] = field(default_factory=list)
    # 2: each region's blocks are read as a K half and a V half (FlashAttention blocks-first, 0.23 - 0.25), the
    # V half at remote_block_len // 2 (remote) and the local block_len // 2 (local); block_len is one half's read.
    halves: int = 1
    # bytes between two remote blocks' starts, as the release reads block_strides (0.30+: dense virtual pages of a
    # compressed MLA cache); 0: remote_block_len, blocks abut
    remote_stride: int = 0
    # D's block is sub_blocks of P's (block_size_ratio, P block_size < D's): each local block is read as that many
    # sub-blocks of block_len // sub_blocks, sub-block i from the request's P block j * sub_blocks + i
    # (get_mapped_blocks); the release then rearranges the tokens in place (a correct permutation, not modelled).
    sub_blocks: int = 1
    # enable_permute_local_kv took effect: P's heads-first bytes are read and permuted into D's layout on receive
    permuted: bool = False


@dataclass
class State:
    """The D worker's per-engine dictionaries (seeded with its own entries, as vLLM does)."""

    tp_size: dict[str, int] = field(default_factory=dict)
    dst_num_blocks: dict[str, int] = field(default_factory=dict)
    remote_agents: dict[str, dict[int, str]] = field(default_factory=dict)
    prepared: dict[int, Prepared] = field(default_factory=dict)
    contacted: list[int] = field(default_factory=list)
    contacted_stages: list[int] = field(default_factory=list)  # the pipeline stage asked of each contacted rank
    dst_pairs: dict[str, object] = field(default_factory=dict)  # 0.34: how each engine's regions pair with ours

    @classmethod
    def for_local(cls, local: Local) -> State:
        return cls(tp_size={local.engine_id: local.tp_size}, dst_num_blocks={local.engine_id: local.num_blocks})


class HandshakeIO(Protocol):
    """The side effects a handshake needs. Real ranks use ZMQ and NIXL; unit tests use bytes in memory."""

    def fetch(self, fmt: WireFormat, p_rank: int, timeout_ms: int | None, pp_rank: int = 0) -> list[bytes]: ...

    def add_remote_agent(self, blob: bytes) -> str: ...

    def prep_remote(self, prepared: Prepared, mem_type: str) -> None: ...


@dataclass
class Ctx:
    """Everything a check may look at: the vLLM names are kept so the expressions read the same."""

    local: Local
    meta: AnyMeta
    remote_tp_rank: int
    remote_tp_size: int  # from metadata (0.9.1) or kv_transfer_params (0.9.2+)
    expected_engine_id: str
    state: State
    io: HandshakeIO
    bypass_asserts: bool = False
    scratch: dict[str, object] = field(default_factory=dict)

    @property
    def engine_id(self) -> str:
        return self.meta.engine_id

    @property
    def tp_ratio(self) -> int:
        # Python's // semantics, ZeroDivisionError included: the engine reports it as the release would.
        return self.state.tp_size[self.local.engine_id] // self.state.tp_size[self.engine_id]

    @property
    def is_kv_replicated(self) -> bool:
        """KVTopology.is_kv_replicated (0.9.2 - 0.19): `remote_tp_size // total_num_kv_heads >= 1`."""
        return topology_replicated(self.state.tp_size[self.engine_id], self.local.geometry.total_kv_heads,
                                   strict=False)

    def remote_block_len(self) -> int:
        if self.meta.block_len is not None:
            return self.meta.block_len
        if self.meta.block_lens:
            return self.meta.block_lens[0]
        # Era A (0.9.0) advertises no block length: 0.9.0 builds remote descriptors with its own block_len.
        return self.local.block_len


Rule = Callable[[Ctx], bool]
Text = str | Callable[[Ctx], str] | None


def always(_: Ctx) -> bool:
    return True


@dataclass(frozen=True)
class Check:
    id: str
    expr: str  # the condition exactly as the release's source writes it, without `assert`
    ok: Rule
    message: Text = None  # None: a bare assert
    exc: str = "AssertionError"
    when: Rule = always
    hazard: str | None = None
    # What the check counts as replicated KV, where `when` asks it: "mla" (MLA only, 0.9.0 - 0.9.1), "loose"
    # (`remote_tp_size // total_num_kv_heads >= 1`, 0.9.2 - 0.19), "strict" (`remote_tp_size > heads`, 0.20+);
    # skips_mla: the check is not made for MLA. rules.replication reads them for the hazards.
    replication: Literal["mla", "loose", "strict"] | None = None
    skips_mla: bool = False

    def render(self, ctx: Ctx) -> str | None:
        return self.message(ctx) if callable(self.message) else self.message


@dataclass(frozen=True)
class Action:
    id: str
    run: Callable[[Ctx], None]


Step = Check | Action
# same_rank: 0.9.0; rank0_then_target: 0.9.1; target_only: 0.9.2-0.13; all_targets: 0.14+ (P TP > D TP makes
# one D rank handshake |tp_ratio| P ranks in a row, on one REQ socket); corrected: pdcheck's fixed model.
Flow = Literal["same_rank", "rank0_then_target", "target_only", "all_targets", "corrected"]


@dataclass(frozen=True)
class ReleaseModel:
    name: str  # what the user types / what reports show, e.g. "0.9.1"
    versions: tuple[str, ...]  # releases of this line
    wire: str  # key into pdcheck.vllm.wire.FORMATS
    flow: Flow
    tp_size_from: Literal["metadata", "params"]
    recv_timeout_ms: int | None  # None: a blocking recv(); a dead P hangs the handshake
    pre_add: tuple[Step, ...]  # after decode (and the hash check), before add_remote_agent
    add_remote: tuple[Step, ...]  # the body of add_remote_agent, in source order
    notif: str = "{req}:{tp_ratio}"
    tolerant_decode: bool = False
    summary: str = ""
    pre_flow: tuple[Step, ...] = ()  # before any request (e.g. 0.14's tp_ratio divisibility); ctx.meta is empty
    version: str = ""  # the exact release modelled (resolve() fills it in); hashed as vllm_version in G/H
    connector_version: int | None = None  # NIXL_CONNECTOR_VERSION (G/H)
    hash_factors: tuple[str, ...] = ()  # compatibility-hash factor keys (G/H); empty: no hash on the wire
    # The is_hma_enabled factor a GPU deployment with NixlConnector hashes (0.18+) when no HMA flag is given: `not
    # disable_hybrid_kv_cache_manager`, which 0.18 - 0.21 set (False) for any --kv-transfer-config and 0.22+ leave
    # unset (True: NixlConnector is SupportsHMA, CUDA supports the hybrid manager). hybrid.hma_enabled applies flags.
    is_hma_enabled: bool = False
    # How FlashAttention lays out and registers KV (geometry.KVRegions): "split" K and V regions up to 0.22,
    # "blocks_first" [num_blocks, 2, ...] from 0.23, "packed" [num_blocks, heads, block_size, 2 * head_dim] from 0.26.
    fa_kv_regions: str = "split"
    # The engine core names each DP rank's engine `<engine_id>_dp<N>` when dp_size > 1 (v1/engine/core.py, from
    # 0.9.1); 0.9.0's keeps the configured id for every DP rank (ports.dp_engine_id).
    dp_engine_suffix: bool = True

    @property
    def number(self) -> tuple[int, int, int]:
        """(major, minor, patch) of the release modelled (releaseline.version_tuple); corrected after all."""
        return version_tuple(self.version or (self.versions[0] if self.versions else self.name))
