"""What each install path of pdcheck puts on disk, from this environment's installed distributions (their
RECORD files; nothing is downloaded): a plain `pip install pdcheck-*.whl` (pdcheck's requirements and theirs:
nixl-cu13 requires torch, and the torch pip installs brings the CUDA 13 wheels), `pip install --no-deps` into a
serving image that already has them (pdcheck alone), and the `[test]` extra on top of the plain install.

    python benchmarks/install_size.py        # prints one line per path (README "Installing", docs/live-deployments.md)
"""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def dist_bytes(name: str) -> int:
    dist = metadata.distribution(name)
    total = 0
    for f in dist.files or []:
        p = Path(str(dist.locate_file(f)))
        try:
            total += p.stat().st_size
        except OSError:
            pass
    return total


def closure(roots: list[str]) -> set[str]:
    seen: set[str] = set()
    todo = [(Requirement(r).name, set(Requirement(r).extras)) for r in roots]
    while todo:
        name, extras = todo.pop()
        name = canonicalize_name(name)
        if name in seen:
            continue
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in reqs:
            r = Requirement(text)
            env = [{**default_environment(), "extra": e} for e in (extras or {""})]
            if r.marker is None or any(r.marker.evaluate(x) for x in env):
                todo.append((r.name, set(r.extras)))
    return seen


def main() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    plain = closure(project["dependencies"])
    test = closure(project["dependencies"] + project["optional-dependencies"]["test"]) - plain
    gib = 1024 ** 3
    biggest = sorted(plain, key=dist_bytes, reverse=True)[:4]
    print(f"pip install pdcheck (plain): {sum(map(dist_bytes, plain)) / gib:.1f} GiB in {len(plain)} distributions; "
          "largest: " + ", ".join(f"{n} {dist_bytes(n) / gib:.2f} GiB" for n in biggest))
    own = sum(f.stat().st_size for f in (ROOT / "pdcheck").rglob("*") if f.is_file() and "__pycache__" not in f.parts
              and f.suffix in (".py", ".toml"))  # what the wheel installs: the package and its scenarios
    print(f"pip install --no-deps into a serving image: {own / 1024 ** 2:.1f} MiB (pdcheck alone: its modules and "
          "bundled scenarios)")
    print(f"the [test] extra on top: {sum(map(dist_bytes, test)) / gib:.2f} GiB in {len(test)} distributions")


if __name__ == "__main__":
    main()
