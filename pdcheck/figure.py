"""--plot, for every command that draws: the file checked before anything runs, matplotlib (optional,
pdcheck[plot]) loaded only when a figure is drawn, files only (never a window), one error line if it cannot be
written."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from pdcheck.errors import BadInput

SUFFIXES = (".png", ".svg", ".pdf")


def check(path: Path) -> None:
    """Before anything runs: matplotlib there, and a file of a kind it writes in a directory that exists."""
    from pdcheck.bounds import check_out_file

    if importlib.util.find_spec("matplotlib") is None:
        raise BadInput("--plot needs matplotlib, which is not installed (pip install 'pdcheck[plot]')")
    if path.suffix.lower() not in SUFFIXES:
        raise BadInput(f"--plot {path}: name a {', '.join(SUFFIXES)} file")
    check_out_file("--plot", path)


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: Path) -> None:
    from pdcheck.bounds import open_out

    plt = pyplot()
    fig.tight_layout()
    try:
        with open_out("--plot", path) as f:  # checked before the run (check); never through a link or a FIFO
            fig.savefig(f, dpi=110, format=path.suffix.lower().lstrip("."))
    except OSError as exc:
        raise BadInput(f"--plot {path}: cannot write: {exc.strerror}") from exc
    finally:
        plt.close(fig)
