"""Runs one release model's handshake flow for one D rank, in the release's order, stopping where it stops.

Pure logic: the network and NIXL are behind HandshakeIO, so the same code runs inside a real rank process
and in unit tests. The result is an Outcome: ok / assert / silent / error / hang, with the exact check.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdcheck.errors import FetchRefused, FetchTimeout, NixlCallError
from pdcheck.kvsplit import corrected_reads, release_targets
from pdcheck.verdict import Status
from pdcheck.vllm import messages as vm
from pdcheck.vllm.releases import hybrid, shapes
from pdcheck.vllm.releases.base import Action, Check, Ctx, HandshakeIO, Local, Prepared, ReleaseModel, State
from pdcheck.vllm.releases.rules import already_added
from pdcheck.vllm.wire import FORMATS, AnyMeta, WireError, WireFormat, strict_decode, tolerant_decode

StatusT = Status


@dataclass(frozen=True)
class Params:
    """What D knows about the remote before any handshake (kv_transfer_params and config)."""

    remote_engine_id: str
    tp_size: int  # kv_transfer_params.get("tp_size", 1)
    p_wire: str  # the wire era P speaks (corrected D reads whatever P speaks)
    local_hash: str | None = None
    enforce_hash: bool = True
    pp_size: int = 1  # P's pipeline stages (what it serves; kv_transfer_params name them from 0.29, shapes)


class Outcome(vm.Verdict):
    """The Verdict the D rank reports (Outcome.verdict()), plus what the transfer proof needs in-process."""

    prepared: list[Prepared] = []
    local_num_blocks: int = 0
    findings: list[str] = []

    def verdict(self) -> vm.Verdict:
        """The verdict alone, every Verdict field as the engine set it; the in-process state stays here."""
        return vm.Verdict(**{f: getattr(self, f) for f in vm.Verdict.__struct_fields__})


class _Stop(Exception):
    def __init__(self, status: StatusT, exception: str | None, message: str | None, *, check: Check | None = None,
                 expr: str | None = None) -> None:
        super().__init__(message)
        self.status, self.exception, self.message = status, exception, message
        self.check, self.expr = check, expr


def _run_steps(steps: tuple[Check | Action, ...], ctx: Ctx) -> None:
    for step in steps:
        if isinstance(step, Action):
            step.run(ctx)
            continue
        if not step.when(ctx):
            continue
        if ctx.bypass_asserts and step.exc == "AssertionError":
            continue  # python -O strips assert statements, raises stay
        if not step.ok(ctx):
            status: StatusT = "assert" if step.exc == "AssertionError" else "error"
            raise _Stop(status, step.exc, step.render(ctx), check=step, expr=step.expr)


class Handshaker:
    def __init__(self, release: ReleaseModel, local: Local, params: Params, io: HandshakeIO,
                 *, bypass_asserts: bool = False, hang_timeout_ms: int = 5000) -> None:
        self.release, self.local, self.params, self.io = release, local, params, io
        self.bypass = bypass_asserts
        self.hang_timeout_ms = hang_timeout_ms
        self.state = State.for_local(local)
        self.n = 0
        self.last_engine: str | None = None

    @property
    def fmt(self) -> WireFormat:
        return FORMATS[self.params.p_wire if self.release.tolerant_decode else self.release.wire]

    def _fetch(self, p_rank: int, stage: int, timeout: int) -> list[bytes]:
        self.n += 1
        self.state.contacted.append(p_rank)
        if self.params.pp_size > 1:  # before era H the request names no stage: P's listener picks the one
            self.state.contacted_stages.append(shapes.answered_stage(self.fmt.name, stage, self.params.pp_size))
        if stage == 0:
            return self.io.fetch(self.fmt, p_rank, timeout)
        return self.io.fetch(self.fmt, p_rank, timeout, pp_rank=stage)

    def _decode(self, frames: list[bytes]) -> AnyMeta:
        if self.release.tolerant_decode:
            return tolerant_decode(frames).meta
        meta, _ = strict_decode(self.fmt, frames, self.params.local_hash, self.params.enforce_hash)
        return meta

    def handshake(self, p_rank: int, remote_tp_size: int | None, stage: int = 0) -> Ctx:
        timeout = self.release.recv_timeout_ms or self.hang_timeout_ms
        # The corrected D reads every stage of P's rank and pairs its layers with all of them at once.
        stages = range(self.params.pp_size) if self.release.flow == "corrected" else (stage,)
        try:
            metas = [self._decode(self._fetch(p_rank, s, timeout)) for s in stages]
        except FetchTimeout:
            if self.release.recv_timeout_ms is None:
                raise _Stop("hang", None, f"no reply from P rank {p_rank}: this release blocks in recv() with no "
                            f"timeout (reported after pdcheck's {timeout} ms)") from None
            raise _Stop("error", "zmq.error.Again", "Resource temporarily unavailable") from None
        except FetchRefused as exc:
            raise _Stop("error", "pdcheck refused the reply", str(exc)) from None
        except WireError as exc:
            status: StatusT = "assert" if exc.exc_type == "AssertionError" else "error"
            raise _Stop(status, exc.exc_type, exc.message or None, expr=exc.expr) from None
        meta = shapes.merge_stages(metas)
        self.last_engine = meta.engine_id
        tp = remote_tp_size if remote_tp_size is not None else meta.tp_size
        ctx = Ctx(local=self.local, meta=meta, remote_tp_rank=p_rank, remote_tp_size=tp if tp is not None else 1,
                  expected_engine_id=self.params.remote_engine_id, state=self.state, io=self.io,
                  bypass_asserts=self.bypass)
        _run_steps(self.release.pre_add, ctx)
        if already_added(ctx):
            return ctx  # vLLM returns early for a rank it already added
        refused = hybrid.handshake_refusal(self.release, self.local.geometry, meta.block_size)
        if refused and not self.bypass:
            raise _Stop("assert", "AssertionError", refused, expr="block_size_ratio == 1")
        _run_steps(self.release.add_remote, ctx)
        return ctx

    def flow(self) -> None:
        flow, local, params = self.release.flow, self.local, self.params
        refused = hybrid.startup_refusal(self.release, local.geometry)
        if refused:  # the worker never starts: nothing is sent
            exc, _, msg = refused.partition(": ")
            raise _Stop("assert" if exc == "AssertionError" else "error", exc, msg, expr=hybrid.START_UP)
        if self.release.pre_flow:
            # Checks the release makes before sending anything: they see only local facts and params.
            empty = AnyMeta(engine_id=params.remote_engine_id, agent_metadata=b"", kv_caches_base_addr=[], num_blocks=0)
            _run_steps(self.release.pre_flow, Ctx(local=local, meta=empty, remote_tp_rank=-1,
                                                  remote_tp_size=params.tp_size,
                                                  expected_engine_id=params.remote_engine_id, state=self.state,
                                                  io=self.io, bypass_asserts=self.bypass))
        if flow == "rank0_then_target":
            # P's TP size is learnt from rank 0's reply, so the target is known only after that handshake.
            ctx = self.handshake(0, None)
            for p in release_targets(flow, local.tp_rank, self.state.tp_size[local.engine_id],
                                     ctx.meta.tp_size or 1)[1:]:
                self.handshake(p, None)
        elif flow == "corrected":
            # It reads every P stage; a P whose side channel serves one stage per port cannot give it them.
            refused = shapes.stages_unreachable(self.fmt.name, params.pp_size)
            if refused:
                raise _Stop("error", "RuntimeError", refused, expr=shapes.PP_STAGES_CHECK)
            for p in corrected_reads(local.tp_rank, local.tp_size, params.tp_size, local.geometry.total_kv_heads,
                                     local.use_mla):
                self.handshake(p, params.tp_size)
        elif flow in ("same_rank", "target_only", "all_targets"):
            targets = release_targets(flow, local.tp_rank, self.state.tp_size[local.engine_id], params.tp_size)
            # 0.26+: itertools.product(range(remote_pp_size), p_remote_ranks), stage-major (shapes.asked_stages)
            for s in shapes.asked_stages(self.release, params.pp_size):
                for p in targets:
                    self.handshake(p, params.tp_size, s)
        else:  # pragma: no cover - guarded by the registry
            raise ValueError(flow)

    def run(self) -> Outcome:
        out = Outcome(local_num_blocks=self.local.num_blocks)
        try:
            self.flow()
        except _Stop as stop:
            out.status, out.exception, out.message = stop.status, stop.exception, stop.message
            if stop.check is not None:
                out.check, out.hazard = stop.check.id, stop.check.hazard
            out.assert_expr = stop.expr if out.exception == "AssertionError" else None
            if out.exception != "AssertionError" and stop.expr:
                out.check = out.check or stop.expr
            if stop.expr == hybrid.START_UP:  # a start-up refusal: no handshake, no expression to show
                out.check, out.assert_expr = hybrid.START_UP, None
            out.handshake, out.remote_rank = self.n, self.state.contacted[-1] if self.state.contacted else None
        except NixlCallError as exc:
            out.status, out.exception, out.message = "error", exc.status, str(exc)
            out.handshake, out.remote_rank = self.n, self.state.contacted[-1] if self.state.contacted else None
        except (ZeroDivisionError, LookupError, TypeError, ValueError) as exc:
            # What the release's own Python raises on this input (e.g. tp_rank // 0 when P TP > D TP).
            out.status, out.exception, out.message = "error", type(exc).__name__, str(exc)
            out.handshake = self.n or None
            out.remote_rank = self.state.contacted[-1] if self.state.contacted else None
        self._finish(out)
        return out

    def _finish(self, out: Outcome) -> None:
        out.contacted = list(self.state.contacted)
        out.contacted_stages = list(self.state.contacted_stages)
        out.prepared = list(self.state.prepared.values())
        engine = self.last_engine or self.params.remote_engine_id
        if self.release.flow == "corrected":
            out.rank_num_blocks = {p.p_rank: p.dlist_blocks for p in out.prepared}
            if out.prepared:
                out.recorded_num_blocks = out.prepared[0].dlist_blocks
            return
        out.recorded_num_blocks = self.state.dst_num_blocks.get(engine)
        out.stride = out.recorded_num_blocks
        if out.status != "ok":
            return
        if self.last_engine is not None and self.last_engine != self.params.remote_engine_id:
            # Before 0.10.0 nothing compares the engine ids: the handshake passes, state is keyed by the id P
            # sent, and the first _read_blocks looks up the id kv_transfer_params named (H18).
            out.status, out.exception, out.hazard = "error", "KeyError", "H18"
            out.message = (f"{self.params.remote_engine_id!r}: raised by the first _read_blocks "
                           f"(self._tp_size[dst_engine_id]); the side channel answered for {self.last_engine!r}")
            out.prepared = []
            return
        for prep in out.prepared:
            if out.stride is not None and out.stride != prep.dlist_blocks:
                out.status = "silent"
                out.hazard = "H04"
                out.findings.append(
                    f"remote descriptor ids use stride {out.stride} (recorded for engine {engine}) but P rank "
                    f"{prep.p_rank}'s list holds {prep.dlist_blocks} blocks per region: every region after the "
                    "first reads other blocks, and NIXL reports DONE"
                )
        if out.findings:
            out.message = out.findings[0]


def run(release: ReleaseModel, local: Local, params: Params, io: HandshakeIO, *, bypass_asserts: bool = False,
        hang_timeout_ms: int = 5000) -> Outcome:
    return Handshaker(release, local, params, io, bypass_asserts=bypass_asserts,
                      hang_timeout_ms=hang_timeout_ms).run()
