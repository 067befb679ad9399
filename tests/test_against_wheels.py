"""pdcheck's release models against vLLM's own code, read from unpacked wheels (skipped unless they are there).

    for v in 0.20.0 0.34.0; do pip download vllm==$v --no-deps -d /tmp/w$v &&
        mkdir -p /tmp/vllm-src/$v && unzip -q /tmp/w$v/*.whl 'vllm/*.py' -d /tmp/vllm-src/$v; done
    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_against_wheels.py

Every release found there from 0.11.1 runs a grid of P/D geometries through the wheel's topology calls and
`_validate_remote_agent_handshake` and through pdcheck's model: status, message and asserted expression must be
equal. The compatibility hash of the wheel's `compute_nixl_compatibility_hash` must equal compat_hash_for.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
from releasekit import run_rank, side
from wheelkit import Release, minor

from pdcheck.geometry import Geometry
from pdcheck.releases import compat_hash_for, resolve

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))
FOUND = sorted((p.name for p in SRC.glob("0.*") if (p / "vllm").is_dir()),
               key=lambda v: tuple(int(x) for x in v.split(".")))
pytestmark = pytest.mark.skipif(not FOUND, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")


def _validated_apart(release: str) -> bool:
    """Whether the release has _validate_remote_agent_handshake (0.11.1+), which wheelkit runs with the topology
    class add_remote_agent calls before it (TpKVTopology, inside the worker in 0.11.1 - 0.12, then TransferTopology)."""
    return any("def _validate_remote_agent_handshake" in p.read_text()
               for p in (SRC / release / "vllm/distributed/kv_transfer/kv_connector/v1").glob("**/*.py"))


# 0.9.x - 0.11.0 check the metadata inline in add_remote_agent, between the NIXL agent registration and the
# descriptor preparation: nothing there runs apart from NIXL. From 0.11.1 the checks run apart: wheelkit runs
# _nixl_handshake's asserts before add_remote_agent, the topology class and _validate_remote_agent_handshake.
_INLINE = "checks inline in add_remote_agent, between NIXL calls (no _validate_remote_agent_handshake before 0.11.1)"
CASES = [r if _validated_apart(r) else pytest.param(r, marks=pytest.mark.skip(reason=f"{r}: {_INLINE}"))
         for r in FOUND]
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
        o = run_rank(model, p, d, 0, enforce=False)
        mine = (o.status, o.message, o.assert_expr) if o.status == "assert" else (o.status, o.message)
        theirs = real.handshake(p, d)
        if mine != theirs:
            differ.append((p, d, theirs, mine))
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
