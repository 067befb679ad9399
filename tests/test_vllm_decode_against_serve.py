"""vLLM's OWN decode-side code, read from unpacked wheels, against a live `pdcheck serve` (opt-in).

    PDCHECK_VLLM_SRC=/tmp/vllm-src python -m pytest -q tests/test_vllm_decode_against_serve.py

Per release, four D ranks (TP 4) of a 2-layer model with 8 KV heads read from serve's P TP 2 (uneven counts).
What runs as the release wrote it (torch on the CPU, NIXL on host memory; no vLLM import):
- the D's KV registration facts: FlashAttention's `get_kv_cache_shape` allocates each layer's cache (a CPU
  tensor), `TransferTopology.get_transfer_cache_regions` cuts it into NIXL regions; their strides give
  block_len_per_layer, the layer names give region_names;
- `_nixl_handshake` (request, reply frames, payload/metadata decoders, compat hash, engine id) against serve;
- inside the add_remote_agent stand-in: 0.34's `_pair_regions` (layer names), `TransferTopology` registration
  and `block_size_ratio`, the NIXL add of P's agent blob, `_validate_remote_agent_handshake`;
- 0.23 and 0.26 only (their descriptors are Nx3): `compute_tp_mapping`, `_build_fa_local`, `_build_fa_remote`,
  `_compute_desc_ids`; pdcheck's NIXL agent then posts the READ with exactly those descriptors and ids, and the
  bytes that arrive are checked against serve's coordinate tags (P rank, region, block, head slice).
Stand-ins: the worker object (attributes the code reads), the AttentionSpec/MambaSpec classes, logger.
Nothing here is part of pdcheck.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

import numpy as np
import pytest

SRC = os.environ.get("PDCHECK_VLLM_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="PDCHECK_VLLM_SRC (unpacked vLLM wheels) not set")

P_TP, D_TP, HEADS, HEAD_DIM, LAYERS, BLOCK_SIZE, D_BLOCKS = 2, 4, 8, 64, 2, 16, 64
P_BLOCKS = [3008, 2992]
ENGINE = "prefill-engine"


class AttentionSpec:  # stand-ins for vllm.v1.kv_cache_interface
    pass


class FullAttentionSpec(AttentionSpec):
    pass


class MambaSpec:
    pass


def _functions(path: Path, names: set[str]) -> dict[str, str]:
    """Source of the first function/class of each name in a file, dedented, staticmethod dropped."""
    text = path.read_text()
    lines = text.splitlines()
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name in names and node.name not in out:
            decos = [d for d in node.decorator_list if ast.unparse(d) != "staticmethod"]
            start = min([d.lineno for d in decos] + [node.lineno]) - 1
            out[node.name] = textwrap.dedent("\n".join(lines[start:node.end_lineno]))
    return out


def _nixl_dir(release: str) -> Path:
    return Path(SRC or "") / release / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1" / "nixl"


def _worker_file(release: str) -> Path:
    d = _nixl_dir(release)
    return d / "base_worker.py" if (d / "base_worker.py").exists() else d / "worker.py"


def _packed_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, **_: Any) -> tuple[int, ...]:
    # 0.34's FlashAttentionBackend no longer has get_kv_cache_shape: the shape its forward() documents
    return (num_blocks, num_kv_heads, block_size, 2 * head_size)


def _fa_backend(release: str) -> tuple[type, bool]:
    """FlashAttentionBackend's get_kv_cache_shape as the release has it; False: the 0.34 stand-in above."""
    path = Path(SRC or "") / release / "vllm" / "v1" / "attention" / "backends" / "flash_attn.py"
    ns: dict[str, Any] = {}
    src = _functions(path, {"get_kv_cache_shape"}).get("get_kv_cache_shape")
    if src is not None:
        exec(compile("from __future__ import annotations\n" + src, f"<vllm {release} flash_attn>", "exec"), ns)  # noqa: S102
    shape = ns.get("get_kv_cache_shape", _packed_shape)
    return type("FlashAttentionBackend", (), {"get_kv_cache_shape": staticmethod(shape),
                                              "get_name": staticmethod(lambda: "FLASH_ATTN")}), src is not None


def _load_mapping(release: str, g: dict[str, Any]) -> None:
    """tp_mapping.py as the release has it, its vLLM imports replaced by the stand-ins."""
    text = (_nixl_dir(release) / "tp_mapping.py").read_text()
    tree = ast.parse(text)
    tree.body = [n for n in tree.body if not (isinstance(n, ast.ImportFrom) and (n.module or "").startswith("vllm"))]
    exec(compile(tree, f"<vllm {release} tp_mapping>", "exec"), g)  # noqa: S102


