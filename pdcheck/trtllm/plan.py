"""The typed plan of one TensorRT-LLM run, built once before any process starts: lines resolved (an era or a
release, dated), the ctx/gen line pair per run (a side's own `trtllm` key wins), which lines the scenario's shape
or fault cannot run and why, the request's seeded blocks and the run options."""

from __future__ import annotations

import msgspec
import numpy as np

from pdcheck.errors import BadInput
from pdcheck.releaseline import CORRECTED
from pdcheck.trtllm import eras
from pdcheck.trtllm.eras.base import TrtLine
from pdcheck.trtllm.scenario import TrtScenario

PYTHON_FAULTS = ("info_silent", "unknown_type", "block_id_oob")  # faults of the Python path's frames


class TrtOptions(msgspec.Struct, frozen=True):
    cap_s: float = 30.0  # a line's waits end here even if the ranks never go quiet (a bug, or a live ctx)
    start_timeout_s: float = 60.0
    run_timeout_s: float = 120.0


class Pair(msgspec.Struct, frozen=True):
    """One line of the matrix: what its ctx and its gen run."""

    name: str  # the era as named ("E3", "W1b", "corrected"); a side's own key may pin the other side's
    ctx: str  # line names (pdcheck.trtllm.eras.line)
    gen: str
    attribution: str = ""  # how a typed release became this line ("" for an era name)


class LiveCtx(msgspec.Struct, frozen=True):
    """handshake --prefill-endpoint: a live ctx's info endpoint; no fake ctx starts."""

    endpoint: str
    era: str = "W3"  # the wire era its info reply's shape belongs to


class TrtPlan(msgspec.Struct, frozen=True):
    scenario: TrtScenario
    pairs: list[Pair]  # the corrected line last
    ctx_blocks: list[int]
    gen_blocks: list[int]
    options: TrtOptions
    skipped: list[str] = []  # lines `all` left out for this scenario, with why
    live: LiveCtx | None = None

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pairs if p.name != CORRECTED]


def not_applicable(ctx: TrtLine, gen: TrtLine, sc: TrtScenario) -> str | None:
    """Why this pair cannot run this scenario as modelled (None: it can)."""
    if gen.runtime == "cpp" and ctx.runtime != "cpp":
        return "a C++ gen and a Python ctx: what the C++ gen does with a Python ctx's empty opaque_state is not " \
               "established (T15)"
    if gen.runtime == "cpp":
        c, g = sc.ctx, sc.gen
        if (c.tp_size, c.pp_size, c.layer_num_per_pp) != (g.tp_size, g.pp_size, g.layer_num_per_pp):
            return "the C++ path with different TP or PP: its formatter's split layout was not read (T55)"
        if c.mla or g.mla:
            return "the C++ path with MLA: MLACacheFormatter was not read (T64)"
        if sc.request.fault in PYTHON_FAULTS:
            return f"fault {sc.request.fault} is one of the Python path's frames"
        if sc.ctx.agent != "py" or sc.gen.agent != "py":
            return "the agent descriptor form (T41) is the Python path's"
    return None


def blocks(sc: TrtScenario) -> tuple[list[int], list[int]]:
    """The request's blocks on each side: seeded, distinct, in allocation order (not sorted)."""
    rng = np.random.default_rng(sc.request.seed)
    n_ctx = sc.ctx.side().blocks_for(sc.request.prompt_tokens)
    n_gen = sc.gen.side().blocks_for(sc.request.prompt_tokens)
    for name, n, inst in (("ctx", n_ctx, sc.ctx), ("gen", n_gen, sc.gen)):
        if n > inst.num_blocks:
            raise BadInput(f"{sc.source}: request.prompt_tokens {sc.request.prompt_tokens} needs {n} {name} blocks; "
                           f"{name}.num_blocks is {inst.num_blocks}")
    ctx = rng.choice(sc.ctx.num_blocks, n_ctx, replace=False).tolist()
    gen = rng.choice(sc.gen.num_blocks, n_gen, replace=False).tolist()
    return ctx, gen


def build(sc: TrtScenario, text: str | None, options: TrtOptions, live: LiveCtx | None = None) -> TrtPlan:
    """BadInput for anything wrong; every line resolved here, once."""
    where = "--trtllm" if text is not None else f"{sc.source}: trtllm"
    asked_all = (text or "").strip() == "all"
    resolved = eras.resolve_many(text if text is not None else ",".join(sc.trtllm), where)
    ctx_own = eras.resolve(sc.ctx.trtllm, f"{sc.source}: ctx.trtllm").line if sc.ctx.trtllm else None
    gen_own = eras.resolve(sc.gen.trtllm, f"{sc.source}: gen.trtllm").line if sc.gen.trtllm else None
    pairs, skipped = [], []
    for r in resolved:
        ctx, gen = ctx_own or r.line, gen_own or r.line
        if live is not None:
            ctx = gen  # the live ctx is whatever it is; the gen speaks the era named
        why = not_applicable(ctx, gen, sc) if live is None else (
            "a live ctx is read over the Python path's info endpoint" if gen.runtime == "cpp" else None)
        if why is not None:
            if asked_all:
                skipped.append(f"{r.line.name}: {why}")
                continue
            raise BadInput(f"{where}: {r.typed}: {why}")
        pairs.append(Pair(r.line.name, ctx.name, gen.name, r.attribution))
    if not pairs:
        raise BadInput(f"{where}: no era can run this scenario ({'; '.join(skipped)})")
    if live is None:  # a corrected gen against a corrected ctx, or against the ctx era the scenario pins
        pairs.append(Pair(CORRECTED, ctx_own.name if ctx_own else CORRECTED, CORRECTED))
    ctx_blocks, gen_blocks = blocks(sc)
    if live is not None:
        ctx_blocks = list(range(len(ctx_blocks)))  # `pdcheck serve` WRITEs from its blocks 0 .. n-1
    return TrtPlan(sc, pairs, ctx_blocks, gen_blocks, options, skipped, live)
