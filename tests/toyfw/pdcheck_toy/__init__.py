"""A toy P/D framework, registered only through its entry point: each release's D rank READs the header its P rank
serves, over real NIXL, and asserts the header its release expects. Real rank processes on pdcheck's rank skeleton
(pdcheck.ranks), started by pdcheck's forkserver (pdcheck.launcher) and waited on by pdcheck.orchestrate.

P's role runs the skeleton's default: it only waits for Stop, and its NIXL worker still progresses the READs of
its memory (ranks.Role.receive), as every framework's waiting ranks do."""

from __future__ import annotations

import mmap
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from pdcheck import messages as m
from pdcheck.errors import BadInput
from pdcheck.nixlagent import LOCAL
from pdcheck.ranks import Role, run_rank
from pdcheck.seam import Framework, HandshakeArgs, Outcome, SmokeOptions, Support

HEADERS = {"1.0": b"TOY1", "2.0": b"TOY2"}  # what each release's D expects; the P serves TOY1
SERVED = HEADERS["1.0"]
SIZE = 1 << 20  # P's region: a READ this large needs the target's worker to progress (UCX rendezvous)


class ToyScenario(msgspec.Struct, forbid_unknown_fields=True):
    framework: str
    toy: list[str]
    name: str = "toy"
    expect: dict[str, str] = {}
    source: str = ""


class PSpec(msgspec.Struct, frozen=True):
    tp_rank: int = 0


class DSpec(msgspec.Struct, frozen=True):
    tp_rank: int
    release: str
    p_meta: bytes
    p_addr: int


class PReady(m.Msg):
    tp_rank: int
    agent: str
    metadata: bytes
    addr: int


class DFinal(m.Msg):
    tp_rank: int
    status: str  # ok | assert
    got: bytes


m.protocol(PReady, DFinal)


class ToyReport(msgspec.Struct):
    scenario: str
    matrix: dict[str, list[str]]
    exit_code: int


class _ToyRole(Role):
    buf: mmap.mmap

    def memory(self) -> tuple[list[tuple[int, int, int]], str]:
        import ctypes

        self.buf = mmap.mmap(-1, SIZE)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        return [(self.addr, SIZE, 0)], "DRAM"


class PrefillRole(_ToyRole):
    spec_type: ClassVar[type[Any]] = PSpec
    letter = "P"

    @property
    def agent_name(self) -> str:
        return "toy-p"

    def ready(self) -> m.Msg:
        self.buf[:] = SERVED * (SIZE // len(SERVED))
        return PReady(0, self.agent.name, self.agent.metadata(), self.addr)


class DecodeRole(_ToyRole):
    spec_type: ClassVar[type[Any]] = DSpec
    letter = "D"

    @property
    def agent_name(self) -> str:
        return f"toy-d{self.spec.tp_rank}"

    def ready(self) -> m.Msg:
        return m.Ready(self.spec.tp_rank, self.agent.name, self.setup_ms())

    def run(self) -> None:
        import numpy as np

        peer = self.agent.add_remote(self.spec.p_meta)
        local = self.agent.prep(LOCAL, np.array([(self.addr, SIZE, 0)], dtype=np.uint64), "DRAM")
        remote = self.agent.prep(peer, np.array([(self.spec.p_addr, SIZE, 0)], dtype=np.uint64), "DRAM")
        self.agent.read(local, np.array([0]), remote, np.array([0]), timeout_s=10.0, context=self.name,
                        yield_cpu=True)
        got = bytes(self.buf[:4])
        status = "ok" if got == HEADERS[self.spec.release] and self.buf[:] == SERVED * (SIZE // 4) else "assert"
        m.send(self.conn, DFinal(self.spec.tp_rank, status, got))


def prefill_main(conn: Any, spec_bytes: bytes) -> None:
    run_rank(PrefillRole, conn, spec_bytes)


def decode_main(conn: Any, spec_bytes: bytes) -> None:
    run_rank(DecodeRole, conn, spec_bytes)


def _stage(timeout_s: float) -> Any:
    from pdcheck import orchestrate as orc

    return orc.Stage("{rank} failed: {error}", "{rank} died: it {ended}", "{ranks} silent after {timeout:g} s",
                     timeout_s)


class Toy(Framework):
    name = "toy"
    title = "Toy"
    flag = "--toy"
    scenario_dirs = ("toy",)
    rank_modules = ("pdcheck_toy",)
    docs = "tests/toyfw"
    # handshake takes no flag beyond the command's own (--json, --timeout, ...): --device, --no-transfer and the
    # scenario flags are refused, one line each
    commands = {"handshake": Support("Toy release(s) to model: 1.0, 2.0 or '1.0,2.0'.", frozenset()),
                "smoke": Support(flags=frozenset())}

    def release_line(self, release: str) -> str:
        if release not in HEADERS:
            raise BadInput(f"--toy: {release!r} is not a toy release ({', '.join(HEADERS)})")
        return release

    def load(self, path: Path | None, overrides: dict[str, Any]) -> ToyScenario:
        from pdcheck.scenariofile import read_toml

        if path is None:
            raise BadInput("toy: give a scenario file")
        try:
            sc = msgspec.convert(read_toml(path), ToyScenario)
        except msgspec.ValidationError as exc:
            raise BadInput(f"{path}: {exc}") from None
        for r in sc.toy:
            self.release_line(r)
        return msgspec.structs.replace(sc, source=str(path))

    def handshake_plan(self, args: HandshakeArgs) -> Any:
        sc = self.load(args.scenario, args.overrides)
        rels = args.releases.split(",") if args.releases else sc.toy
        for r in rels:
            self.release_line(r)
        return sc, rels, args.timeout

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck import orchestrate as orc
        from pdcheck.launcher import launcher
        from pdcheck.verdict import exit_code

        sc, rels, timeout = plan
        with launcher(None) as lau:
            p = lau.start("P", 0, prefill_main, msgspec.msgpack.encode(PSpec()))
            (_rank, ready), = orc.gather(lau, [p], PReady, timeout, _stage(timeout)).values()
            ds = [lau.start("D", i, decode_main, msgspec.msgpack.encode(DSpec(i, r, ready.metadata, ready.addr)))
                  for i, r in enumerate(rels)]
            # each D's Ready, then its DFinal (its Ready is a stray to this wait), then it ends
            got = orc.gather(lau, ds, DFinal, timeout, _stage(timeout), watch=[p], ended_ok=True)
            p.send(m.Stop())
        by_rank = {d.id: r for d, r in zip(ds, rels, strict=True)}
        matrix = {by_rank[rid]: [msg.status] for rid, (_d, msg) in got.items()}
        matrix = {r: matrix[r] for r in rels}
        rep = ToyReport(sc.name, matrix, exit_code([v == ["ok"] for v in matrix.values()]))
        return Outcome(rep.exit_code, rep,
                       lambda console: console.print(f"toy {sc.name}: {matrix}", markup=False, highlight=False))

    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        sc = self.load(path, {})
        if not sc.expect:
            raise BadInput(f"{path}: expect: no expected outcomes (add an [expect] table)")
        return sc, list(sc.expect), 30.0

    def smoke_count(self, plan: Any) -> int:
        return len(plan[0].expect)

    def smoke_run(self, plan: Any, case: Any) -> list[Any]:
        sc = plan[0]
        t0 = time.perf_counter()
        rep = self.handshake_run(plan, False).body
        secs = time.perf_counter() - t0
        return [case(sc.name, sc.source, r, rep.matrix[r] == [want], [want], rep.matrix[r], secs,
                     framework=self.name, document=rep) for r, want in sc.expect.items()]


FRAMEWORK = Toy()
