"""Print the README's commands, as its first code block writes them (one per line): what .ci/run runs, so that CI
runs exactly what a new user types. `readme_commands.py N` prints the Nth only (1-based)."""

from __future__ import annotations

import pathlib
import re
import sys

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def commands(text: str) -> list[str]:
    """The lines of the first fenced code block."""
    m = re.search(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
    if m is None:
        raise SystemExit("README.md has no code block")
    return [ln for ln in m.group(1).splitlines() if ln.strip()]


if __name__ == "__main__":
    found = commands(README.read_text(encoding="utf-8"))
    print(found[int(sys.argv[1]) - 1] if len(sys.argv) > 1 else "\n".join(found))
