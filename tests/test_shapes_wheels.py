"""Opt-in: the per-release shape facts pdcheck quotes (releases.shapes, ports.dp_engine_id) against the wheels' own
source. PDCHECK_VLLM_SRC=DIR with DIR/<release>/vllm/... unpacked from each wheel (see test_against_wheels.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from pdcheck.vllm import ports
from pdcheck.vllm.releases import hybrid, multinode, resolve, shapes

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
    """Whether the engine core names each DP rank's engine `<id>_dp<N>` (0.9.1+) or keeps the configured id for
    every DP rank (0.9.0), as ports.dp_engine_id says for the release."""
    src = _text(release, "v1/engine/*.py")
    suffixed = bool(re.search(r'engine_id\}_dp\{(local_dp_rank|dp_rank)\}', src))
    assert suffixed or not re.search(r"_dp\{(local_dp_rank|dp_rank)\}", src)
    want = "E_dp1" if suffixed else "E"
    assert ports.dp_engine_id("E", 1, 2, resolve(release)) == want
    assert ports.dp_engine_id("E", 0, 1, resolve(release)) == "E"


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
def test_pp_prefill_stages(release: str) -> None:
    """Which P stage's metadata D receives (shapes.served_stage / asked_stages), whether pull P names pp_size in
    its params, and the layer check one stage's metadata trips (shapes.layer_check), each read in the wheel."""
    rel = resolve(release)
    conn = _flat(_text(release, "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
                       "distributed/kv_transfer/kv_connector/v1/nixl/*.py"))
    pull = _flat(_text(release, "distributed/kv_transfer/kv_connector/v1/nixl_connector.py",
                       "distributed/kv_transfer/kv_connector/v1/nixl/scheduler.py",
                       "distributed/kv_transfer/kv_connector/v1/nixl/pull_scheduler.py"))
    core = _text(release, "v1/engine/core.py")
    keyed = "encoded_data[(target_pp_rank, target_tp_rank)]" in conn
    assert keyed == (rel.wire >= shapes.PP_STAGES_KEYED)
    assert ("range(remote_pp_size)" in conn) == keyed  # D asks every stage remote_pp_size names
    if keyed:
        assert 'kv_transfer_params.get("pp_size", 1)' in conn
    elif "content.update(worker_dict)" in core:  # F - G: the last worker's {tp_rank: ...} wins
        assert shapes.served_stage(rel.wire, 2) == 1
    else:  # A - E: one listener per worker on base_port + tp_rank
        assert re.search(r"port = envs\.VLLM_NIXL_SIDE_CHANNEL_PORT \+ rank|base_port \+ tp_rank\)", conn)
        assert "get_tensor_model_parallel_rank()" in conn and shapes.served_stage(rel.wire, 2) == 0
    names_pp = "pp_size=self.vllm_config.parallel_config.pipeline_parallel_size" in pull
    assert names_pp == (shapes.params_pp_size(rel, 2) is not None)
    check = shapes.layer_check(rel)
    assert ("does not hold the KV layers" in conn) == (check == "layers_held")
    if check == "num_kv_layers":
        assert f'"{shapes.MSG_PP_LAYERS}"' in conn
    elif check == "kv_caches_base_addr_len":
        assert re.search(r"assert len\(nixl_agent_meta\.kv_caches_base_addr\) == len\(\s*self\.block_len_per_layer",
                         conn)
    elif check is None:
        assert "len(nixl_agent_meta.kv_caches_base_addr) ==" not in conn and shapes.MSG_PP_LAYERS not in conn


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
    config = _flat(_text(release, "config.py", "config/vllm.py", "config/__init__.py"))
    if _v(release) < (0, 9, 1):  # 0.9.0 has no hybrid manager (nor its flag) at all
        assert "disable_hybrid_kv_cache_manager" not in config and not supports
        return
    assert "disable_hybrid_kv_cache_manager" in config and "kv_transfer_config is not None" in config
    factory = _flat(_text(release, "distributed/kv_transfer/kv_connector/factory.py"))
    if not supports and rel.number >= (0, 14):
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
    if said == hybrid.MSG_NO_V1_MAMBA:  # 0.9.0: no Mamba spec in V1, the engine args turn the model away
        assert "class MambaSpec" not in _text(release, "v1/kv_cache_interface.py") and unify not in core
        args = _text(release, "engine/arg_utils.py")
        assert "VLLM_USE_V1=1 is not supported with {feature_name}." in args and "is_v1_compatible" in args
        return
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
    from pdcheck.geometry import Geometry, KVGroup

    # the manager explicitly on (0.18 - 0.21 need the flag; 0.14 - 0.17 refuse it at start-up, <= 0.13 ignore it)
    mamba = Geometry(tp_size=1, block_size=16, layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                     attn_backend="FLASH_ATTN", use_mla=False, hma=True, ssm_conv_layout="SD",
                     groups=(KVGroup(kind="full", layers=1), KVGroup(kind="mamba", layers=1)))
    ds = re.search(r"assert is_conv_state_dim_first\(\), \(\s*\"" +
                   re.escape(hybrid.MSG_DS_LAYOUT.split(": ", 1)[1]), conn)
    assert (hybrid.startup_refusal(rel, mamba) == hybrid.MSG_DS_LAYOUT) == (ds is not None)
    g = Geometry(tp_size=1, block_size=32, layers=2, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False, hma=True,
                 groups=(KVGroup(kind="full", layers=1), KVGroup(kind="sliding_window", layers=1, window=64)))
    asserts = re.search(r"if self\._is_hma_required:\s*assert block_size_ratio == 1, \(\s*\"" +
                        re.escape(hybrid.MSG_HMA_BLOCK_SIZE), conn)
    assert (hybrid.handshake_refusal(rel, g, 16) is not None) == (asserts is not None)
    hashed = "is_hma_enabled = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager" in conn
    assert hashed == ("is_hma_enabled" in rel.hash_factors)


