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


_CONN = ("distributed/kv_transfer/kv_connector/v1/nixl_connector.py", "distributed/kv_transfer/kv_connector/v1/nixl/*.py")


def _v(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split(".")[:3])


# ---- KV layout (vLLM #46204): what the connector asks for, what it compares ---------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_connector_asks_for_hnd_and_compares_advertised_layouts(release: str) -> None:
    """The connector requires HND (0.34: LBHNC) for non-MLA models and compares only the layout names (its own
    resolved one and P's metadata): a backend whose bytes are NHD anyway is never seen (scenario
    nhd-native-46204). The backend's stride order is not what the check reads."""
    conn = _flat(_text(release, *_CONN))
    utils = _flat(_text(release, "distributed/kv_transfer/kv_connector/utils.py"))
    if _v(release) < (0, 11, 0):
        assert 'kv_connector == "NixlConnector"' in utils and 'return "HND"' in utils
        assert "kv_cache_layout" not in re.sub(r"#.*", "", conn).split("class NixlAgentMetadata")[1].split("class ")[0]
    else:
        assert "def get_required_kvcache_layout" in conn
        assert ('return "LBHNC"' if _v(release) >= (0, 34) else 'return "HND"') in conn
        assert "nixl_agent_meta.kv_cache_layout != kv_cache_layout" in conn
        assert "get_kv_cache_stride_order" not in conn


@pytest.mark.parametrize("release", RELEASES)
def test_enable_permute_local_kv_limits(release: str) -> None:
    """enable_permute_local_kv (0.11.1+) applies only where the advertised layouts differ: remote HND into a local
    NHD cache (0.34: LBHNC into LBNHC); the same name on both sides never triggers it."""
    conn = _flat(_text(release, *_CONN))
    if _v(release) < (0, 11, 1):
        assert "enable_permute_local_kv" not in conn
        return
    assert "enable_permute_local_kv" in conn
    if _v(release) >= (0, 34):
        assert 'nixl_agent_meta.kv_cache_layout == "LBHNC"' in conn and 'kv_cache_layout == "LBNHC"' in conn
    else:
        assert 'nixl_agent_meta.kv_cache_layout == "HND"' in conn


# ---- block size P < D: D blocks read as sub-blocks, in get_mapped_blocks order ---------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_block_size_ratio_sub_blocks(release: str) -> None:
    """0.11.1+: local block b is read as sub-blocks b * ratio + i (Prepared.sub_blocks, transfer._mapped); P
    blocks larger than D's are refused (#42895 / nP > nD); 0.9.2 has no block_size_ratio."""
    conn = _flat(_text(release, *_CONN))
    if _v(release) < (0, 11, 1):
        assert "block_size_ratio" not in conn
        return
    body = conn.split("def get_mapped_blocks", 1)[1][:1500]
    assert "block_ids * block_size_ratio" in body and "arange(block_size_ratio)" in body
    assert "self.get_mapped_blocks(" in conn


# ---- from-logs: the lines pdcheck reads, rendered from each release's own format strings ------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_from_logs_reads_the_release_lines(release: str) -> None:
    from pdcheck import fromlogs

    conn = _flat(_text(release, *_CONN))
    cfg = _flat(_text(release, "config.py", "config/vllm.py"))
    # the engine config line: sizes and the cache dtype, by the names pdcheck reads
    keys = ["tensor_parallel_size=", "pipeline_parallel_size=", "kv_cache_dtype="]
    if _v(release) >= (0, 11):
        keys.append("data_parallel_size=")  # 0.9.2: only in the non-default args
    assert all(k in cfg for k in keys), [k for k in keys if k not in cfg]
    line = ("(EngineCore_DP0 pid=1) INFO 01-01 00:00:00 [core.py:1] Initializing a V1 LLM engine (v0) with config: "
            "model='m', dtype=torch.bfloat16, tensor_parallel_size=2, pipeline_parallel_size=2, "
            + ("data_parallel_size=2, " if "data_parallel_size=" in keys else "") + "kv_cache_dtype=fp8_e4m3, x=1")
    v = {k: f.value for k, f in fromlogs.parse([line], "x.log").fields.items()}
    assert v["tp_size"] == 2 and v["pp_size"] == 2 and v["cache_dtype"] == "fp8_e4m3"
    # Registering KV_Caches (use_mla), with the release's own format string
    m = re.search(r'"(Registering KV_Caches[^"]*)"', conn)
    assert m is not None
    fmt = m.group(1)
    n = fmt.count("%s")
    sample = fmt % tuple(["True", "cuda", "False", "64", "torch.Size([64, 576])", "torch.Size([64, 64, 576])"][:n])
    facts = fromlogs.parse([f"(Worker_TP0 pid=5) INFO 01-01 00:00:00 [x.py:1] {sample}"], "x.log")
    assert facts.fields["use_mla"].value is True and facts.fields["kv_heads"].value == 1
    # 0.26+: the layout and backend at INFO
    if 'logger.info("Detected kv cache layout %s"' in conn:
        assert _v(release) >= (0, 26)
        facts = fromlogs.parse(["(Worker_TP0 pid=5) INFO 01-01 00:00:00 [x.py:1] Detected kv cache layout LBHNC"],
                               "x.log")
        assert facts.fields["kv_cache_layout"].value == "LBHNC"
    # the DEBUG compat-hash line (0.13+)
    hm = re.search(r'"(NIXL compatibility hash: %s \(model=%s, dtype=%s, num_kv_heads=%d, cache_dtype=%s, '
                   r'attn_backend=%s\))"', conn)
    if _v(release) >= (0, 14):
        assert hm is not None
        text = hm.group(1) % ("abc", "m/x", "torch.bfloat16", 8, "fp8", "FLASH_ATTN")
        v = {k: f.value for k, f in fromlogs.parse([f"DEBUG 01-01 [x.py:1] {text}"], "x.log").fields.items()}
        assert v["kv_heads"] == 8 and v["cache_dtype"] == "fp8" and v["attn_backend"] == "FLASH_ATTN"
