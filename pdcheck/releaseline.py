"""Release lines, for every framework and phase: a table of inclusive (first, last) version ranges, each mapped to
one line object (a handshake model, a request-path lifecycle, a params-keys tuple), the parser of a typed
release with its error texts, the version helper and the name of the corrected behaviour. No framework here:
each framework's releases package builds its tables from this (docs/release-models.md)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from pdcheck.errors import BadInput

T = TypeVar("T")
Version = tuple[int, int, int]

ANY = 10**9  # every patch release of a minor line: (0, 12, ANY) is 0.12.x
CORRECTED = "corrected"  # the name of the corrected behaviour, in every framework and phase
CORRECTED_VERSION: Version = (99, 0, 0)  # where the corrected behaviour sorts: after every release
MAX_NAMED = 64  # releases one flag or table may name

_NUMBER = re.compile(r"v?([0-9]{1,4})\.([0-9]{1,4})(?:\.([0-9]{1,4}))?(?:\.([0-9]{1,4}))?"
                     r"(rc[0-9]{1,4}|\.?post[0-9]{1,4}|\.?dev[0-9]{1,6}|\+[A-Za-z0-9.]{1,32})?", re.ASCII)


def is_corrected(item: Any) -> bool:
    """The one way to ask whether a release name, model or line is the corrected behaviour: the name itself, or
    an object whose `name` (a model) or `line` (a lifecycle) is it."""
    if isinstance(item, str):
        return item.strip() == CORRECTED
    return getattr(item, "name", None) == CORRECTED or getattr(item, "line", None) == CORRECTED


def version_tuple(text: str) -> Version:
    """(major, minor, patch) of a release name: '0.14.1' -> (0, 14, 1), '0.10.1.1' -> (0, 10, 1), '0.14' ->
    (0, 14, 0), '0.4.6.post1' -> (0, 4, 6); 'corrected' sorts after every release. The one version helper:
    compare it with tuples, `version_tuple(rel.version) >= (0, 29)`."""
    if is_corrected(text):
        return CORRECTED_VERSION
    m = _NUMBER.fullmatch(text.strip())
    if not m:
        raise ValueError(f"{text!r} is not a release number")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def span(first: Version, last: Version, first_name: str = "") -> str:
    """A range of releases as pdcheck writes it everywhere (`pdcheck list releases`, error texts, the docs):
    '0.9.2 to 0.9.x', '0.4.5.post3 to 0.5.23', '0.13.0'. The one wording: every range a user reads comes from
    here. first_name: the first release's exact name where it has a suffix ('0.4.5.post3')."""
    a = first_name or ".".join(map(str, first))
    if first == last:
        return a
    b = (f"{last[0]}.x" if last[1] == ANY else f"{last[0]}.{last[1]}.x" if last[2] == ANY
         else ".".join(map(str, last)))
    return f"{a} to {b}"


def line_name(line: Any) -> str:
    """The name of the line a release runs ('0.34.0', '0.4.6.post1'): a model's name, else the object itself."""
    return str(getattr(line, "name", line))


def warn(text: str) -> None:
    """One warning line on stderr, `pdcheck: warning: <flag>: <what>`: the run goes on (a release newer than
    the newest modelled one runs as that line)."""
    import sys

    print(f"pdcheck: warning: {text}", file=sys.stderr, flush=True)


def _before(v: Version) -> Version:
    """The last release before v, for ranges written as the firsts of consecutive lines."""
    if v[2] > 0:
        return v[0], v[1], v[2] - 1
    return (v[0], v[1] - 1, ANY) if v[1] > 0 else (v[0] - 1, ANY, ANY)


