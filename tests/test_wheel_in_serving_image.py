"""pdcheck inside the image users already run: the built wheel (`pip wheel --no-deps .`) installs with
`--no-deps` into an environment that holds what a vLLM 0.34.0 serving image holds, pulls nothing more, and runs
`doctor`, `probe`, `serve`, `handshake` and `requests` there, from outside the clone, finding every bundled
scenario by name.

The environment is built from vLLM's own requirements (tests/data/serving-image/requires.txt, read from the
wheels' METADATA): a fresh venv whose only packages are a view (symlinks) of the base environment's
distributions that vLLM's requirements reach, plus the NIXL wheel the image installs itself. torch and NIXL are
not reinstalled (the base venv has them); nothing pdcheck's own requirements name is added by hand."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
from conftest import ROOT
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

# One worker builds the wheel and the environment for the module's tests (--dist loadgroup).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("serving-image")]
REQUIRES = ROOT / "tests" / "data" / "serving-image" / "requires.txt"
ROOT_DIST = "vllm"


def _facts() -> dict[str, list[Requirement]]:
    """dist -> the requirements the data file gives for it ('image' for what the image itself installs)."""
    out: dict[str, list[Requirement]] = {}
    for line in REQUIRES.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        who, _sep, req = line.partition(": ")
        out.setdefault(canonicalize_name(who.split()[0]), []).append(Requirement(req))
    return out


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**default_environment(), "extra": e}) for e in extras or {""})


def closure() -> set[str]:
    """Every distribution a vLLM 0.34.0 image installs that the base environment has: from vLLM's requirements
    and the image's NIXL, through the data file where it covers a dist (with the extras asked for) and the
    installed metadata elsewhere."""
    facts = _facts()
    todo: list[tuple[str, set[str]]] = [(ROOT_DIST, set()), ("image", set())]
    seen: set[str] = set()
    while todo:
        name, extras = todo.pop()
        name = canonicalize_name(name)
        key = f"{name}[{','.join(sorted(extras))}]"
        if key in seen:
            continue
        seen.add(key)
        if name in facts:
            reqs = facts[name]
        else:
            try:
                reqs = [Requirement(r) for r in metadata.requires(name) or []]
            except metadata.PackageNotFoundError:
                continue
        for r in reqs:
            if _applies(r, extras):
                todo.append((r.name, set(r.extras)))
    installed = set()
    for key in seen:
        name = key.split("[")[0]
        try:
            metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        installed.add(name)
    return installed - {"image"}


def _top_levels(dist: metadata.Distribution) -> set[str]:
    return {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")} - {"__pycache__"}


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path, dict[str, str]]]:
    """(the venv's bin, the built wheel, the environment to run it with)."""
    tmp = tmp_path_factory.mktemp("serving")
    # Built from a copy of the sources: setuptools builds in ./build, which another copy of the suite building
    # at the same time would share (pdcheck/scenarios, a link to the clone's scenarios/, is copied as files).
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "pdcheck", src / "pdcheck", ignore=shutil.ignore_patterns("__pycache__"))
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(src)],
                 tmp, dict(os.environ))
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("pdcheck-*.whl")
    view = tmp / "image-site-packages"
    view.mkdir()
    for name in sorted(closure()):
        dist = metadata.distribution(name)
        base = Path(str(dist.locate_file("")))
        for top in _top_levels(dist):
            if (base / top).exists() and not (view / top).exists():
                (view / top).symlink_to(base / top)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = (venv / "lib").glob("python3*/site-packages")
    (site / "_image.pth").write_text(f"{view}\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}:{env['PATH']}"
    inst = _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "--no-deps",
                 "--no-index", str(wheel)], tmp, env)
    assert inst.returncode == 0, inst.stdout + inst.stderr
    assert re.search(r"^Successfully installed pdcheck-[\d.]+$", inst.stdout, re.M), inst.stdout  # nothing more
    yield venv / "bin", wheel, env


