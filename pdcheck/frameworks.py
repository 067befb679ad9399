"""The framework registry: the one place the command layer (commands, cli, smoke, catalog) finds the modelled
frameworks (vLLM, SGLang, ...) and picks the one a run models (a release flag such as --vllm / --sglang, else the
scenario's own). The interface a framework implements is pdcheck.seam.

Frameworks are plugins: each is an entry point of the group `pdcheck.frameworks` (the ecosystem's convention, as
pytest's and Ray's plugins), the built-in ones included (pyproject.toml), so a framework can ship as a pip package
of its own and nothing here names one. An entry point is loaded on first use; an adapter is thin (every heavy
import inside a method), so `handshake` of a vLLM scenario never imports SGLang's model. No module outside this
package and a framework's own asks which framework it serves (tests/test_seams.py); docs/architecture.md lists the
files a new framework touches.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput, HarnessError
from pdcheck.seam import Framework

GROUP = "pdcheck.frameworks"  # the entry-point group a framework registers in
DEFAULT = "vllm"  # a scenario that names no framework, and a command given no release flag


# ---------------------------------------------------------------------------------------------- the registry
@functools.cache
def _entry_points() -> dict[str, Any]:
    """name -> entry point, for every installed framework."""
    from importlib.metadata import entry_points

    found: dict[str, Any] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)  # a name two distributions claim: the first on sys.path wins, as for pip
    return found


def names() -> list[str]:
    """The installed frameworks' names: the default first, then pdcheck's own, then the others, by name."""
    eps = _entry_points()
    if not eps:
        raise HarnessError(f"no framework is registered (entry points `{GROUP}`): pdcheck is not installed; "
                           "install it (pip install -e .) rather than running it from the source tree")

    def key(n: str) -> tuple[int, str]:
        dist = getattr(getattr(eps[n], "dist", None), "name", "")
        return (0 if n == DEFAULT else 1 if dist == "pdcheck" else 2, n)

    return sorted(eps, key=key)


_loaded: dict[str, Framework] = {}


def get(name: str) -> Framework:
    if name not in _loaded:
        eps = _entry_points()
        if name not in eps:
            raise BadInput(f"framework: expected one of {', '.join(names())}, got {name!r}")
        fw = eps[name].load()
        fw = fw() if isinstance(fw, type) else fw
        if not isinstance(fw, Framework) or fw.name != name or not fw.flag.startswith("--"):
            raise HarnessError(f"entry point {GROUP}:{name} ({eps[name].value}) is not a "
                               f"pdcheck.frameworks.Framework named {name!r} with a --flag")
        from pdcheck import launcher

        launcher.preload(fw.rank_modules)  # before the forkserver starts, its ranks start warm
        _loaded[name] = fw
    return _loaded[name]


def all_frameworks() -> list[Framework]:
    return [get(n) for n in names()]


def supporting(command: str) -> list[Framework]:
    """The frameworks that implement a command, registry order."""
    return [fw for fw in all_frameworks() if command in fw.commands]


def rank_modules() -> list[str]:
    """Every framework's rank modules, for the forkserver's preload."""
    return [mod for fw in all_frameworks() for mod in fw.rank_modules]


def bundled_dirs() -> list[Path]:
    """Every directory that holds bundled scenarios: each framework's scenario_dirs under the package's
    scenarios folder, registry order (vLLM's top level first)."""
    from pdcheck.scenariofile import BUNDLED

    return list(dict.fromkeys(BUNDLED / d if d else BUNDLED for fw in all_frameworks() for d in fw.scenario_dirs))


def locate(path: Path) -> Path:
    """A SCENARIO argument as a file: a path as given, else a bundled scenario's name (any framework's)."""
    from pdcheck.scenariofile import locate as find

    return find(path, bundled_dirs())


def declared(doc: Mapping[str, Any] | None) -> str | None:
    """The framework a scenario document is written for: its `framework` key, else the framework whose release
    list it carries (`vllm = [...]`, `sglang = [...]`); None when it names none (the default's then)."""
    if not doc:
        return None
    if "framework" in doc:
        return doc["framework"]  # checked by pick
    keyed = [n for n in names() if isinstance(doc.get(n), list)]
    return keyed[0] if len(keyed) == 1 else None


def pick(doc: Mapping[str, Any] | None, flags: dict[str, str | None], where: str, command: str = "handshake",
         one: str = "name releases of one framework per run") -> tuple[Framework, str | None]:
    """Which framework a run models, and its release text: the one release flag given (flags: framework name ->
    the flag's value), else the scenario's framework (`declared`), else the default. A flag for another
    framework than the scenario's, two frameworks' flags, or a framework without this command is bad input."""
    given = [(n, v) for n, v in flags.items() if v is not None]
    if len(given) > 1:
        raise BadInput(f"{' and '.join(get(n).flag for n, _ in given)}: {one}, not both")
    named = declared(doc)
    if named is not None and (not isinstance(named, str) or named not in names()):
        raise BadInput(f"{where}: framework: expected one of {', '.join(names())}, got {named!r}")
    own = named or (DEFAULT if doc is not None else None)  # a scenario naming no framework is the default's
    if given:
        name, releases = given[0]
        fw = get(name)
        if own is not None and own != name:
            other = get(own)
            raise BadInput(f"{fw.flag}: {where} is {_a(other.title)} scenario; use {other.flag}")
    else:
        fw, releases = get(own or DEFAULT), None
    if command not in fw.commands:
        raise BadInput(f"{where}: {command} is not available for {fw.title}")
    return fw, releases


def check_flags(fw: Framework, command: str, given: Iterable[tuple[str, str]]) -> None:
    """BadInput naming the first flag given (parameter name, the flag as typed) that `fw` does not take in
    `command` (its Support); the command's own flags are not passed in."""
    support = fw.commands[command]
    for param, flag in given:
        if not support.takes(param):
            raise BadInput(f"{flag}: not available for {fw.title} in `pdcheck {command}` (see {fw.docs})")


def _a(title: str) -> str:
    return f"an {title}" if title[:1].upper() in "AEFHILMNORSX" else f"a {title}"
