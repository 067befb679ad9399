"""The framework seam: what every command needs from a modelled framework (vLLM, SGLang, ...), and the one
registry the commands and smoke pick a framework from (a scenario's `framework` key, or a release flag such
as --vllm / --sglang). No module outside this package and a framework's own package asks which framework it
serves (tests/test_seams.py greps for it); docs/architecture.md lists the files a new framework touches.

The built-in frameworks register here by module name and are imported on first use: their adapters are thin
(every heavy import is inside a method), so `handshake` of a vLLM scenario never imports SGLang's model.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput

# name -> the module whose FRAMEWORK object implements it. The one line a new built-in framework adds.
BUILTIN: dict[str, str] = {
    "vllm": "pdcheck.vllm.framework",
    "sglang": "pdcheck.sglang.framework",
}
DEFAULT = "vllm"  # a scenario without a `framework` key, and a command given no release flag


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What a command prints: its exit code, the --json body (envelope added by pdcheck.envelope) and the
    table rendering."""

    exit_code: int
    body: Any
    render: Callable[[Any], None]  # console -> None
    text: str | None = None  # from-logs: the scenario written to --output


@dataclasses.dataclass(frozen=True)
class HandshakeArgs:
    """`pdcheck handshake`'s flags, as parsed; a framework refuses (BadInput) the ones it does not model."""

    scenario: Path | None
    releases: str | None  # the framework's release flag (--vllm / --sglang ...)
    overrides: dict[str, Any]
    hang_timeout: float
    timeout: float
    json_out: bool
    transfer: bool = True
    device: str = "cpu"
    max_tp: int = 64
    from_logs: tuple[Path, Path] | None = None
    prefill_release: str | None = None  # --prefill-vllm
    prefill_endpoint: str | None = None
    inject: list[str] | None = None
    ray: str | None = None
    log_dir: Path | None = None


@dataclasses.dataclass(frozen=True)
class SmokeOptions:
    transfer: bool = True
    hang_timeout_ms: int = 3000


PHASES = ("handshake", "requests")  # what a smoke scenario exercises (`pdcheck smoke --phase`)


@dataclasses.dataclass(frozen=True)
class SmokeCost:
    """What smoke's scheduler knows of a smoke part before it runs: the rank processes it keeps alive at once
    (what it admits against the cores) and the seconds it should take alone (longest first)."""

    ranks: int = 2
    seconds: float = 1.0


class Framework:
    """One modelled framework: subclass it, fill in the attributes and the handshake and smoke methods, and
    register() an instance. `commands` maps each command the framework implements to the help of its release
    flag there (None: no release flag in that command); a command it lacks is bad input, one line naming it,
    before anything runs. probe, serve, from_logs and requests are entered only for commands it lists."""

    name: str = ""  # "vllm": the scenario's `framework` value
    title: str = ""  # "vLLM": how output and errors name it
    flag: str = ""  # "--vllm": its release flag
    scenario_dirs: tuple[str, ...] = ()  # subdirectories of a scenario directory that hold its scenarios
    rank_modules: tuple[str, ...] = ()  # its rank bodies, preloaded by the forkserver
    commands: dict[str, str | None] = {}
    distribution: str = ""  # its pip distribution ("vllm"): what `pdcheck doctor` looks for installed

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

    def handshake_plan(self, args: HandshakeArgs) -> Any:
        """Every check before a process starts; releases resolved once."""
        raise NotImplementedError

    def handshake_run(self, plan: Any, show_progress: bool) -> Outcome:
        """Run the plan on real processes; its report as an Outcome."""
        raise NotImplementedError

    def smoke_plan(self, path: Path, options: SmokeOptions) -> Any:
        """A scenario file with an [expect] table, validated before anything runs."""
        raise NotImplementedError

    def smoke_run(self, plan: Any, case: Callable[..., Any]) -> list[Any]:
        """Run a smoke plan (or one part of it, smoke_split); one `case(...)` (smoke.Case, framework=name) per
        expected release it covers. Smoke calls it from several threads at once, one plan per call."""
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

    def probe(self, args: dict[str, Any]) -> Outcome:
        """`pdcheck probe` of a live prefill (read-only)."""
        raise BadInput(f"probe: not available for {self.title}")

    def serve(self, args: dict[str, Any]) -> int:
        """`pdcheck serve`: fake prefill ranks until a signal or --duration; the exit code."""
        raise BadInput(f"serve: not available for {self.title}")

    def from_logs(self, args: dict[str, Any]) -> Outcome:
        """`pdcheck scenario from-logs`: the scenario text (Outcome.text) and its JSON document."""
        raise BadInput(f"scenario from-logs: not available for {self.title}")

    def requests(self, args: dict[str, Any]) -> Outcome:
        """`pdcheck requests`: the request path after the handshake."""
        raise BadInput(f"requests: not available for {self.title}")


