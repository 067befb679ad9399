"""transfer-bench's table fits the terminal: optional columns dropped (and named) until it does, never a
wrapped row or a broken header word. Rendered from a real run's --json document (tests/data)."""

from __future__ import annotations

import io
from pathlib import Path

import msgspec
import pytest
from rich.console import Console

from pdcheck.bench import output, schema

DOC = Path(__file__).parent / "data" / "bench-report.json"


def _render(width: int) -> str:
    rep = msgspec.json.decode(DOC.read_bytes(), type=schema.Report)
    buf = io.StringIO()
    output.render(rep, Console(file=buf, width=width, color_system=None))
    return buf.getvalue()


@pytest.mark.parametrize("width", [80, 100, 160])
def test_the_table_fits_the_width(width: int) -> None:
    out = _render(width)
    header = next(line for line in out.splitlines() if line.lstrip().startswith("bs "))
    assert len(header) <= width
    for word in ("GB/s", "p50(us)", "#wrong", "descs"):
        assert word in header  # the columns that say what a row measured stay, whole
    if width >= 160:
        assert "left out" not in out and "p999" in header
    else:
        assert "# left out to fit" in out and "p999" not in header
