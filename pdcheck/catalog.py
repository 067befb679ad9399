"""What is bundled: the scenarios (name, framework, phase, one line) and each framework's modelled releases with
the line each maps to. `pdcheck list` prints it; shell completion offers the same names."""

from __future__ import annotations

import tomllib
from pathlib import Path

import msgspec

REQUESTS_PHASE = "requests"
HANDSHAKE_PHASE = "handshake"


class ScenarioEntry(msgspec.Struct):
    name: str
    framework: str
    phase: str  # "handshake" (pdcheck handshake / smoke) or "requests" (pdcheck requests)
    description: str  # its first sentence, whole


class ReleaseEntry(msgspec.Struct):
    framework: str
    releases: str  # the range as pdcheck writes it everywhere (releaseline.span): '0.9.2 to 0.9.x'
    line: str  # the modelled line those releases run


class Catalog(msgspec.Struct):
    """The body of `pdcheck list --json`."""

    scenarios: list[ScenarioEntry] = []
    releases: list[ReleaseEntry] = []


def _first_sentence(text: str) -> str:
    """The description's first sentence, whole (`pdcheck list` wraps it, never cuts it): it ends at a '.' or ':'
    outside brackets and quotes, followed by a space and a capital, a digit, a backtick or a quote, or at the
    end; an abbreviation ("e.g.", "i.e.", "vs.") or a version ("0.9.1") ends nothing."""
    text = " ".join(text.split())
    depth = 0
    quoted = False
    for i, c in enumerate(text):
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth = max(0, depth - 1)
        elif c == '"':
            quoted = not quoted
        elif c in ".:" and not depth and not quoted:
            rest = text[i + 1:i + 3]
            word = text[:i].rsplit(" ", 1)[-1].lower()
            if rest == "" or rest[:1] == " " and (rest[1:2].isupper() or rest[1:2].isdigit() or rest[1:2] in "`\"'"):
                if c == "." and word in _ABBREVIATIONS:
                    continue
                return text[:i]
    return text


_ABBREVIATIONS = {"e.g", "i.e", "vs", "etc", "cf", "approx", "no", "fig", "incl", "resp"}


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
    from pdcheck.frameworks import DEFAULT, bundled_dirs
    from pdcheck.scenariofile import bundled

    out = []
    for path in bundled(bundled_dirs()):
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