def test_what_pdcheck_requires_is_in_the_serving_image() -> None:
    """Each of pdcheck's install requirements is reached from vLLM's own: numpy, pyzmq, msgspec and torch
    directly, typer (and through it rich) by fastapi[standard] -> fastapi-cli[standard], NIXL from the image."""
    have = closure()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    missing = [r for r in pyproject["project"]["dependencies"] if canonicalize_name(Requirement(r).name) not in have]
    assert not missing, f"not in a vLLM 0.34.0 image: {missing}"
    assert {"torch", "nixl-cu13", "typer", "rich"} <= have


def test_the_wheel_carries_every_bundled_scenario_folder(serving) -> None:
    _bin, wheel, _env = serving
    names = set(zipfile.ZipFile(wheel).namelist())
    in_clone = {f"pdcheck/scenarios/{p.relative_to(ROOT / 'scenarios')}" for p in (ROOT / "scenarios").rglob("*.toml")}
    assert in_clone and not in_clone - names, f"missing from the wheel: {sorted(in_clone - names)[:10]}"


def test_the_installed_wheel_runs_there(serving, tmp_path: Path) -> None:
    bin_, _wheel, env = serving
    pdcheck = str(bin_ / "pdcheck")
    where = _run([str(bin_ / "python"), "-c", "import pdcheck, nixl_cu13, torch, zmq, msgspec, typer, rich; "
                  "print(pdcheck.__file__)"], tmp_path, env)
    assert where.returncode == 0 and "venv/lib" in where.stdout and str(ROOT) not in where.stdout, where
    # every bundled scenario by name, from outside the clone
    listed = _run([pdcheck, "list", "scenarios", "--json"], tmp_path, env)
    assert listed.returncode == 0, listed.stderr
    scenarios = json.loads(listed.stdout)["scenarios"]
    assert {s["name"] for s in scenarios} == {p.stem for p in (ROOT / "scenarios").rglob("*.toml")}
    first: dict[tuple[str, str], str] = {}  # one scenario of each framework and phase, run by name from there
    for s in sorted(scenarios, key=lambda s: s["name"]):
        first.setdefault((s["framework"], s["phase"]), s["name"])
    assert len({fw for fw, _phase in first}) >= 3, first
    for (fw, phase), name in sorted(first.items()):
        cmd = "requests" if phase == "requests" else "handshake"
        # --no-transfer (the wire alone) is vLLM's handshake option; the other frameworks run their transfer
        args = [pdcheck, cmd, name, "--json"] + (["--no-transfer"] if (fw, cmd) == ("vllm", "handshake") else [])
        r = _run(args, tmp_path, env)
        assert r.returncode in (0, 1) and json.loads(r.stdout)["exit_code"] == r.returncode, (name, r.stderr[-2000:])
    seed = _run([pdcheck, "handshake", "seed-19338-tp8", "--vllm", "0.9.1", "--json"], tmp_path, env)
    assert seed.returncode == 1 and json.loads(seed.stdout)["exit_code"] == 1, seed.stderr[-2000:]
    doctor = _run([pdcheck, "doctor", "--json"], tmp_path, env)
    assert doctor.returncode in (0, 1), doctor.stderr[-2000:]
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}
    assert checks["loopback transfer (host memory)"] == "PASS", checks
    # serve there, and probe it from there
    serve = subprocess.Popen([pdcheck, "serve", "hetero-p4-d2", "--vllm", "0.11.1", "--json"], cwd=tmp_path, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = json.loads(serve.stdout.readline())  # type: ignore[union-attr]
        probe = _run([pdcheck, "probe", f"{ready['host']}:{ready['base_port']}", "--vllm", "0.11.1", "--prefill-tp",
                      "4", "--scenario", "hetero-p4-d2", "--json"], tmp_path, env)
        assert probe.returncode in (0, 1), probe.stderr[-2000:]
        assert [r["status"] for r in json.loads(probe.stdout)["prefill_ranks"]] == ["ok"] * 4
    finally:
        serve.terminate()
        serve.communicate(timeout=60)
