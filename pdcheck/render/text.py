"""Text that pdcheck did not write (a peer's value, a document's key, a log line, a flag's value, an environment
variable), made safe for every output: one mechanism for the terminal, Markdown and HTML (docs/reliability.md,
"Pages, terminals and error lines").

Two steps, always in this order: `cut` bounds the length (and says how much there was), `visible` replaces every
character that is not printable with its backslash escape, so no control byte (ESC, BEL, CR, LF, ...), no C1
control (CSI 0x9b), no bidi override and no line or paragraph separator reaches a terminal or ends a Markdown
line. The writers (pdcheck.render.markdown, .html), the console (pdcheck.console), bounds.peer_text and the error
line (pdcheck.errors.one_line) all go through here. Nothing here imports pdcheck: every layer may use it.
"""

from __future__ import annotations

import re

ELLIPSIS = "…"
# What str.isprintable() calls unprintable: C0 and C1 controls, DEL, format characters (bidi overrides, zero-width
# joiners, soft hyphen, BOM), line and paragraph separators, surrogates (undecodable bytes under surrogateescape,
# which no encoder writes), unassigned and private-use code points, and every space but " ".
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_BAD_JSON = re.compile(r"[^\x20-\x7e]")  # candidates; each is checked with isprintable()


def _escape(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def visible(text: str, keep: str = "") -> str:
    """`text` with every unprintable character as its escape (`\\x1b`, `\\r`, `\\n`, `\\u202e`); the characters
    in `keep` (a page's or a message's own line breaks, "\\n") are left as they are. Printable text, the usual
    case, is returned as it is, at the cost of one str.isprintable()."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else _escape(c) for c in text)


def cut(text: str, limit: int) -> str:
    """At most `limit` characters of `text`, then, when more was there, `… (N characters)`: what was cut is said,
    never silently dropped."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}{ELLIPSIS} ({len(text)} characters)"


def clean(text: str, limit: int | None = None, keep: str = "") -> str:
    """cut, then visible: the one call for a string from outside pdcheck."""
    return visible(text if limit is None else cut(text, limit), keep)


def json_visible(text: str) -> str:
    """A JSON text (json.dumps, ensure_ascii=False) whose strings hold unprintable characters: each becomes its
    JSON escape (`\\u001b`, astral ones as a surrogate pair), so the document reads back the same and shows
    nothing raw (json.dumps escapes only C0, the quote and the backslash)."""
    def esc(m: re.Match[str]) -> str:
        c = m.group(0)
        if c.isprintable():
            return c
        n = ord(c)
        if n < 0x10000:
            return f"\\u{n:04x}"
        n -= 0x10000
        return f"\\u{0xd800 + (n >> 10):04x}\\u{0xdc00 + (n & 0x3ff):04x}"

    return text if text.isprintable() else _BAD_JSON.sub(esc, text)


def toml_string(text: str) -> str:
    """A TOML basic string that reads back as `text` and shows nothing raw: the quote and the backslash escaped,
    every unprintable character as a \\u or \\U escape (TOML refuses raw control characters; a lone surrogate,
    which TOML cannot spell, becomes U+FFFD)."""
    def esc(c: str) -> str:
        if c in '"\\':
            return "\\" + c
        if c.isprintable():
            return c
        n = 0xFFFD if 0xD800 <= ord(c) <= 0xDFFF else ord(c)
        return f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"

    return '"' + "".join(esc(c) for c in text) + '"'


def shell_word(arg: str, limit: int = 1024) -> str:
    """One argument of a command line to show and to paste: shlex.quote when printable, else bash's ANSI-C
    quoting ($'...'), which spells every unprintable character as an escape and still reproduces the argument."""
    import shlex

    arg = cut(arg, limit)
    if arg.isprintable():
        return shlex.quote(arg)
    body = "".join("\\\\" if c == "\\" else "\\'" if c == "'" else c if c.isprintable() else _shell_escape(c)
                   for c in arg)
    return f"$'{body}'"


def _shell_escape(c: str) -> str:
    """bash's $'...' spelling of one character: \\xHH writes a byte, so below 0x80 and for an undecodable byte of
    the command line (U+DC80..U+DCFF, Python's surrogateescape); \\u and \\U write the character (in the locale's
    encoding)."""
    n = ord(c)
    if 0xDC80 <= n <= 0xDCFF:
        return f"\\x{n - 0xDC00:02x}"
    return _escape(c) if n < 0x80 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def words_cut(line: str, word: int, total: int) -> str:
    """A message line whose long words (a 100 KB flag value echoed in an error) are cut one by one, keeping the
    rest of the line (the flag's name, what is wrong, the hint), then the whole line at `total`."""
    if len(line) <= word:
        return line
    parts = re.split(r"(\s+)", line)
    return cut("".join(p if len(p) <= word else cut(p, word) for p in parts), total)
