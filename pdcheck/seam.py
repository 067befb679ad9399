"""The framework seam's types: the interface a modelled framework implements (Framework) and what each command
hands it (one typed Struct per command), what it hands back (Outcome), and what it declares per command (Support).
A framework's package imports this module only; the registry that finds frameworks (pdcheck.frameworks, their
entry points) is the command layer's (docs/architecture.md, "The framework seam").

The command layer parses flags, locates the scenario, picks the framework (pdcheck.frameworks.pick), refuses every
flag given that the framework does not declare for that command (pdcheck.frameworks.check_flags), then builds one
of the Args Structs and calls the framework's method with it. A field is the flag's parameter name, so a framework
declares its flags by field names (Support.flags). The Structs are the schema of a call; nothing here is encoded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

PHASES = ("handshake", "requests")  # what a smoke scenario exercises (`pdcheck smoke --phase`)

Overrides = dict[str, dict[str, Any]]  # the scenario flags, as [prefill] / [decode] keys (pdcheck.cliopts)


class Support(msgspec.Struct, frozen=True):
    """What a framework offers in one command: the help of its release flag there (None: no release flag in
    that command) and the command's flags it takes (parameter names; None: every flag of the command)."""

    release_help: str | None = None
    flags: frozenset[str] | None = None
    # The framework's words where a flag's values are its own (requests' --fault: its fault names), and a
    # paragraph for the command's help epilog (its fault catalogue).
    help: dict[str, str] = {}
    epilog: str = ""

    def takes(self, param: str) -> bool:
        return self.flags is None or param in self.flags


class DoctorContext(msgspec.Struct, frozen=True, kw_only=True):
    """What `pdcheck doctor` knows of this node when it asks a framework for its environment rules."""

    devices: Any  # pdcheck.doctor.netdevs.Devices: NICs (addresses), RDMA ports, GPUs
    multi_node: bool  # a pair or cluster run: P and D on different nodes
    installed: str | None  # the framework's distribution installed here (its version), None if absent


class HandshakeArgs(msgspec.Struct, frozen=True, kw_only=True):
    """`pdcheck handshake`."""

    scenario: Path | None  # located (a bundled name resolved to its file)
    releases: str | None  # the framework's release flag (--vllm / --sglang ...)
    overrides: Overrides
    hang_timeout: float
    timeout: float
    json_out: bool
    transfer: bool = True
    device: str = "cpu"
    max_tp: int = 64
    from_logs: tuple[Path, Path] | None = None
    prefill_release: str | None = None  # --prefill-release (vLLM: --prefill-vllm)
    prefill_endpoint: str | None = None
    inject: list[str] | None = None
    ray: str | None = None
    log_dir: Path | None = None


class SmokeOptions(msgspec.Struct, frozen=True):
    """`pdcheck smoke`: how every scenario part of the run is planned."""

    transfer: bool = True
    hang_timeout_ms: int = 3000


class ProbeArgs(msgspec.Struct, frozen=True, kw_only=True):
    """`pdcheck probe` of a live prefill, read-only."""

    endpoint: str
    releases: str | None
    overrides: Overrides
    scenario: Path | None  # --scenario: the decode side the hazards are judged against (located)
    timeout: float
    max_tp: int
    decode_releases: str | None = None  # the decode release(s) to check against P (default: P's)
    dp_rank: int = 0
    dp_size: int = 1
    pp_size: int | None = None
    tp_size: int | None = None  # P's TP size (--prefill-tp; default: discovered)
    version_url: str | None = None


class ServeArgs(msgspec.Struct, frozen=True, kw_only=True):
    """`pdcheck serve`: fake prefill ranks until a signal or --duration."""

    scenario: Path | None
    releases: str | None
    overrides: Overrides
    json_out: bool
    port: int | None = None
    tag_blocks: int | None = None  # None: the framework's default
    duration: float | None = None
    api_port: int | None = None


class FromLogsArgs(msgspec.Struct, frozen=True, kw_only=True):
    """`pdcheck scenario from-logs`: a scenario out of a prefill's and a decode's start-up logs."""

    prefill_log: Path
    decode_log: Path
    releases: str | None
    overrides: Overrides
    output: Path | None = None
    dp_rank: int | None = None


