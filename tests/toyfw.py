"""A toy framework registered only in the tests: the proof that a third framework is one package and one
registry line. Its P rank serves a header over a real TCP socket; each D rank (one per release) reads it and
asserts the header its release expects. Real rank processes from pdcheck's forkserver (pdcheck.launcher),
waited on by pdcheck.orchestrate; pdcheck itself is not edited for it."""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec

from pdcheck import frameworks
from pdcheck import messages as m
from pdcheck.errors import BadInput
from pdcheck.frameworks import Framework, HandshakeArgs, Outcome, SmokeOptions

HEADERS = {"1.0": b"TOY1", "2.0": b"TOY2"}  # what each release's D expects; the P serves TOY1


class ToyScenario(msgspec.Struct, forbid_unknown_fields=True):
    framework: str
    toy: list[str]
    name: str = "toy"
    expect: dict[str, str] = {}
    source: str = ""


class PSpec(msgspec.Struct):
    serve: int  # connections to answer


class DSpec(msgspec.Struct):
    port: int
    release: str


class ToyReport(msgspec.Struct):
    scenario: str
    matrix: dict[str, list[str]]
    exit_code: int


def toy_prefill_main(conn: Connection, spec_bytes: bytes) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=PSpec)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        m.send(conn, m.Ready(0, f"toy-p:{srv.getsockname()[1]}", 0.0))
        for _ in range(spec.serve):
            peer, _addr = srv.accept()
            with peer:
                peer.sendall(HEADERS["1.0"])


def toy_decode_main(conn: Connection, spec_bytes: bytes) -> None:
    spec = msgspec.msgpack.decode(spec_bytes, type=DSpec)
    with socket.create_connection(("127.0.0.1", spec.port), timeout=10) as s:
        got = b""
        while len(got) < 4:
            chunk = s.recv(4 - len(got))
            if not chunk:
                break
            got += chunk
    status = "ok" if got == HEADERS[spec.release] else "assert"
    m.send(conn, m.FrameworkFinal(0, msgspec.msgpack.encode(status)))


def _stage(timeout_s: float) -> Any:
    from pdcheck import orchestrate as orc

    return orc.Stage("{rank} failed: {error}", "{rank} died: it {ended}", "{ranks} silent after {timeout:g} s",
                     timeout_s)


class Toy(Framework):
    name = "toy"
    title = "Toy"
    flag = "--toy"
    scenario_dirs = ("toy",)
    rank_modules = ("toyfw",)
    commands = {"handshake": "Toy release(s) to model: 1.0, 2.0 or '1.0,2.0'.", "smoke": None}

    def load(self, path: Path | None, overrides: dict[str, Any]) -> ToyScenario:
        from pdcheck.scenariofile import read_toml

        if path is None:
            raise BadInput("toy: give a scenario file")
        try:
            sc = msgspec.convert(read_toml(path), ToyScenario)
        except msgspec.ValidationError as exc:
            raise BadInput(f"{path}: {exc}") from None
        if any(r not in HEADERS for r in sc.toy):
            raise BadInput(f"{path}: toy: releases are {', '.join(HEADERS)}")
        return msgspec.structs.replace(sc, source=str(path))

    def handshake_plan(self, args: HandshakeArgs) -> Any:
        sc = self.load(args.scenario, args.overrides)
        rels = args.releases.split(",") if args.releases else sc.toy
        if any(r not in HEADERS for r in rels):
            raise BadInput(f"--toy: releases are {', '.join(HEADERS)}")
        return sc, rels, args.timeout

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        from pdcheck import orchestrate as orc
        from pdcheck.launcher import launcher
        from pdcheck.verdict import exit_code

        sc, rels, timeout = plan
        with launcher(None) as lau:
            p = lau.start("P", 0, toy_prefill_main, msgspec.msgpack.encode(PSpec(len(rels))))
            (_rank, ready), = orc.gather(lau, [p], m.Ready, timeout, _stage(timeout)).values()
            port = int(ready.agent.split(":")[1])
            ds = [lau.start("D", i, toy_decode_main, msgspec.msgpack.encode(DSpec(port, r)))
                  for i, r in enumerate(rels)]
            got = orc.gather(lau, ds, m.FrameworkFinal, timeout, _stage(timeout), ended_ok=True)
        by_rank = {d.id: r for d, r in zip(ds, rels, strict=True)}
        matrix = {by_rank[rid]: [msgspec.msgpack.decode(msg.body, type=str)] for rid, (_d, msg) in got.items()}
        matrix = {r: matrix[r] for r in rels}
        rep = ToyReport(sc.name, matrix, exit_code([v == ["ok"] for v in matrix.values()]))
        return Outcome(rep.exit_code, rep,
                       lambda console: console.print(f"toy {sc.name}: {matrix}", markup=False, highlight=False))

    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        sc = self.load(path, {})
        if not sc.expect:
            raise BadInput(f"{path}: expect: no expected outcomes (add an [expect] table)")
        return sc, list(sc.expect), 30.0

    def smoke_run(self, plan: Any, case: Any) -> list[Any]:
        sc = plan[0]
        t0 = time.perf_counter()
        rep = self.handshake_run(plan, False).body
        secs = time.perf_counter() - t0
        return [case(sc.name, sc.source, r, rep.matrix[r] == [want], [want], rep.matrix[r], secs,
                     framework=self.name) for r, want in sc.expect.items()]


def install() -> None:
    frameworks.register(Toy())