@pytest.mark.parametrize("release", RELEASES)
def test_hybrid_metadata_fields(release: str) -> None:
    """ssm_sizes and region_group_ids are in the release's NixlAgentMetadata exactly where its wire schema has them."""
    from pdcheck.vllm.wire import FORMATS
    from pdcheck.vllm.wire.schemas import field_names

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
    # nixl_connector.py (0.18 - 0.19), nixl/scheduler.py (0.20 - 0.23), nixl/base_scheduler.py (0.24+)
    where = next(p for g in _CONN for p in sorted((SRC / release / "vllm").glob(g)) if f"def {name}(" in p.read_text())
    clip = _function(release, str(where.relative_to(SRC / release / "vllm")), name)
    g = Geometry(tp_size=1, block_size=16, layers=3, total_kv_heads=1, head_dim=64, dtype="bfloat16",
                 attn_backend="FLASH_ATTN", use_mla=False, hma=True, ssm_conv_layout="DS",
                 groups=(KVGroup(kind="full", layers=1), KVGroup(kind="sliding_window", layers=1, window=64),
                         KVGroup(kind="mamba", layers=1)))
    n_sw = hybrid.sw_blocks(64, 16)
    # _ssm_state_slots_are_positional (0.27 - 0.31): mamba_cache_mode == "all"; the default keeps one running state
    me = NS(_is_hma_required=True, blocks_per_sw=[0, n_sw, 0], _ssm_spec_blocks=[None, None, 0],
            _ssm_state_slots_are_positional=False,
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
    meta = re.sub(r"#.*", "", conn).split("class NixlAgentMetadata")[1].split("class ")[0]
    if _v(release) < (0, 11, 0):
        # 0.9.0 - 0.10.0 have no layout on the wire; 0.10.1 does, and neither asks for HND in kv_connector/utils.py
        # (0.9.1+ have get_kv_connector_cache_layout, 0.9.0 none at all)
        assert ("kv_cache_layout" in meta) == (_v(release) >= (0, 10, 1))
        if _v(release) >= (0, 9, 1):  # in kv_connector/utils.py (0.9.1 - 0.10.0) or the connector (0.10.1)
            assert 'return "HND"' in utils + conn and "NixlConnector" in utils + conn
    else:
        assert "def get_required_kvcache_layout" in conn
        # 0.29+ name the layouts by KVCacheLayout (LBHNC = HND)
        assert ('return "LBHNC"' if _v(release) >= (0, 29) else 'return "HND"') in conn
        # 0.11.0 asserts equal layouts under heterogeneous TP only; 0.11.1+ raise on any difference
        assert ("nixl_agent_meta.kv_cache_layout == self.kv_cache_layout" if _v(release) < (0, 11, 1)
                else "nixl_agent_meta.kv_cache_layout != kv_cache_layout") in conn
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
    local = re.search(r'nixl_agent_meta\.kv_cache_layout == "LBHNC"\s+and kv_cache_layout == "LBNHC"', conn)
    if _v(release) >= (0, 32):  # LBHNC into a local LBNHC only
        assert local is not None
    elif _v(release) >= (0, 29):  # a remote LBHNC, whatever the local layout
        assert 'nixl_agent_meta.kv_cache_layout == "LBHNC"' in conn and local is None
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
    from pdcheck.vllm import fromlogs

    conn = _flat(_text(release, *_CONN))
    cfg = _flat(_text(release, "config.py", "config/vllm.py", "config/__init__.py"))
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
    # 0.18+: the layout and backend at INFO (read: DEBUG in 0.17.0, INFO in 0.18.0 - 0.26.0, 0.34.0)
    assert ('logger.info("Detected kv cache layout %s"' in conn) == (_v(release) >= (0, 18))
    if _v(release) >= (0, 18):
        facts = fromlogs.parse(["(Worker_TP0 pid=5) INFO 01-01 00:00:00 [x.py:1] Detected kv cache layout LBHNC"],
                               "x.log")
        assert facts.fields["kv_cache_layout"].value == "LBHNC"
        bm = re.search(r'logger\.info\(\s*"(Detected attention backend[^"]*)",\s*(\[?)', conn)
        assert bm is not None
        # 0.21+ log a list of names, 0.18 - 0.20 the first name alone
        said = bm.group(1) % (["FLASH_ATTN"] if bm.group(2) else "FLASH_ATTN")
        facts = fromlogs.parse([f"(Worker_TP0 pid=5) INFO 01-01 00:00:00 [x.py:1] {said}"], "x.log")
        assert facts.fields["attn_backend"].value == "FLASH_ATTN"
    # the DEBUG compat-hash line (0.13+)
    hm = re.search(r'"(NIXL compatibility hash: %s \(model=%s, dtype=%s, num_kv_heads=%d, cache_dtype=%s, '
                   r'attn_backend=%s\))"', conn)
    if _v(release) >= (0, 14):
        assert hm is not None
        text = hm.group(1) % ("abc", "m/x", "torch.bfloat16", 8, "fp8", "FLASH_ATTN")
        v = {k: f.value for k, f in fromlogs.parse([f"DEBUG 01-01 [x.py:1] {text}"], "x.log").fields.items()}
        assert v["kv_heads"] == 8 and v["cache_dtype"] == "fp8" and v["attn_backend"] == "FLASH_ATTN"


# ---- compressed MLA caches and dense MLA virtual pages (releases.mla_pages) ---------------------------------------
_NIXL = ("distributed/kv_transfer/kv_connector/v1/nixl_connector.py", "distributed/kv_transfer/kv_connector/v1/nixl/*.py")


@pytest.mark.parametrize("release", RELEASES)
def test_fp8_ds_mla_cache_dtype(release: str) -> None:
    from pdcheck.vllm.releases import mla_pages

    cache = _text(release, "config/cache.py", "config.py")
    literal = re.search(r"CacheDType = Literal\[(.*?)\]", cache, re.S)
    assert literal is not None
    has = f'"{mla_pages.CACHE_DTYPE}"' in literal.group(1)
    assert has == mla_pages.has_cache_dtype(release)
    if has:  # a uint8 tensor of 656-byte rows
        assert re.search(r'"fp8_ds_mla": torch\.uint8', _text(release, "utils/torch_utils.py"))
        sparse = _text(release, "v1/attention/backends/mla/flashmla_sparse.py")
        assert f"{mla_pages.ROW_BYTES}" in sparse


@pytest.mark.parametrize("release", RELEASES)
def test_dense_virtual_pages_and_block_strides(release: str) -> None:
    from pdcheck.vllm.releases import mla_pages

    rel = resolve(release)
    src = _text(release, *_NIXL)
    meta = re.search(r"class NixlAgentMetadata.*?\n\n\n", src, re.S)
    assert meta is not None
    fields = meta.group(0)
    version = re.search(r"NIXL_CONNECTOR_VERSION: int = (\d+)", src)
    assert (version is None) == (rel.connector_version is None)
    if version is not None:
        assert int(version.group(1)) == rel.connector_version
    dense = mla_pages.has_dense_pages(release)
    assert dense == ((rel.connector_version or 0) >= mla_pages.DENSE_PAGES_CONNECTOR_VERSION)
    # block_strides joins the metadata at connector version 9 (0.29), dense pages use it from version 10 (0.30)
    strides = (rel.connector_version or 0) >= 9
    assert ("block_strides: list[int]" in fields) == strides
    if dense:
        assert "10: Add dense virtual transfer pages for compressed MLA caches" in src
        # each side's descriptors walk its own stride: local rows by its cache stride, remote ones by P's
        assert "block_stride = cache.stride(0) * cache.element_size()" in src
        assert "nixl_agent_meta.block_strides[" in src
        if "(addr, local_block_len, device_id, block_strides[i], count)" not in src:  # 0.30 - 0.32's builders
            assert "self.block_stride_per_layer[i]" in src
        assert "stride >= block_len" in src
    elif not strides:
        assert "block_strides" not in src


@pytest.mark.parametrize("release", RELEASES)
def test_cache_dtype_in_the_hash_and_mla_replicated_block_len(release: str) -> None:
    """An fp8_ds_mla P and a bf16 D (bundled mla-fp8-ds-vs-auto): refused by the hash where cache_dtype is a
    factor, else by the MLA (replicated) block_len check of 0.11.1 - 0.12."""
    rel = resolve(release)
    src = _flat(_text(release, *_NIXL))
    assert ('"cache_dtype": str(cache_config.cache_dtype)' in src) == ("cache_dtype" in rel.hash_factors)
    if rel.wire == "F":
        assert '"KV cache sizes must match between P and D when replicated"' in src
# ---- multi-node TP (releases.multinode, PR #26338) ----------------------------------------------------------
@pytest.mark.parametrize("release", RELEASES)
def test_multinode_where_d_finds_each_rank(release: str) -> None:
    """Every release: P's scheduler advertises its own side-channel host as remote_host and D dials it for every
    rank. Per-worker eras: each worker listens at base + tp_rank on its own node and D connects to
    host:port + rank with a blocking recv(). 0.11.1+: the engine core gathers every worker's {rank: metadata}
    and the scheduler's one listener answers (GET_META_MSG, rank) on host:port."""
    rel = resolve(release)
    conn = _conn(release)
    core = _text(release, "v1/engine/core.py")
    # 0.9.0 names the env var itself, later releases the attribute they copy it into
    assert "remote_host=self.side_channel_host" in conn or "remote_host=envs.VLLM_NIXL_SIDE_CHANNEL_HOST" in conn
    assert multinode.dials_head_node(rel)
    gathered = "content.update(worker_dict)" in core and re.search(
        r"kv_connector\.set_xfer_handshake_metadata(_pp_aware)?\(content\)", core) is not None
    # 0.9.0 spells them port = VLLM_NIXL_SIDE_CHANNEL_PORT + rank and port + self.rank
    per_rank_listener = ('make_zmq_path("tcp", host, base_port + tp_rank)' in conn
                         or "port = envs.VLLM_NIXL_SIDE_CHANNEL_PORT + rank" in conn)
    dials_rank_port = re.search(r'make_zmq_path\("tcp", host, port \+ (p_remote_rank|self\.rank)\)', conn) is not None
    asks_rank = re.search(r"msgspec\.msgpack\.encode\(\s*\(GET_META_MSG, (remote_pp_rank, )?(p_)?remote_rank\)",
                          conn) is not None
    serves_all = multinode.serves_all_ranks(rel.wire)
    assert gathered == asks_rank == serves_all, (gathered, asks_rank, serves_all)
    assert per_rank_listener == dials_rank_port == (not serves_all)
    if not serves_all:  # the blocking wait the hang verdict names
        assert "with zmq_ctx(zmq.REQ, path) as sock:" in conn and "RCVTIMEO" not in conn
        assert rel.recv_timeout_ms is None
        assert multinode.unreachable(rel, rel.wire, 4, 2) == [2, 3]
    else:
        assert multinode.unreachable(rel, rel.wire, 4, 2) == []
