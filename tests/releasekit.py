"""Shared fixtures for the pure release-model tests: an instance side and an in-memory HandshakeIO."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdcheck.geometry import Geometry
from pdcheck.vllm.engine import FetchTimeout, Handshaker, Outcome, Params, run
from pdcheck.vllm.releases import compat_hash_for
from pdcheck.vllm.releases.base import Ctx, Local, Prepared, ReleaseModel, State
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireFormat, encode_reply


# ---- fixtures ------------------------------------------------------------------------------------------------
@dataclass
class Side:
    engine_id: str
    tp: int
    blocks: list[int]
    kv_heads: int = 8
    head_dim: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"
    backend: str = "FLASH_ATTN"
    mla: bool = False
    layout: str = "HND"
    layers: int = 1
    model: str = "pdcheck/fake-model"
    groups: tuple[Any, ...] = ()  # hybrid models: geometry.KVGroup per group

    @property
    def geometry(self) -> Geometry:
        return Geometry(tp_size=self.tp, block_size=self.block_size, layers=self.layers, total_kv_heads=self.kv_heads,
                        head_dim=self.head_dim, dtype=self.dtype, attn_backend=self.backend, use_mla=self.mla,
                        groups=self.groups)


def side(engine_id: str, tp: int, blocks: int | list[int], **kw: Any) -> Side:
    counts = blocks if isinstance(blocks, list) else [blocks] * tp
    assert len(counts) == tp
    return Side(engine_id, tp, counts, **kw)


@dataclass
class MemIO:
    """The P instance as D's handshake sees it: metadata per rank, NIXL calls recorded, no sockets."""

    p: Side
    compat: str | None = None  # the compatibility hash P sends (G/H)
    override: dict[int, dict[str, Any]] = field(default_factory=dict)
    mute: set[int] = field(default_factory=set)
    wire: str | None = None  # P speaks this era instead of the one D expects
    one_frame: bool = False  # P replies with the payload frame only
    asked: list[int] = field(default_factory=list)
    added: list[bytes] = field(default_factory=list)
    prepared: list[Prepared] = field(default_factory=list)

    def values(self, p_rank: int) -> dict[str, Any]:
        g = self.p.geometry
        vals: dict[str, Any] = dict(
            engine_id=self.p.engine_id, agent_metadata=f"{self.p.engine_id}/{p_rank}".encode(),
            kv_caches_base_addr=[(p_rank + 1) << 32 | reg << 24 for reg in range(g.num_regions)],
            num_blocks=self.p.blocks[p_rank], tp_size=self.p.tp, block_len=g.block_len,
            block_lens=[g.block_len] * g.num_regions, block_strides=[g.block_len] * g.num_regions,
            attn_backend_name=g.attn_backend, kv_cache_layout=self.p.layout, device_id=p_rank,
            block_size=self.p.block_size, ssm_sizes=(0, 0), physical_blocks_per_logical_kv_block=1,
            region_names=g.region_layers(), region_members=[[n] for n in g.region_layers()],
        )
        vals.update(self.override.get(p_rank, {}))
        return vals

    def fetch(self, fmt: WireFormat, p_rank: int, timeout_ms: int | None) -> list[bytes]:
        self.asked.append(p_rank)
        if p_rank in self.mute or p_rank >= self.p.tp:
            raise FetchTimeout(f"P rank {p_rank}")
        frames = encode_reply(FORMATS[self.wire] if self.wire else fmt, self.values(p_rank), self.compat)
        return frames[:1] if self.one_frame else frames

    def add_remote_agent(self, blob: bytes) -> str:
        self.added.append(blob)
        return blob.decode()

    def prep_remote(self, prepared: Prepared, mem_type: str) -> None:
        self.prepared.append(prepared)


def local(d: Side, r: int) -> Local:
    return Local(d.engine_id, r, d.tp, d.blocks[r], d.geometry, d.layout, r, model=d.model)


def mem_io(rel: ReleaseModel, p: Side, *, p_rel: ReleaseModel | None = None, **kw: Any) -> MemIO:
    """P answers as an instance of p_rel (default: the same release as D) would, hash included."""
    return MemIO(p, compat=compat_hash_for(p_rel or rel, p.geometry, p.model), **kw)


def params(rel: ReleaseModel, p: Side, d: Side | None = None, *, tp: int | None = None,
           expected: str | None = None, p_wire: str | None = None, enforce: bool = True) -> Params:
    """What D knows before the handshake; the local compatibility hash (G/H) needs D's side."""
    wire = p_wire or (rel.wire if rel.wire != "any" else "C")  # corrected reads whatever P speaks
    local_hash = compat_hash_for(rel, d.geometry, d.model) if d is not None else None
    return Params(expected or p.engine_id, p.tp if tp is None else tp, wire, local_hash=local_hash,
                  enforce_hash=enforce)


def run_rank(rel: ReleaseModel, p: Side, d: Side, r: int, *, io: MemIO | None = None, bypass: bool = False,
             **kw: Any) -> Outcome:
    return run(rel, local(d, r), params(rel, p, d, **kw), io or mem_io(rel, p), bypass_asserts=bypass)


def run_all(rel: ReleaseModel, p: Side, d: Side, **kw: Any) -> list[Outcome]:
    return [run_rank(rel, p, d, r, **kw) for r in range(d.tp)]


def handshaker(rel: ReleaseModel, p: Side, d: Side, r: int, io: MemIO | None = None) -> Handshaker:
    return Handshaker(rel, local(d, r), params(rel, p, d), io or mem_io(rel, p))


def statuses(outs: list[Outcome]) -> list[str]:
    return [o.status for o in outs]


def assert_bare(o: Outcome, check: str | None, expr: str, *, hazard: str | None = None) -> None:
    assert (o.status, o.exception, o.check, o.assert_expr, o.message) == ("assert", "AssertionError", check, expr, None)
    if hazard is not None:
        assert o.hazard == hazard


def assert_msg(o: Outcome, check: str, expr: str, message: str, *, hazard: str | None = None) -> None:
    assert (o.status, o.exception, o.check, o.assert_expr, o.message) == (
        "assert", "AssertionError", check, expr, message)
    if hazard is not None:
        assert o.hazard == hazard


def assert_raise(o: Outcome, check: str | None, message: str, exc: str = "RuntimeError") -> None:
    assert (o.status, o.exception, o.check, o.assert_expr, o.message) == ("error", exc, check, None, message)


def ctx_for(d: Side, r: int, p: Side, p_rank: int, **meta: Any) -> Ctx:
    """A Ctx as add_remote_agent sees it after the tp_size bookkeeping, for checking one step directly."""
    values = MemIO(p).values(p_rank)
    values.update(meta)
    m = AnyMeta(**{k: values[k] for k in AnyMeta.__struct_fields__ if k in values})
    state = State.for_local(local(d, r))
    state.tp_size[p.engine_id] = p.tp
    return Ctx(local=local(d, r), meta=m, remote_tp_rank=p_rank, remote_tp_size=p.tp,
               expected_engine_id=p.engine_id, state=state, io=MemIO(p))


def step(rel: ReleaseModel, step_id: str) -> Any:
    found = [s for s in (*rel.pre_flow, *rel.pre_add, *rel.add_remote) if s.id == step_id]
    assert len(found) == 1, f"{rel.name} has no single step {step_id}"
    return found[0]


def ids(rel: ReleaseModel) -> list[str]:
    return [s.id for s in (*rel.pre_flow, *rel.pre_add, *rel.add_remote)]
