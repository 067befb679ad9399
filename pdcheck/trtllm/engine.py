"""The pure verdict engine: what each gen rank of a line ends with, predicted from the two eras' data and the
scenario alone (no process, no socket). The report puts it beside what the real ranks did (column "model"); a
difference is a bug in one of the two, and `agree` says so. Unit tests run it over every era and fault."""

from __future__ import annotations

import msgspec

from pdcheck.trtllm import checks, wire
from pdcheck.trtllm.eras.base import TrtLine
from pdcheck.trtllm.layout import Side, view_of
from pdcheck.trtllm.maps import REQ
from pdcheck.trtllm.scenario import TrtScenario


class Predicted(msgspec.Struct, frozen=True):
    status: str  # ok | silent | error | hang
    stage: str
    why: str


def _wait(gen: TrtLine, stage: str, why: str) -> Predicted:
    """A wait nothing answers: the era hangs; the corrected gen fails at its deadline."""
    return Predicted("error" if gen.checks == "corrected" else "hang", stage, why)


def predict(ctx: TrtLine, gen: TrtLine, sc: TrtScenario, timeout_ms: int | None = None) -> list[Predicted]:
    c, g = sc.ctx.side(), sc.gen.side()
    return [one(ctx, gen, c, g, sc.request.fault, sc.ctx.agent, sc.gen.agent) for _ in range(g.world)]


def one(ctx: TrtLine, gen: TrtLine, c: Side, g: Side, fault: str, ctx_agent: str = "py",
        gen_agent: str = "py") -> Predicted:
    if gen.runtime == "cpp":
        return _cpp(ctx, gen, c, g, fault)
    if ctx.runtime == "cpp":
        return Predicted("error", "info", "a C++ ctx publishes no info endpoint (T15)")
    if fault == "info_silent":
        return _wait(gen, "info", "REQUEST_INSTANCE_INFO unanswered (T21)")
    cw, gw = wire.ERAS[ctx.wire], wire.ERAS[gen.wire]
    if (cw.info, cw.rank_info) != (gw.info, gw.rank_info) or (ctx.wire == "corrected" and gen.wire != "corrected"):
        return Predicted("error", "info", "the info reply is another era's map (T13)")
    if gen.wire == "corrected" and ctx.wire != "corrected":
        return Predicted("error", "register", "the ctx speaks another wire era: the corrected gate refuses it")
    cv, gv = view_of(c, 0, 0), view_of(g, 0, 0)
    if gen.checks == "corrected":
        reason = checks.corrected_gate(cv, gv, c.dtype, g.dtype)
        if reason is not None:
            return Predicted("error", "register", reason)
    if fault == "unknown_type" and ctx.listener in ("dies", "stops"):
        return _wait(gen, "transfer", "the ctx's listener ended on an unknown message type (T43, T44)")
    if cw.rank_info != gw.rank_info:
        return _wait(gen, "transfer", "the ctx cannot decode the gen's RankInfo (T13)")
    if ctx_agent != gen_agent:
        return _wait(gen, "transfer", "the ctx cannot load the gen's agent descriptor (T41)")
    verdict = checks.on_register(ctx, cv, gv, "", 0)
    if verdict.refused:
        return _wait(gen, "transfer", f"the ctx refuses the registration ({verdict.field}), only logged (T69)")
    if REQ[_req(ctx.wire)] != REQ[_req(gen.wire)]:
        return _wait(gen, "transfer", "the ctx cannot decode the gen's RecvReqInfo (T13)")
    if fault == "ctx_dies":
        return _wait(gen, "transfer", "the ctx died after registering (T65, T66)")
    if fault == "block_id_oob":
        return Predicted("error", "transfer", "a FAILED result: the WRITE's destination is outside the gen's pool")
    if cw.result != gw.result or (ctx.wire in ("W3", "corrected")) != (gen.wire in ("W3", "corrected")):
        return _wait(gen, "transfer", "the gen cannot decode the ctx's result frames (T13)")
    if fault == "completion_lost" and gen.wire != "corrected":
        return _wait(gen, "transfer", "the WRITE landed, its result frame was lost (trtllm#17665)")
    if c.dtype != g.dtype:
        return Predicted("silent", "proof", "equal element sizes, another dtype: nothing compares it (T73)")
    return Predicted("ok", "", "")


def _cpp(ctx: TrtLine, gen: TrtLine, c: Side, g: Side, fault: str) -> Predicted:
    if ctx.runtime != "cpp":
        return Predicted("error", "inquire", "a Python ctx gives a C++ gen no opaque_state (T15)")
    if checks.inquire(checks.cache_state(g), checks.cache_state(c)) is not None:
        return Predicted("error", "inquire", "the gen's inquireSupport refuses (T61, T64)")
    if fault == "ctx_dies":
        return Predicted("hang", "ready", "no ready signal from a dead ctx (T61)")
    if fault == "completion_lost":
        return Predicted("hang", "completion", "the sync notification was lost after the WRITE (trtllm#17665)")
    return Predicted("ok", "", "")


def _req(wire_name: str) -> str:
    return "W3" if wire_name == "corrected" else wire_name