class DecodeRank:
    """One D rank: its caches allocated and cut into regions by the release's own code, a real NIXL agent."""

    def __init__(self, release: str, rank: int, rel: Any) -> None:
        import torch

        from pdcheck.geometry import Geometry
        from pdcheck.nixlagent import Agent

        self.release, self.rank, self.rel = release, rank, rel
        g = rel.g
        g.setdefault("MambaSpec", MambaSpec)
        backend, self.real_shape = _fa_backend(release)
        local_heads = HEADS // D_TP
        shape = backend.get_kv_cache_shape(num_blocks=D_BLOCKS, block_size=BLOCK_SIZE, num_kv_heads=local_heads,
                                           head_size=HEAD_DIM)
        fields = {f.name for f in dataclasses.fields(g["TransferTopology"])}
        kw = dict(tp_rank=rank, tp_size=D_TP, block_size=BLOCK_SIZE, engine_id="decode-engine", is_mla=False,
                  is_mamba=False, total_num_kv_heads=HEADS, attn_backends=[backend], tensor_shape=tuple(shape))
        self.topo = g["TransferTopology"](**{k: v for k, v in kw.items() if k in fields})
        self.caches = {Geometry.layer_name(i): torch.zeros(tuple(shape), dtype=torch.bfloat16) for i in range(LAYERS)}
        self.regions: list[Any] = []
        self.block_len_per_layer: list[int] = []
        self.region_names: list[str] = []
        for name, cache in self.caches.items():
            # 0.34 registers each layer's cache as one region (no get_transfer_cache_regions any more)
            cut = getattr(self.topo, "get_transfer_cache_regions", lambda c, _s: [c])
            for c in cut(cache, FullAttentionSpec()):
                self.regions.append(c)
                self.block_len_per_layer.append(c.stride(0) * c.element_size())
                self.region_names.append(name)
        self.agent = Agent(f"vllm-decode-{release}-d{rank}")
        self.agent.register([(c.data_ptr(), D_BLOCKS * bl, 0) for c, bl in zip(self.regions,
                                                                             self.block_len_per_layer, strict=True)],
                            "DRAM")
        self.added: list[Any] = []
        self.remote: dict[int, tuple[str, Any, Any]] = {}

    def worker(self, meta: Any) -> Any:
        """The worker attributes the release's functions read (wheelkit's stand-in, with this rank's facts)."""
        from releasekit import side

        g = self.rel.g
        me = self.rel._worker(side("D", D_TP, D_BLOCKS, kv_heads=HEADS, head_dim=HEAD_DIM, layers=LAYERS),
                              transfer_topo=self.topo, dst_num_blocks={meta.engine_id: meta.num_blocks})
        if "KVCacheLayout" in g:  # 0.29+: the worker holds get_resolved_kv_cache_layout().name
            me.kv_cache_layout = me.host_buffer_kv_cache_layout = "LBHNC"
        me.block_len_per_layer = list(self.block_len_per_layer)
        me.region_names = list(self.region_names)
        me.num_blocks, me.device_id, me.engine_id = D_BLOCKS, 0, "decode-engine"
        me._dst_pairs = {}
        me.dst_region_group_ids = {meta.engine_id: None}
        me._group_spec_types = (FullAttentionSpec,)
        me._conv_decomp = None
        me._mamba_ssm_size = (0, 0)
        me.pp_size = 1
        me._packed_member_layouts = {}
        me.kv_cache_config = NS(transfer_group_index_by_layer={n: 0 for n in self.caches})
        by_layer: dict[str, list[int]] = {}
        for i, n in enumerate(self.region_names):
            by_layer.setdefault(n, []).append(i)
        me._regions_by_layer = by_layer
        me.block_stride_per_layer = list(self.block_len_per_layer)
        me.region_num_blocks = [D_BLOCKS] * len(self.regions)
        me.draft_tp_mappings = {}
        me.num_regions = len(self.regions) * (2 if getattr(self.topo, "virtually_split_kv_in_blocks", False) else 1)
        _bind(me, self.rel.g)
        return me

    def add_remote_agent(self, meta: Any, remote_rank: int = 0, remote_tp_size: int = 1, *_a: Any) -> str:
        """The order of the release's add_remote_agent; each step is the release's own function."""
        g, me = self.rel.g, self.worker(meta)
        self.added.append(meta)
        pairs = None
        if "_pair_regions" in g:  # 0.34: pair regions through the layer names first
            pairs = g["_pair_regions"](me, meta)
            if me._dst_pairs.setdefault(meta.engine_id, pairs) != pairs:
                raise RuntimeError("lay out their KV regions differently")
        info = dict(remote_tp_size=remote_tp_size, remote_block_size=meta.block_size,
                    remote_block_len=meta.block_lens[0], remote_physical_blocks_per_logical=1, remote_dcp_size=1)
        params = list(inspect.signature(self.topo.register_remote_engine).parameters)
        if "info" in params:
            names = {f.name for f in dataclasses.fields(g["EngineTransferInfo"])}
            self.topo.register_remote_engine(meta.engine_id, g["EngineTransferInfo"](**{k: v for k, v in info.items()
                                                                                         if k in names}))
        else:  # 0.20: keyword arguments
            self.topo.register_remote_engine(meta.engine_id, **{k: v for k, v in info.items() if k in params})
        bsr = self.topo.block_size_ratio(meta.block_size)
        name = self.agent.add_remote(meta.agent_metadata)  # the real NIXL load of P's blob
        g["_validate_remote_agent_handshake"](me, meta, remote_tp_size)
        if "_build_fa_remote" in g:
            kw = dict(transfer_topology=self.topo, remote_tp_size=remote_tp_size,
                      group_spec_types=me._group_spec_types, remote_dcp_size=1)
            params = inspect.signature(g["compute_tp_mapping"]).parameters
            plan = g["compute_tp_mapping"](**{k: v for k, v in kw.items() if k in params})
            cols = 5 if "_pack_strided_descs" in g else 3  # 0.34: Nx5 strided descriptors
            remote = np.asarray(g["_build_fa_remote"](me, plan, meta, bsr), dtype=np.uint64).reshape(-1, cols)
            local = np.asarray(g["_build_fa_local"](me, [c.data_ptr() for c in self.regions], bsr),
                               dtype=np.uint64).reshape(-1, cols)
            self.remote[remote_rank] = (name, remote, local, me, plan, pairs)
        return name