class RequestsArgs(msgspec.Struct, frozen=True, kw_only=True):
    """`pdcheck requests`: the request path after the handshake. `flags`: the load flags given (None: the
    scenario's, else the release's own), by name as the scenario's [requests] table spells them."""

    scenario: Path | None
    releases: str | None
    overrides: Overrides  # the shape flags (TP and DP per side), as [prefill] / [decode] keys
    faults: list[str]
    flags: dict[str, Any]
    json_out: bool
    plot: Path | None = None
    every: bool = False


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a command prints: its exit code, the --json body (envelope added by pdcheck.envelope) and the
    table rendering."""

    exit_code: int
    body: Any
    render: Callable[[Any], None]  # console -> None
    text: str | None = None  # from-logs: the scenario written to --output


@dataclasses.dataclass(frozen=True)
class SmokeCost:
    """What smoke's scheduler knows of a smoke part before it runs: the rank processes it keeps alive at once
    (what it admits against the cores) and the seconds it should take alone (longest first)."""

    ranks: int = 2
    seconds: float = 1.0


class Framework:
    """One modelled framework: subclass it, fill in the attributes and the methods of the commands it lists in
    `commands`, and make an instance its package's entry point. A command it does not list is one line of bad
    input before anything runs; so is a flag of a listed command that its Support does not take."""

    name: str = ""  # "vllm": the entry point's name, the scenario's `framework` value
    title: str = ""  # "vLLM": how output and errors name it
    flag: str = ""  # "--vllm": its release flag
    scenario_dirs: tuple[str, ...] = ()  # under pdcheck's scenarios folder ("" its top level), in smoke's DIR too
    rank_modules: tuple[str, ...] = ()  # its rank bodies, preloaded by the forkserver
    commands: Mapping[str, Support] = {}
    distribution: str = ""  # its pip distribution ("vllm"): what `pdcheck doctor` looks for installed
    env_prefixes: tuple[str, ...] = ()  # its environment variables that steer P/D (a page's host facts)
    docs: str = "docs/architecture.md"  # where its model is described (named by its bad-input lines)

    def release_line(self, release: str) -> str:
        """The modelled release line a typed release resolves to (its name); BadInput when not modelled."""
        raise NotImplementedError

    def release_table(self) -> Any:
        """Its modelled releases (a pdcheck.releaseline.ReleaseTable: ranges -> the line each runs, the line's
        `name`), for `pdcheck list releases` and completion; None when it has none to list."""
        return None

    def load(self, path: Path | None, overrides: dict[str, Any]) -> Any:
        """A scenario file (and flag overrides) as this framework's scenario; BadInput when invalid."""
        raise NotImplementedError

    # ---- handshake
    def handshake_plan(self, args: HandshakeArgs) -> Any:
        """Every check before a process starts; releases resolved once."""
        raise NotImplementedError

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        """Run the plan on real processes; its report as an Outcome."""
        raise NotImplementedError

    # ---- smoke
    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        """A scenario file with an [expect] table, validated before anything runs."""
        raise NotImplementedError

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        """Run a smoke plan (or one part of it, smoke_split); one `case(...)` (smoke.Case's fields, framework=name,
        document=the run's report) per expected release it covers. Smoke calls it from several threads at once,
        one plan per call."""
        raise NotImplementedError

    def smoke_split(self, plan: Any) -> list[Any]:
        """Parts of a smoke plan that share no process, port or state, so smoke may run them at once; their
        cases, in this order, are the scenario's. Default: the plan as one part."""
        return [plan]

    def smoke_count(self, plan: Any) -> int:
        """How many cases the plan yields (its [expect] entries): the total smoke's progress counts to."""
        return 1

    def smoke_phase(self, plan: Any) -> str:
        """Which of PHASES the plan exercises (`pdcheck smoke --phase`)."""
        return "handshake"

    def smoke_cost(self, part: Any) -> SmokeCost:
        """The scheduler's estimate of one part (smoke_split); a guess only orders and admits the work."""
        return SmokeCost()

    # ---- the other commands, entered only when listed in `commands`
    def probe(self, args: ProbeArgs) -> Outcome:
        """`pdcheck probe` of a live prefill (read-only)."""
        raise NotImplementedError

    def serve(self, args: ServeArgs) -> int:
        """`pdcheck serve`: fake prefill ranks until a signal or --duration; the exit code."""
        raise NotImplementedError

    def from_logs(self, args: FromLogsArgs) -> Outcome:
        """`pdcheck scenario from-logs`: the scenario text (Outcome.text) and its JSON document."""
        raise NotImplementedError

    def requests(self, args: RequestsArgs) -> Outcome:
        """`pdcheck requests`: the request path after the handshake."""
        raise NotImplementedError

    def doctor_checks(self, env: Mapping[str, str], context: DoctorContext) -> list[Any]:
        """`pdcheck doctor`: this framework's environment rules (pdcheck.doctor.model.Check each), judged
        against `env` and what doctor knows of the node."""
        return []
