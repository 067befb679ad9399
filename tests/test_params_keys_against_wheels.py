"""The one kv_transfer_params keys table (pdcheck.vllm.releases.params) against each release's own request_finished,
read from unpacked wheels (opt-in: skipped unless PDCHECK_VLLM_SRC names a directory of them):

    for v in 0.9.0 0.13.0 0.29.0 0.33.0 0.34.0; do pip download vllm==$v --no-deps -d /tmp/w$v &&
        mkdir -p /tmp/vllm-src/$v && unzip -q /tmp/w$v/*.whl 'vllm/*.py' -d /tmp/vllm-src/$v; done
    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_params_keys_against_wheels.py

The keys (in the release's order) of the dict that P's scheduler returns, pull (NixlConnectorScheduler, from 0.24
NixlPullConnectorScheduler) and push (NixlPushConnectorScheduler, 0.24+), against the table and against what
serve and the request path (pull and push) hand out for that release.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from pdcheck.releaseline import version_tuple
from pdcheck.vllm.releases import params, resolve
from pdcheck.vllm.requests import lines, push
from pdcheck.vllm.scenario import load
from pdcheck.vllm.serve import transfer_params

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))
V1 = "vllm/distributed/kv_transfer/kv_connector/v1"
RELEASES = sorted((p.name for p in SRC.glob("0.*") if (p / V1).is_dir() and version_tuple(p.name) >= (0, 9, 0)),
                  key=version_tuple)
pytestmark = pytest.mark.skipif(not RELEASES, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")


def _returned_keys(release: str, scheduler_class: str) -> tuple[str, ...] | None:
    """The keyword names of the `dict(...)` request_finished of `scheduler_class` returns; None: no such class."""
    root = SRC / release / V1
    for path in [root / "nixl_connector.py", *sorted((root / "nixl").glob("*.py"))]:
        if not path.is_file():
            continue
        for cls in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(cls, ast.ClassDef) and cls.name == scheduler_class):
                continue
            fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "request_finished")
            found = [tuple(k.arg for k in v.keywords if k.arg) for n in ast.walk(fn)
                     if isinstance(n, ast.Return) and isinstance(n.value, ast.Tuple)
                     for v in n.value.elts if isinstance(v, ast.Call) and getattr(v.func, "id", "") == "dict"]
            assert len(set(found)) == 1, f"{release}: {scheduler_class}.request_finished returns {found}"
            return found[0]
    return None


def _pull(release: str) -> tuple[str, ...]:
    got = _returned_keys(release, "NixlPullConnectorScheduler") or _returned_keys(release, "NixlConnectorScheduler")
    assert got is not None, f"{release}: no NIXL connector scheduler found"
    return got


@pytest.fixture(scope="module")
def scenario():  # type: ignore[no-untyped-def]
    return load(None, {"prefill": {"num_blocks": 100}, "decode": {"num_blocks": 100}})


@pytest.mark.parametrize("release", RELEASES)
def test_pull_keys_are_the_release_keys(release: str, scenario) -> None:  # type: ignore[no-untyped-def]
    theirs = _pull(release)
    assert params.pull_keys(release) == theirs, f"{release}: the wheel returns {theirs}"
    assert tuple(transfer_params(scenario, resolve(release), "h", 1, 4096)) == theirs  # serve
    assert lines.line_of(release).keys == theirs  # the request path (pull)


@pytest.mark.parametrize("release", RELEASES)
def test_push_keys_are_the_release_keys(release: str) -> None:
    theirs = _returned_keys(release, "NixlPushConnectorScheduler") or ()
    assert params.push_keys(release) == theirs, f"{release}: the wheel's push scheduler returns {theirs}"
    if theirs:
        assert push.keys(lines.line_of(release)) == theirs  # the request path (push)
