"""Opt-in: the per-release shape facts pdcheck quotes (releases.shapes, ports.dp_engine_id) against the wheels' own
source. PDCHECK_VLLM_SRC=DIR with DIR/<release>/vllm/... unpacked from each wheel (see test_against_wheels.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from pdcheck.releases import hybrid, resolve, shapes

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


# ---- hybrid models (releases.hybrid) ------------------------------------------------------------------------
def _conn(release: str) -> str:
    return _flat(_text(release, "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
                       "distributed/kv_transfer/kv_connector/v1/nixl/*.py"))


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_hma_with_nixl(release: str) -> None:
    """Whether the hybrid manager stays on with NixlConnector (SupportsHMA), and the explicit-enable refusal."""
    rel = resolve(release)
    conn = _conn(release)
    supports = bool(re.search(r"class Nixl\w*Connector\([^)]*SupportsHMA", conn))
    assert supports == hybrid.supports_hma(rel)
    config = _flat(_text(release, "config.py", "config/vllm.py"))
    assert "disable_hybrid_kv_cache_manager" in config and "kv_transfer_config is not None" in config
    factory = _flat(_text(release, "distributed/kv_transfer/kv_connector/factory.py"))
    if not supports and hybrid._v(rel) >= (0, 14):
        # the explicit --no-disable-hybrid-kv-cache-manager reaches the factory's check (None means "no preference")
        assert "disable_hybrid_kv_cache_manager: bool | None = None" in _text(release, "config/scheduler.py")
        assert hybrid.MSG_NOT_HMA.split(": ", 1)[1].replace("NixlConnector", "{connector_cls.__name__}") in factory


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_unify_refusal_10741(release: str) -> None:
    """What a Mamba model with the manager off meets at start-up: the unify ValueError, or (0.34) the worker's
    bare assert."""
    rel = resolve(release)
    core = _flat(_text(release, "v1/core/kv_cache_utils.py", "v1/core/kv_cache_planning.py"))
    from pdcheck.geometry import Geometry, KVGroup

    g = Geometry(tp_size=1, block_size=16, layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False, hma=False, ssm_conv_layout="DS",
                 groups=(KVGroup(kind="full", layers=1), KVGroup(kind="mamba", layers=1)))
    said = hybrid.startup_refusal(rel, g)
    unify = hybrid.MSG_UNIFY.split(": ", 1)[1]
    assert hybrid.MSG_UNIFIED.split(" (e.g.")[0] in core  # the warning of the sliding-window conversion
    if said == hybrid.MSG_UNIFY:
        assert unify in core
    else:
        assert said == hybrid.MSG_HMA_REQUIRED
        assert unify not in core
        assert re.search(r"if self\._has_mamba:\s*assert self\._is_hma_required\b", _conn(release))


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_transfer_facts(release: str) -> None:
    """Sliding-window clipping, the conv layout refusal, HMA's block-size assert, is_hma_enabled hashed."""
    rel = resolve(release)
    conn = _conn(release)
    clips = "cdiv(n_tokens, block_size) + 1 if n_tokens else 0" in conn
    assert clips == hybrid.supports_hma(rel)
    assert (hybrid.MSG_DS_LAYOUT.split(": ", 1)[1] in conn) == hybrid.supports_hma(rel)
    from pdcheck.geometry import Geometry, KVGroup

    g = Geometry(tp_size=1, block_size=32, layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False,
                 groups=(KVGroup(kind="full", layers=1), KVGroup(kind="sliding_window", layers=1, window=64)))
    assert (hybrid.handshake_refusal(rel, g, 16) is not None) == (hybrid.MSG_HMA_BLOCK_SIZE in conn)
    hashed = "is_hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager" in conn
    assert hashed == ("is_hma_enabled" in rel.hash_factors)


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_metadata_fields(release: str) -> None:
    """ssm_sizes and region_group_ids are in the release's NixlAgentMetadata exactly where its wire schema has them."""
    from pdcheck.wire import FORMATS
    from pdcheck.wire.schemas import field_names

    rel = resolve(release)
    conn = _conn(release)
    m = re.search(r"class NixlAgentMetadata\b.*?(?=\n(?:class|def|@) )", conn, re.S)
    assert m, "no NixlAgentMetadata"
    body = m.group(0)
    ours = field_names(FORMATS[rel.wire].schema_type)
    for name in ("ssm_sizes", "region_group_ids"):
        assert (re.search(rf"^\s+{name}:", body, re.M) is not None) == (name in ours), name


def _function(release: str, rel_path: str, name: str) -> Any:
    """One function (or method) of the wheel, compiled on its own from its source text (no vLLM import)."""
    import ast
    import textwrap

    path = SRC / release / "vllm" / rel_path
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    src = textwrap.dedent(ast.get_source_segment(path.read_text(), node) or "")
    ns: dict[str, Any] = {"BlockIds": Any, "Any": Any}
    exec(compile("from __future__ import annotations\n" + src, str(path), "exec"), ns)  # noqa: S102
    return ns[name]


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_clipping_runs_as_the_wheel_does(release: str) -> None:
    """The wheel's own get_sw_clipped_blocks (0.34: get_exchange_clipped_blocks; P's scheduler) on a full + sliding-window + Mamba
    request: the blocks it keeps per group are the ones releases.hybrid.group_reads says D reads (plus D's one
    state page for Mamba, which 0.26 trims on D in _apply_prefix_caching)."""
    from types import SimpleNamespace as NS

    from pdcheck.geometry import Geometry, KVGroup

    rel = resolve(release)
    conn = _conn(release)
    name = next((n for n in ("get_sw_clipped_blocks", "get_exchange_clipped_blocks") if f"def {n}(" in conn), None)
    if not hybrid.supports_hma(rel):
        assert name is None
        return
    assert name is not None
    clip = _function(release, "distributed/kv_transfer/kv_connector/v1/nixl/base_scheduler.py", name)
    g = Geometry(tp_size=1, block_size=16, layers=3, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False, ssm_conv_layout="DS",
                 groups=(KVGroup(kind="full", layers=1), KVGroup(kind="sliding_window", layers=1, window=64),
                         KVGroup(kind="mamba", layers=1)))
    n_sw = hybrid.sw_blocks(64, 16)
    me = NS(_is_hma_required=True, blocks_per_sw=[0, n_sw, 0], _ssm_spec_blocks=[None, None, 0],
            kv_cache_config=NS(select_transfer_block_ids=lambda b: b))
    clip.__globals__["clip_ssm_state_blocks"] = _function(
        release, "distributed/kv_transfer/kv_connector/utils.py", "clip_ssm_state_blocks") \
        if "def clip_ssm_state_blocks" in _text(release, "distributed/kv_transfer/kv_connector/utils.py") else None
    blocks = (list(range(100, 132)), list(range(200, 232)), list(range(300, 332)))
    kept = clip(me, blocks)
    reads = hybrid.group_reads(rel, g)
    assert [r.count for r in reads] == [None, n_sw, 1]
    for r, got, whole in zip(reads, kept, blocks, strict=True):
        if r.count is None:
            assert list(got) == whole
        elif g.groups[r.group].kind == "sliding_window":
            assert list(got) == whole[-r.count:]
        else:  # Mamba: 0.34 keeps the running-state slot, 0.26 sends all and D keeps the last
            assert list(got)[-1:] == whole[-1:] and len(got) in (1, len(whole))
