"""pdcheck's release models against vLLM's own code, read from unpacked wheels (skipped unless they are there).

    for v in 0.20.0 0.34.0; do pip download vllm==$v --no-deps -d /tmp/w$v &&
        mkdir -p /tmp/vllm-src/$v && unzip -q /tmp/w$v/*.whl 'vllm/*.py' -d /tmp/vllm-src/$v; done
    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_against_wheels.py

Every release found there runs a grid of P/D geometries through the wheel's handshake code (from 0.11.1 the
topology calls and `_validate_remote_agent_handshake`, before it `_nixl_handshake` and add_remote_agent with
stand-ins for NIXL and ZMQ) and through pdcheck's model: status, message and asserted expression must be
equal. The compatibility hash of the wheel's `compute_nixl_compatibility_hash` must equal compat_hash_for.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
from pathlib import Path

import pytest
from releasekit import run_rank, side
from wheelkit import Release, minor

from pdcheck.geometry import Geometry
from pdcheck.vllm.releases import compat_hash_for, resolve

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))
FOUND = sorted((p.name for p in SRC.glob("0.*") if (p / "vllm").is_dir()),
               key=lambda v: tuple(int(x) for x in v.split(".")))
pytestmark = pytest.mark.skipif(not FOUND, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")


@functools.cache  # it reads the connector's files: once per release, not once per grid case
def _validated_apart(release: str) -> bool:
    """Whether the release has _validate_remote_agent_handshake (0.11.1+), which wheelkit runs with the topology
    class add_remote_agent calls before it (TpKVTopology, inside the worker in 0.11.1 - 0.12, then TransferTopology)."""
    return any("def _validate_remote_agent_handshake" in p.read_text()
               for p in (SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1").glob("**/*.py"))


# From 0.11.1 the checks run apart: wheelkit runs _nixl_handshake's asserts before add_remote_agent, the topology
# class and _validate_remote_agent_handshake. 0.9.x - 0.11.0 check the metadata inline in add_remote_agent,
# between NIXL calls: wheelkit runs _nixl_handshake and add_remote_agent as the wheel has them with a stand-in
# NIXL agent and ZMQ socket. The stand-ins are fakes: this compares pdcheck's model with the release's own pure
# checks, not NIXL. There _nixl_handshake picks the P rank(s) itself, so the last D rank runs too.
CASES = FOUND
# the compatibility hash: compute_nixl_compatibility_hash from 0.13; before it no hash is sent (compat_hash_for None)
HASH_CASES = FOUND
MLA = {"mla": True, "kv_heads": 1, "backend": "FLASHMLA"}


def _grid(release: str):  # noqa: ANN202 - a generator of (P, D) sides
    layouts = [("HND", "HND"), ("NHD", "NHD"), ("NHD", "HND")]
    if minor(release) >= 29:
        layouts = [("LBHNC", "LBHNC"), ("LBNHC", "LBNHC"), ("LBNHC", "LBHNC"), ("BLHNC", "BLHNC"), ("LHBNC", "LHBNC")]
    for p_tp, d_tp, heads, (pl, dl), mla, p_head, p_bs in itertools.product(
            (1, 2, 3, 4, 8), (1, 2, 4, 6, 8), (1, 2, 8), layouts, (False, True), (128, 64), (16, 8, 32)):
        if mla:
            p = side("P", p_tp, 3000, layout=pl, block_size=p_bs, **{**MLA, "kv_heads": heads},
                     head_dim=576 if p_head == 128 else 512)
            d = side("D", d_tp, 3000, layout=dl, **{**MLA, "kv_heads": heads}, head_dim=576)
        else:
            p = side("P", p_tp, 3000, kv_heads=heads, layout=pl, block_size=p_bs, head_dim=p_head)
            d = side("D", d_tp, 3000, kv_heads=heads, layout=dl)
        yield p, d


@pytest.mark.parametrize("release", CASES)
def test_validation_matches_the_wheel(release: str) -> None:
    real = Release(SRC, release)
    model = resolve(release)
    differ = []
    for p, d in _grid(release):
        for r in sorted({0, d.tp - 1}) if not _validated_apart(release) else [0]:
            o = run_rank(model, p, d, r, enforce=False)
            mine = (o.status, o.message, o.assert_expr) if o.status == "assert" else (o.status, o.message)
            if o.status in ("hang", "timeout"):  # no P rank listens there: which rank, and whether D waits forever
                mine = (o.status, re.search(r"P rank \d+", o.message or "")[0])
            theirs = real.handshake(p, d, r)
            if mine != theirs:
                differ.append((p, d, r, theirs, mine))
    assert not differ, f"{len(differ)} cases differ, first: {differ[0]}"


@pytest.mark.parametrize("release", HASH_CASES)
def test_compat_hash_matches_the_wheel(release: str) -> None:
    g = Geometry(tp_size=2, block_size=16, layers=2, total_kv_heads=8, head_dim=128, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False)
    hashed = any("def compute_nixl_compatibility_hash" in p.read_text()
                 for p in (SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1").glob("**/*.py"))
    if not hashed:  # the release neither computes nor sends a compatibility hash
        assert compat_hash_for(resolve(release), g) is None
        return
    # VllmConfig leaves the hybrid KV cache manager on with NixlConnector from 0.22 (GPU platform)
    want = Release(SRC, release).compat_hash(model="pdcheck/fake-model", dtype="torch.bfloat16", num_kv_heads=8,
                                             head_size=128, layers=2, backend="FLASH_ATTN",
                                             hma_disabled=minor(release) < 22)
    assert compat_hash_for(resolve(release), g) == want
