"""What is bundled: the scenarios (name, framework, phase, one line) and each framework's modelled releases with
the line each maps to. `pdcheck list` prints it; shell completion offers the same names."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import msgspec

REQUESTS_PHASE = "requests"
HANDSHAKE_PHASE = "handshake"
ONE_LINE = 110  # characters of a scenario's description `list` shows


class ScenarioEntry(msgspec.Struct):
    name: str
    framework: str
    phase: str  # "handshake" (pdcheck handshake / smoke) or "requests" (pdcheck requests)
    description: str  # its first sentence


class ReleaseEntry(msgspec.Struct):
    framework: str
    releases: str  # the range as pdcheck writes it everywhere (releaseline.span): '0.9.2 to 0.9.x'
    line: str  # the modelled line those releases run


class Catalog(msgspec.Struct):
    """The body of `pdcheck list --json`."""

    scenarios: list[ScenarioEntry] = []
    releases: list[ReleaseEntry] = []


def _first_sentence(text: str) -> str:
    text = " ".join(text.split())
    m = re.match(r"(.+?)[.:](\s+[A-Z`\"]|$)", text)  # a sentence ends where the next one starts
    one = m.group(1) if m else text
    return one if len(one) <= ONE_LINE else one[:ONE_LINE - 1].rstrip() + "…"


def _describe(path: Path, doc: dict[str, object]) -> str:
    """The scenario's description key, else its leading comment block (request-path scenarios), else its issue."""
    desc = doc.get("description")
    if isinstance(desc, str) and desc.strip():
        return _first_sentence(desc)
    comments = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        comments.append(line.lstrip("# "))
    if comments:
        return _first_sentence(" ".join(comments))
    req = doc.get("requests")
    return str(req.get("issue", "")) if isinstance(req, dict) else ""


def scenarios() -> list[ScenarioEntry]:
    from pdcheck.frameworks import DEFAULT
    from pdcheck.scenario import BUNDLED, bundled, bundled_subdirs

    out = []
    for path in [*bundled(), *(f for sub in bundled_subdirs() for f in sorted((BUNDLED / sub).glob("*.toml")))]:
        try:
            doc = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, tomllib.TOMLDecodeError):  # a broken bundled file: listed by name, smoke reports it
            doc = {}
        phase = REQUESTS_PHASE if "requests" in doc or path.parent.name == REQUESTS_PHASE else HANDSHAKE_PHASE
        out.append(ScenarioEntry(path.stem, str(doc.get("framework", DEFAULT)), phase, _describe(path, doc)))
    return out


def releases() -> list[ReleaseEntry]:
    from pdcheck import frameworks
    from pdcheck.releaseline import line_name

    out = []
    for fw in frameworks.all_frameworks():
        table = fw.release_table()
        if table is None:
            continue
        for releases, line in table.ranges():
            out.append(ReleaseEntry(fw.name, releases, line_name(line)))
    return out


def release_names(framework: str) -> list[str]:
    """What a release flag takes, for completion: each line's first release, 'all' and 'corrected' excluded."""
    from pdcheck import frameworks

    table = frameworks.get(framework).release_table()
    return [] if table is None else table.names()[:len(table.lines)]