@dataclass(frozen=True)
class ReleaseTable(Generic[T]):
    """Inclusive (first, last) ranges -> line objects, in release order, without gaps inside one minor.

    first_name: the first release's exact name where it has a suffix ('0.4.5.post3'); noun: what a typed number
    is ('a release number', 'an SGLang release number'); example: a release in error texts; four_part: the
    four-part releases that exist (any other is a typo); label: a prefix of the 'not modelled' text ('SGLang ').
    A release past the last line of the same major runs as the last line, with a warning that names it
    (`resolve`); another major is not modelled."""

    lines: tuple[tuple[Version, Version, T], ...]
    first_name: str = ""
    noun: str = "a release number"
    example: str = "0.9.1"
    four_part: tuple[str, ...] = ()
    label: str = ""
    _cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_firsts(cls, firsts: Sequence[tuple[Version, T]], last: Version, **kw: Any) -> ReleaseTable[T]:
        """A table whose lines each run up to the next line's first release; the last one up to `last`."""
        ends = [_before(f) for f, _x in firsts[1:]] + [last]
        return cls(tuple((f, e, x) for (f, x), e in zip(firsts, ends, strict=True)), **kw)

    def __post_init__(self) -> None:
        prev: Version | None = None
        for first, last, _x in self.lines:
            if first > last or (prev is not None and first <= prev):
                raise ValueError(f"release table: {span(first, last)} overlaps or is out of order")
            prev = last

    @property
    def first(self) -> Version:
        return self.lines[0][0]

    @property
    def modelled(self) -> str:
        """The whole range in error texts and docs: '0.9.0 to 0.34.x' (span)."""
        return span(self.first, self.last, self.first_name)

    def ranges(self) -> list[tuple[str, T]]:
        """Each line's range as users read it (span) and its line, in release order: `pdcheck list releases`."""
        return [(span(f, lt, self.first_name if i == 0 else ""), x) for i, (f, lt, x) in enumerate(self.lines)]

    def names(self) -> list[str]:
        """Releases a user may mean, for 'did you mean': each line's first release and the four-part ones."""
        out = [self.first_name or ".".join(map(str, self.first))]
        out += [".".join(map(str, f)) for f, _l, _x in self.lines[1:]]
        return out + list(self.four_part)

    def _did_you_mean(self, text: str) -> str:
        from pdcheck.suggest import did_you_mean

        return did_you_mean(text, self.names())

    @property
    def last(self) -> Version:
        return self.lines[-1][1]

    def at(self, v: Sequence[int]) -> T | None:
        """The line of version v, or None outside every range."""
        key = tuple((*v, 0, 0)[:3])
        for first, last, x in self.lines:
            if first <= key <= last:
                return x
        return None

    def clamped(self, v: Sequence[int]) -> T:
        """The line of version v; before the first line the first, after the last the last."""
        key = tuple((*v, 0, 0)[:3])
        found = self.lines[0][2]
        for first, _last, x in self.lines:
            if first <= key:
                found = x
        return found

    def values(self) -> list[T]:
        return [x for _f, _l, x in self.lines]

    def firsts(self) -> list[Version]:
        return [f for f, _l, _x in self.lines]

    def _of_minor(self, major: int, minor: int) -> list[tuple[Version, Version]]:
        return [(f, lt) for f, lt, _x in self.lines if f <= (major, minor, ANY) and lt >= (major, minor, 0)]

    def _also(self, corrected: str) -> str:
        return f", {corrected}" if corrected else ""

    def parse(self, text: str, where: str, also: str = CORRECTED) -> tuple[Version, str]:
        """(major, minor, patch) for the lookup, and the normalised release: 'v0.14' -> '0.14.0' (a minor that
        is one line), a listed four-part release kept ('0.10.1.1'), local and pre-release suffixes ('+cu128',
        'rc1', '.post1') dropped. ASCII digits only; an ambiguous minor ('0.9') or an unlisted fourth number is
        bad input. `also`: what else the flag takes, named in the error text."""
        t = text.strip()
        m = _NUMBER.fullmatch(t)
        if not m:
            raise BadInput(f"{where}: {t!r} is not {self.noun} (ASCII digits, e.g. {self.example}; modelled: "
                           f"{self.modelled}{self._also(also)}){self._did_you_mean(t)}")
        major, minor = int(m.group(1)), int(m.group(2))
        if m.group(3) is None:
            lines = self._of_minor(major, minor)
            if len(lines) > 1:
                cands = ", ".join(span(f, lt) for f, lt in lines)
                eg = ".".join(map(str, max(lines[0][0], (major, minor, 0))))
                raise BadInput(f"{where}: {t!r} is ambiguous: {major}.{minor} spans release lines {cands} "
                               f"(name one, e.g. {eg})")
        v = major, minor, int(m.group(3) or 0)
        norm = ".".join(map(str, v))
        if m.group(4) is not None:
            four = f"{norm}.{int(m.group(4))}"
            if four not in self.four_part:
                listed = ", ".join(self.four_part) or "none"
                raise BadInput(f"{where}: release {t!r} does not exist (four-part releases: {listed}; or name "
                               f"{norm})")
            norm = four
        return v, norm

    def resolve(self, text: str, where: str, stamp: Callable[[T, str], T], *, also: str = CORRECTED,
                name: str | None = None) -> T:
        """The line of one typed release, stamped with the release's name by `stamp` (cached per name).
        name: the name to stamp (default the normalised release)."""
        v, norm = self.parse(text, where, also)
        name = norm if name is None else name
        if name in self._cache:
            return self._cache[name]
        line = self.at(v)
        if line is None and v > self.last and v[0] == self.last[0]:
            line = self.lines[-1][2]
            warn(f"{where}: {self.label}release {text.strip()!r} is newer than the newest modelled one "
                 f"({span(*self.lines[-1][:2])}): it runs as the {line_name(line)} line")
        if line is None:
            raise BadInput(f"{where}: {self.label}release {text.strip()!r} is not modelled (modelled: "
                           f"{self.modelled}{self._also(also)}){self._did_you_mean(text.strip())}")
        self._cache[name] = stamp(line, name)
        return self._cache[name]


def split_many(text: str, where: str) -> list[str]:
    """The releases a comma list names, 'corrected' left out (it runs beside every release): at most 64."""
    parts = [p for p in text.split(",") if not is_corrected(p)]
    if len(parts) > MAX_NAMED:
        raise BadInput(f"{where}: {len(parts)} releases named; at most {MAX_NAMED} (or 'all')")
    return parts


def unique(items: Sequence[T], where: str, what: str = "release") -> list[T]:
    """The items in order, each once; none is bad input."""
    out: list[T] = []
    for x in items:
        if x not in out:
            out.append(x)
    if not out:
        raise BadInput(f"{where}: name at least one {what}")
    return out
