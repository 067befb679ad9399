"""Opt-in: the per-release shape facts pdcheck quotes (releases.shapes, ports.dp_engine_id) against the wheels' own
source. PDCHECK_VLLM_SRC=DIR with DIR/<release>/vllm/... unpacked from each wheel (see test_against_wheels.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from pdcheck.releases import resolve, shapes

SRC = Path(os.environ.get("PDCHECK_VLLM_SRC", "/nonexistent"))
RELEASES = sorted((p.name for p in SRC.glob("0.*") if (p / "vllm").is_dir()),
                  key=lambda v: tuple(int(x) for x in v.split(".")[:3]))
pytestmark = pytest.mark.skipif(not RELEASES, reason="set PDCHECK_VLLM_SRC to a directory of unpacked vLLM wheels")


def _text(release: str, *globs: str) -> str:
    root = SRC / release / "vllm"
    return "\n".join(p.read_text(errors="replace") for g in globs for p in sorted(root.glob(g)))


def _flat(text: str) -> str:
    """Source with adjacent string literals joined, so a message split over lines reads as one."""
    return re.sub(r'"\s*\n\s*f?"', "", text)


@pytest.mark.parametrize("release", RELEASES)
def test_dp_engine_id_suffix(release: str) -> None:
    src = _text(release, "v1/engine/*.py")
    assert re.search(r'engine_id\}_dp\{(local_dp_rank|dp_rank)\}', src), "no _dp<N> engine-id suffix"


@pytest.mark.parametrize("release", RELEASES)
def test_pp_facts(release: str) -> None:
    rel = resolve(release)
    conn = _flat(_text(release, "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
                       "distributed/kv_transfer/kv_connector/v1/nixl/*.py"))
    base = _flat(_text(release, "distributed/kv_transfer/kv_connector/v1/base.py"))
    if rel.wire >= "H":
        assert shapes.MSG_PP_DECODE.split(": ", 1)[1] in conn
        assert "def set_xfer_handshake_metadata_pp_aware" in conn  # NixlConnector overrides the base refusal
        assert "received pp_rank > 0 handshake metadata but does not support PP-disaggregated KV transfer." in base
    else:
        assert "pp_aware" not in conn and "pipeline_parallel_size > 1" not in conn


@pytest.mark.parametrize("release", RELEASES)
def test_block_size_message(release: str) -> None:
    rel = resolve(release)
    src = _flat(_text(release, "distributed/kv_transfer/kv_connector/utils.py",
                      "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
                      "distributed/kv_transfer/kv_connector/v1/nixl/*.py"))
    text = shapes.block_size_effect(rel, 32, 16)
    if text is None:
        return
    if "nP > nD" in text:
        assert "nP > nD is not supported yet." in src
    else:
        assert ("Local block size {self.block_size} is not divisible by remote block size {remote_block_size} or "
                "vice versa.") in src