def _load_worker_code(release: str, rel: Any) -> None:
    """The release's own worker methods used above, as plain functions in the wheel namespace."""
    g = rel.g
    g.update(np=np, defaultdict=__import__("collections").defaultdict, re=__import__("re"),
             AttentionSpec=AttentionSpec, MambaSpec=MambaSpec, KVCacheSpec=object)
    names = {"_pair_regions", "_RegionPairs", "_region_sort_key", "_build_fa_local", "_build_fa_remote",
             "_stack_descs", "get_backend_aware_kv_block_len", "_compute_desc_ids", "_pack_strided_descs",
             "_block_strided_descs"}
    src = _functions(_worker_file(release), names)
    if "_RegionPairs" in src:
        g["_SHARED_REGION_GROUP_ID"] = -1
        exec(compile("from __future__ import annotations\nfrom dataclasses import dataclass, field\n"  # noqa: S102
                     + src.pop("_RegionPairs"), f"<vllm {release} _RegionPairs>", "exec"), g)
    for name, code in src.items():
        exec(compile("from __future__ import annotations\n" + code, f"<vllm {release} {name}>", "exec"), g)  # noqa: S102
    if "_build_fa_remote" in g and (_nixl_dir(release) / "tp_mapping.py").exists():
        _load_mapping(release, g)
        if "_is_attention_spec" not in g:
            g["_is_attention_spec"] = lambda t: issubclass(t, AttentionSpec)


def _flat(descs: np.ndarray) -> np.ndarray:
    """Nx3 (addr, len, dev) as NIXL's get_xfer_descs takes them. 0.34's Nx5 rows (addr, len, dev, stride, count)
    are `count` blocks `stride` apart (its _pack_strided_descs docstring): expanded here in that order, because
    the nixl Python package installed here prepares Nx3 lists only."""
    if descs.shape[1] == 3:
        return descs
    rows = [np.stack([a + np.arange(c, dtype=np.uint64) * st, np.full(c, n, np.uint64), np.full(c, dv, np.uint64)], 1)
            for a, n, dv, st, c in descs.tolist()]
    return np.concatenate(rows).astype(np.uint64)


def _bind(me: Any, g: dict[str, Any]) -> None:
    for name in ("get_backend_aware_kv_block_len", "_compute_desc_ids"):
        if name in g:
            setattr(me, name, types.MethodType(g[name], me))
    for name in ("_stack_descs", "_pack_strided_descs", "_block_strided_descs"):  # staticmethods
        if name in g:
            setattr(me, name, g[name])