_registered: dict[str, Framework] = {}
_generation = 0  # bumped by register(): commands built from the registry (their release flags) are rebuilt


def register(fw: Framework) -> None:
    """Add (or replace) a framework: the one call a framework outside pdcheck makes."""
    global _generation
    if not isinstance(fw, Framework) or not fw.name or not fw.flag.startswith("--"):
        raise TypeError(f"{fw!r}: not a pdcheck.frameworks.Framework with a name and a --flag")
    _registered[fw.name] = fw
    _generation += 1


def generation() -> int:
    return _generation


def names() -> list[str]:
    return [*BUILTIN, *(n for n in _registered if n not in BUILTIN)]


def get(name: str) -> Framework:
    if name not in _registered:
        if name not in BUILTIN:
            raise BadInput(f"framework: expected one of {', '.join(names())}, got {name!r}")
        _registered[name] = importlib.import_module(BUILTIN[name]).FRAMEWORK
    return _registered[name]


def all_frameworks() -> list[Framework]:
    return [get(n) for n in names()]


def supporting(command: str) -> list[Framework]:
    """The frameworks that implement a command, registry order."""
    return [fw for fw in all_frameworks() if command in fw.commands]


def bundled_dirs() -> list[Path]:
    """Every directory that holds bundled scenarios: each framework's scenario_dirs under the package's
    scenarios folder, registry order (vLLM's top level first)."""
    from pdcheck.scenariofile import BUNDLED

    return list(dict.fromkeys(BUNDLED / d if d else BUNDLED for fw in all_frameworks() for d in fw.scenario_dirs))


def locate(path: Path) -> Path:
    """A SCENARIO argument as a file: a path as given, else a bundled scenario's name (any framework's)."""
    from pdcheck.scenariofile import locate as find

    return find(path, bundled_dirs())


def rank_modules() -> list[str]:
    """Every framework's rank modules, for the forkserver's preload."""
    return [mod for fw in all_frameworks() for mod in fw.rank_modules]


def pick(declared: object, flags: dict[str, str | None], where: str, command: str = "handshake",
         one: str = "name releases of one framework per run") -> tuple[Framework, str | None]:
    """Which framework a run models, and its release text: the one release flag given (flags: framework name
    -> the flag's value), else the scenario's `framework` key, else the default. A flag for another framework
    than the scenario declares, two frameworks' flags, or a framework without this command is bad input."""
    given = [(n, v) for n, v in flags.items() if v is not None]
    if len(given) > 1:
        raise BadInput(f"{' and '.join(get(n).flag for n, _ in given)}: {one}, not both")
    if declared is not None and (not isinstance(declared, str) or declared not in names()):
        raise BadInput(f"{where}: framework: expected one of {', '.join(names())}, got {declared!r}")
    if given:
        name, releases = given[0]
        fw = get(name)
        if declared is not None and declared != name:
            other = get(declared)
            raise BadInput(f"{fw.flag}: {where} is {_a(other.title)} scenario (framework = \"{declared}\"); "
                           f"use {other.flag}")
    else:
        fw, releases = get(str(declared or DEFAULT)), None
    if command not in fw.commands:
        raise BadInput(f"{where}: {command} is not available for {fw.title}")
    return fw, releases


def _a(title: str) -> str:
    return f"an {title}" if title[:1].upper() in "AEFHILMNORSX" else f"a {title}"


def unsupported(fw: Framework, flags: dict[str, Any], doc: str = "docs/architecture.md") -> None:
    """BadInput for the first flag given that `fw` does not model."""
    for flag, val in flags.items():
        if val:
            raise BadInput(f"{flag}: not available for {fw.title} yet (see {doc})")