@pytest.mark.parametrize("release", ["0.20.0", "0.23.0", "0.26.0", "0.34.0"])
def test_vllms_own_decode_code_accepts_serve_and_reads_tagged_blocks(release: str) -> None:
    from test_live import serve
    from test_probe_vllm_listener import with_vllm_handshake
    from wheelkit import Release

    from pdcheck.pattern import CELL, BlockView, decode_cell, engine_tag, pattern

    if not _nixl_dir(release).is_dir():
        pytest.skip(f"{release} not unpacked under PDCHECK_VLLM_SRC")
    ns = with_vllm_handshake(release)
    rel = Release(Path(SRC or ""), release)
    _load_worker_code(release, rel)
    read = 0
    with serve("--prefill-tp", str(P_TP), "--prefill-blocks", ",".join(map(str, P_BLOCKS)), "--layers", str(LAYERS),
               "--kv-heads", str(HEADS), "--head-dim", str(HEAD_DIM), "--vllm", release,
               "--prefill-engine-id", ENGINE) as s:
        for rank in range(D_TP):
            d = DecodeRank(release, rank, rel)
            target = rank * P_TP // D_TP
            me = NS(compat_hash=s.doc["compat_hash"], enforce_compat_hash=True, block_size=BLOCK_SIZE,
                    use_host_buffer=True, device_id=rank, _is_csa_linear=False, add_remote_agent=d.add_remote_agent,
                    _validate_remote_parallel_config=lambda _m: None,
                    kv_topo=NS(get_target_remote_rank=lambda _tp, t=target: t),
                    transfer_topo=NS(handshake_target_ranks=lambda *_a, t=target: [t]))
            out = ns["_nixl_handshake"](me, "127.0.0.1", s.doc["base_port"], P_TP, ENGINE)
            names = out[0] if isinstance(out, tuple) else out
            assert list(names.values()) == [f"{ENGINE}-p{target}"]
            meta = d.added[-1]
            # what serve registered is what this release's own registration code gives the D for its layout
            assert len(meta.kv_caches_base_addr) == len(d.regions)
            assert meta.block_lens == [bl * (D_TP // P_TP) for bl in d.block_len_per_layer]
            assert meta.num_blocks == P_BLOCKS[target]
            if not d.remote:
                continue
            # READ with the release's own descriptors and descriptor ids, then check serve's coordinate tags
            name, remote, local, wme, plan, pairs = d.remote[target]
            handle_r = d.agent.prep(name, _flat(remote), "DRAM", "remote")
            handle_l = d.agent.prep("NIXL_INIT_AGENT", _flat(local), "DRAM", "local")
            blocks_r, blocks_l = [1, 3], [5, 9]  # inside serve's tagged range
            if pairs is None:
                rids = wme._compute_desc_ids([blocks_r], P_BLOCKS[target], None, 1)
                lids = wme._compute_desc_ids([blocks_l], D_BLOCKS, 1, 1)
            else:  # 0.34: through the region pairs
                rids = wme._compute_desc_ids([blocks_r], P_BLOCKS[target], None, 1, pairs=(pairs.remote, pairs.group))
                lids = wme._compute_desc_ids([blocks_l], D_BLOCKS, 1, 1, pairs=(pairs.local, pairs.group))
            d.agent.read(handle_l, lids, handle_r, rids, b"req-0", context=f"{release} D{rank}")
            tag = engine_tag(ENGINE)
            p_heads, cell = HEADS // P_TP, d.caches[next(iter(d.caches))].element_size() * HEAD_DIM
            packed = len(d.regions) == LAYERS and not getattr(d.topo, "virtually_split_kv_in_blocks", False)
            cell *= 2 if packed else 1
            for region, c in enumerate(d.regions):
                raw = c.view(-1).view(__import__("torch").uint8).numpy().reshape(D_BLOCKS, -1)
                bl = d.block_len_per_layer[region]
                halves = 2 if getattr(d.topo, "virtually_split_kv_in_blocks", False) else 1
                for h in range(halves):
                    n = bl // halves
                    offset = plan.rank_offset_factor * n + h * meta.block_lens[region] // halves
                    view = BlockView.of("HND", p_heads, BLOCK_SIZE, cell, plain=halves == 2)
                    got = raw[blocks_l][:, h * n:(h + 1) * n]
                    want = pattern(tag, target, region, np.asarray(blocks_r), offset, n, view)
                    first = decode_cell(got[0, :CELL])
                    assert (first.valid, first.p_rank, first.region, first.block) == (True, target, region, 1)
                    assert (got == want).all(), f"{release} D{rank} region {region} half {h}"
                    read += len(blocks_l)
    if release != "0.20.0":  # 0.20 builds its descriptors inside add_remote_agent: not run here
        assert read == D_TP * LAYERS * 2 * (2 if release == "0.23.0" else 1)
