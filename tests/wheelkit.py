"""Run vLLM's own NixlConnector code, read from an unpacked wheel, against small stand-ins (no GPU, no vllm import).

A directory SRC/<release>/vllm/... holds the .py files of one wheel (`pip download vllm==X --no-deps` and
`unzip whl 'vllm/*.py'`). From it this module executes, as the release wrote them:
- `compute_nixl_compatibility_hash` and `hash_factors`, with a stand-in VllmConfig;
- the topology class (TpKVTopology up to 0.19, TransferTopology from 0.20), the asserts `_nixl_handshake` makes
  on the metadata before calling add_remote_agent (0.11.1 - 0.13: "nP > nD is not supported yet."), the calls
  add_remote_agent makes on the topology before the validation (tp_ratio, register, block_size_ratio), and
  `_validate_remote_agent_handshake`, with a stand-in worker;
- before 0.11.1 (checks inline in add_remote_agent, between NIXL calls), `_nixl_handshake` and add_remote_agent
  themselves, with a stand-in worker, NIXL agent and ZMQ socket (fakes: what is compared is the release's pure
  checks and the P rank it picks, not NIXL).
Nothing here is part of pdcheck; the release-model tests use it to compare pdcheck's models with the source.
"""

from __future__ import annotations

import ast
import collections
import contextlib
import dataclasses
import functools
import hashlib
import inspect
import json
import logging
import math
import sys
import textwrap
import types
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

from releasekit import Side

Outcome = tuple[Any, ...]  # ("ok", None) | ("error", message) | ("assert", message, asserted expression)
_SOURCES: dict[str, str] = {}


def _segments(path: Path, names: set[str]) -> dict[str, str]:
    text = path.read_text()
    out: dict[str, str] = {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names and node.name not in out:
            seg = ast.get_source_segment(text, node) or ""
            decos = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
            out[node.name] = decos + seg
        if isinstance(node, ast.AnnAssign | ast.Assign):
            target = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
            if isinstance(target, ast.Name) and target.id in names and node.value is not None:
                out[target.id] = repr(ast.literal_eval(node.value))
    return out


def _pre_add_asserts(path: Path) -> str:
    """`def _pre_add(self, metadata)` holding the assert statements `_nixl_handshake` runs on the decoded metadata
    just before the statement that calls add_remote_agent (empty body when the release has none)."""
    text = path.read_text()
    fn = next(n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.FunctionDef) and n.name == "_nixl_handshake")
    asserts: list[str] = []
    for node in ast.walk(fn):
        for stmts in (getattr(node, f, None) for f in ("body", "orelse", "finalbody")):
            if not isinstance(stmts, list):
                continue
            for i, stmt in enumerate(stmts):
                calls = any(isinstance(c, ast.Attribute) and c.attr == "add_remote_agent" for c in ast.walk(stmt))
                if not calls or isinstance(stmt, ast.With):  # the call's own statement list, not a block around it
                    continue
                for prev in reversed(stmts[:i]):
                    if not isinstance(prev, ast.Assert | ast.If | ast.Expr):
                        break  # the metadata's assignment (or anything else) ends the run of checks
                    if isinstance(prev, ast.Assert):
                        asserts.insert(0, ast.get_source_segment(text, prev) or "")
    body = "".join(textwrap.indent(textwrap.dedent(a), "    ") + "\n" for a in asserts) or "    pass\n"
    return "def _pre_add(self, metadata):\n" + body


def _run(code: str, g: dict[str, Any], tag: str) -> None:
    name = f"<vllm {tag} #{len(_SOURCES)}>"
    _SOURCES[name] = code
    exec(compile(code, name, "exec"), g)  # noqa: S102 - vLLM's own source, read from the wheel on disk


def _asserted(exc: BaseException) -> str | None:
    """The expression of the vLLM assert statement that raised, whitespace collapsed."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename in _SOURCES:
            last = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return None if last is None else _assert_at(*last)


@functools.cache
def _assert_at(name: str, line: int) -> str | None:
    """The assert statement's expression spanning `line` of the loaded source `name` (parsed once per line: the
    grids hit the same few asserts thousands of times)."""
    code = _SOURCES[name]
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Assert) and node.lineno <= line <= (node.end_lineno or node.lineno):
            text = " ".join((ast.get_source_segment(code, node.test) or "").split())
            return text.replace("( ", "(").replace(" )", ")")
    return None


class _NoListener(Exception):
    """No P rank listens at the port a release's _nixl_handshake contacts (the real one waits or times out)."""


def minor(release: str) -> int:
    return int(release.split(".")[1])


class _Backend:
    """FlashAttention's get_kv_cache_shape as each era has it (only the shape matters to the topology)."""

    release = "0.34.0"

    @classmethod
    def get_kv_cache_shape(cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           **_: Any) -> tuple[int, ...]:
        if minor(cls.release) >= 26:
            return (num_blocks, num_kv_heads, block_size, 2 * head_size)  # K and V packed in the content dim
        if minor(cls.release) >= 23:
            return (num_blocks, 2, block_size, num_kv_heads, head_size)  # blocks-first
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_name() -> str:
        return "FLASH_ATTN"


class Release:
    """One unpacked wheel's handshake code, loaded into its own module namespace."""

    def __init__(self, src: Path, release: str) -> None:
        self.release = release
        root = src / release / "vllm"
        self.root = root
        mod = types.ModuleType(f"wheel_{release.replace('.', '_')}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        g = mod.__dict__
        g.update(dataclass=dataclasses.dataclass, field=dataclasses.field, logger=logging.getLogger("wheelkit"),
                 EngineId=str, torch=NS(Size=tuple), Any=Any, Sequence=list, math=math,
                 AttentionSpec=type("AttentionSpec", (), {}), cached_property=functools.cached_property)
        layout = root / "v1" / "kv_cache_layout.py"
        if layout.exists():
            _run(layout.read_text(), g, release)
        worker = next((p for p in sorted(root.glob("distributed/kv_transfer/kv_connector/v1/**/*.py"),
                                         key=lambda p: "base_worker" not in p.name and p.name != "worker.py")
                       if "def _validate_remote_agent_handshake" in p.read_text() and "class Nixl" in p.read_text()),
                      None)
        utils = _segments(root / "distributed/kv_transfer/kv_connector/utils.py",
                          {"TransferTopology", "EngineTransferInfo", "TpKVTopology"})
        if not utils and worker is not None:  # 0.11.1 - 0.12: TpKVTopology is a class inside NixlConnectorWorker
            utils = _segments(worker, {"TpKVTopology"})
        # 0.11.1 - 0.13 name the backend through AttentionBackendEnum (only its PALLAS member is compared)
        g.update(AttentionBackend=type, AttentionBackendEnum=type("E", (dict,), {"PALLAS": "PALLAS",
                                                                                "__missing__": lambda _s, k: k})())
        for name in ("EngineTransferInfo", "TransferTopology", "TpKVTopology"):
            if name in utils:
                _run("from __future__ import annotations\n" + textwrap.dedent(utils[name]), g, release)
        if worker is None:  # 0.9.0 - 0.11.0: the checks are inline in add_remote_agent
            self._load_inline(root, g)
            self.g = g
            return
        val = _segments(worker, {"_validate_remote_agent_handshake"})["_validate_remote_agent_handshake"]
        _run("from __future__ import annotations\n" + textwrap.dedent(val), g, release)
        shake = next(p for p in sorted(root.glob("distributed/kv_transfer/kv_connector/v1/**/*.py"))
                     if "def _nixl_handshake(" in p.read_text())
        self.pre_add_code = _pre_add_asserts(shake)
        _run(self.pre_add_code, g, release)
        self.g = g

    # ---- 0.9.0 - 0.11.0: _nixl_handshake and add_remote_agent as written, NIXL and ZMQ stood in for
    def _load_inline(self, root: Path, g: dict[str, Any]) -> None:
        worker = root / "distributed/kv_transfer/kv_connector/v1/nixl_connector.py"
        dist = _segments(root / "distributed/utils.py", {"ensure_divisibility", "divide"})
        for name in ("ensure_divisibility", "divide"):
            _run(dist[name], g, self.release)
        self.methods = _segments(worker, {"_nixl_handshake", "add_remote_agent", "get_backend_aware_kv_block_len"})
        for code in self.methods.values():
            _run("from __future__ import annotations\n" + textwrap.dedent(code), g, self.release)
        # the worker's own initial value of _remote_agents (a dict, or from 0.9.1 a defaultdict per engine)
        init = next(n for n in ast.walk(ast.parse(worker.read_text())) if isinstance(n, ast.AnnAssign)
                    and ast.unparse(n.target) == "self._remote_agents" and n.value is not None)
        self.remote_agents_init = ast.unparse(init.value)
        g.update(defaultdict=collections.defaultdict, GET_META_MSG=b"get_meta_msg", make_zmq_path=lambda _proto, _host, port: port,
                 zmq=NS(REQ=None, RCVTIMEO=None), time=NS(perf_counter=lambda: 0.0), NixlAgentMetadata=None)

    def _handshake_inline(self, p: Side, d: Side, d_rank: int) -> Outcome:
        """D rank d_rank's first handshake with P as the release runs it: P's ranks answer at base port + rank
        (the stand-in socket hands _nixl_handshake that rank's metadata; no decoding is checked here), the
        stand-in NIXL agent accepts every call."""
        gd = d.geometry
        base = 1000
        metas = {base + r: self._inline_meta(p, r) for r in range(p.tp)}
        timed = "RCVTIMEO" in self.methods["_nixl_handshake"]

        class _Sock:
            def __init__(self, port: int) -> None:
                self.port = port

            def send(self, _msg: bytes) -> None:
                return None

            def setsockopt(self, *_a: Any) -> None:
                return None

            def recv(self) -> Any:
                if self.port not in metas:  # the release waits forever unless it set a receive timeout
                    raise _NoListener("timeout" if timed else "hang", f"P rank {self.port - base}")
                return metas[self.port]

        @contextlib.contextmanager
        def zmq_ctx(_kind: Any, path: int):  # noqa: ANN202 - the release's own context manager's stand-in
            yield _Sock(path)

        self.g.update(zmq_ctx=zmq_ctx, msgspec=NS(msgpack=NS(Decoder=lambda _cls: NS(decode=lambda b: b))))
        block_len = gd.block_len
        nixl = NS(add_remote_agent=lambda blob: blob.decode(), get_xfer_descs=lambda data, *_a: data,
                  prep_xfer_dlist=lambda agent, descs, *_a: (agent, len(descs)))
        me = NS(engine_id=d.engine_id, tp_rank=d_rank, rank=d_rank, _tp_size={d.engine_id: d.tp},
                _remote_agents=eval(self.remote_agents_init, self.g),  # noqa: S307 - the wheel's initializer
                dst_num_blocks={d.engine_id: d.blocks[d_rank]},
                kv_caches_base_addr={d.engine_id: [reg << 24 for reg in range(gd.num_regions)]},
                dst_xfer_side_handles={}, src_xfer_side_handle=None, nixl_wrapper=nixl, nixl_memory_type="VRAM",
                block_len=block_len, block_len_per_layer=[block_len] * gd.num_regions, block_size=d.block_size,
                slot_size_bytes=block_len // d.block_size, slot_size_per_layer=[block_len // d.block_size] * gd.num_regions,
                num_blocks=d.blocks[d_rank], use_mla=gd.use_mla, backend_name=gd.attn_backend, _use_flashinfer=False,
                _use_pallas=False, _use_pallas_v1=False, device_type="cuda", kv_cache_layout=d.layout,
                model_config=NS(get_total_num_kv_heads=lambda: gd.total_kv_heads))
        for name in self.methods:
            setattr(me, name, types.MethodType(self.g[name], me))
        params = list(inspect.signature(self.g["_nixl_handshake"]).parameters)[1:]
        args = {"host": "p", "port": base, "remote_tp_size": p.tp, "expected_engine_id": p.engine_id}
        me._nixl_handshake(*[args[n] for n in params])
        return ("ok", None)

    def _inline_meta(self, p: Side, r: int) -> NS:
        gp = p.geometry
        return NS(engine_id=p.engine_id, agent_metadata=f"{p.engine_id}/{r}".encode(), tp_size=p.tp,
                  kv_caches_base_addr=[(r + 1) << 32 | reg << 24 for reg in range(gp.num_regions)],
                  num_blocks=p.blocks[r], block_len=gp.block_len, block_lens=[gp.block_len] * gp.num_regions,
                  attn_backend_name=gp.attn_backend, kv_cache_layout=p.layout)

    # ---- compatibility hash
    def compat_hash(self, *, model: str, dtype: str, num_kv_heads: int, head_size: int, layers: int,
                    backend: str, hma_disabled: bool) -> str:
        hfile = next(p for p in self.root.glob("distributed/kv_transfer/kv_connector/v1/**/*.py")
                     if "def compute_nixl_compatibility_hash" in p.read_text())
        src = _segments(hfile, {"compute_nixl_compatibility_hash", "_get_speculative_compatibility_factors",
                                "NIXL_CONNECTOR_VERSION"})
        utils = _segments(self.root / "config/utils.py", {"hash_factors"})
        g: dict[str, Any] = {"hashlib": hashlib, "json": json, "logger": logging.getLogger("wheelkit"),
                             "NIXL_CONNECTOR_VERSION": int(src["NIXL_CONNECTOR_VERSION"]), "Any": Any}
        _run("from __future__ import annotations\n" + utils["hash_factors"], g, self.release)
        # the function imports `from vllm import __version__` and `from vllm.config.utils import hash_factors`
        stubs = {"vllm": types.ModuleType("vllm"), "vllm.config": types.ModuleType("vllm.config"),
                 "vllm.config.utils": types.ModuleType("vllm.config.utils")}
        stubs["vllm"].__version__ = self.release  # type: ignore[attr-defined]
        stubs["vllm.config.utils"].hash_factors = g["hash_factors"]  # type: ignore[attr-defined]
        for name in ("_get_speculative_compatibility_factors", "compute_nixl_compatibility_hash"):
            if name in src:
                _run("from __future__ import annotations\n" + src[name], g, self.release)
        config = NS(model_config=NS(model=model, dtype=dtype, get_total_num_kv_heads=lambda: num_kv_heads,
                                    get_head_size=lambda: head_size, get_total_num_hidden_layers=lambda: layers),
                    cache_config=NS(cache_dtype="auto"), speculative_config=None,
                    scheduler_config=NS(disable_hybrid_kv_cache_manager=hma_disabled))
        fn = g["compute_nixl_compatibility_hash"]
        kw = {"cross_layers_blocks": False} if "cross_layers_blocks" in inspect.signature(fn).parameters else {}
        saved = {k: sys.modules.get(k) for k in stubs}
        sys.modules.update(stubs)
        try:
            return fn(config, backend, **kw)
        finally:
            for k, mod in saved.items():
                if mod is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = mod

    # ---- add_remote_agent up to and through _validate_remote_agent_handshake
    def handshake(self, p: Side, d: Side, d_rank: int = 0) -> Outcome:
        _Backend.release = self.release
        try:
            if "_nixl_handshake" in self.g:
                return self._handshake_inline(p, d, d_rank)
            if "TransferTopology" in self.g:
                return self._handshake_20(p, d, d_rank)
            return self._handshake_14(p, d, d_rank)
        except AssertionError as exc:
            return ("assert", str(exc) or None, _asserted(exc))
        except _NoListener as exc:
            return exc.args
        except Exception as exc:  # noqa: BLE001 - any exception the release raises is its outcome
            return ("error", str(exc))

    def _meta(self, p: Side) -> NS:
        gp = p.geometry
        return NS(engine_id="P", block_size=p.block_size, kv_cache_layout=p.layout, attn_backend_name=gp.attn_backend,
                  block_lens=[gp.block_len] * gp.num_regions, block_strides=[gp.block_len] * gp.num_regions,
                  kv_caches_base_addr=list(range(gp.num_regions)), num_blocks=p.blocks[0],
                  physical_blocks_per_logical_kv_block=1, region_num_blocks=None, region_group_ids=None,
                  region_names=None, region_mem_types=None, dcp_size=1)

    def _worker(self, d: Side, **kw: Any) -> NS:
        gd = d.geometry
        me = NS(use_mla=gd.use_mla, _has_mamba=False, _use_pallas=False, _is_hma_required=False, use_host_buffer=False,
                kv_cache_layout=d.layout, host_buffer_kv_cache_layout=d.layout,
                kv_transfer_config=NS(enable_permute_local_kv=False), enable_permute_local_kv=False,
                backend_name=gd.attn_backend, block_len_per_layer=[gd.block_len] * gd.num_regions, dcp_size=1,
                _physical_blocks_per_logical_kv_block=1, vllm_config=NS(cache_config=NS(enable_prefix_caching=True)),
                _head_sharded_draft_regions={}, _head_sharded_draft_kv_heads=None, _layer_specs={},
                _dst_pairs={"P": NS(groups_match=True)}, _dcp_replicated_groups=None, _TRANSFER_MODE="pull",
                region_group_ids=[], dst_region_group_ids={"P": None}, region_names=None,
                _transfer_layer_region_indices=None, _transfer_layer_names=None, **kw)
        me._is_region_replicated = lambda _i: False
        return me

    def _handshake_14(self, p: Side, d: Side, d_rank: int) -> Outcome:
        gd = d.geometry
        tp_size, block_size = {"D": d.tp}, {"D": d.block_size}
        cls = self.g["TpKVTopology"]
        fields = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = dict(tp_rank=d_rank, engine_id="D", remote_tp_size=tp_size,
                                  remote_block_size=block_size, is_mla=gd.use_mla, total_num_kv_heads=gd.total_kv_heads,
                                  tp_size=d.tp, block_size=d.block_size)  # the last two: 0.11.1's own fields
        if "attn_backends" in fields:
            kw["attn_backends"] = [_Backend]
        else:
            kw["attn_backend"] = _Backend
        topo = cls(**{k: v for k, v in kw.items() if k in fields})
        if hasattr(topo, "tp_ratio"):
            topo.tp_ratio(p.tp)  # get_target_remote_ranks, before any request
        self.g["_pre_add"](NS(block_size=d.block_size), self._meta(p))
        tp_size["P"], block_size["P"] = p.tp, p.block_size  # add_remote_agent: first value wins
        topo.block_size_ratio_from_engine_id("P")
        me = self._worker(d, kv_topo=topo, _tp_size=tp_size, dst_num_blocks={"P": p.blocks[0]})
        self.g["_validate_remote_agent_handshake"](me, self._meta(p), p.tp)
        return ("ok", None)

    def _handshake_20(self, p: Side, d: Side, d_rank: int) -> Outcome:
        gd, gp = d.geometry, p.geometry
        cls = self.g["TransferTopology"]
        fields = {f.name for f in dataclasses.fields(cls)}
        heads = 1 if (gd.use_mla and minor(self.release) >= 29) else gd.total_kv_heads
        kw = dict(tp_rank=d_rank, tp_size=d.tp, block_size=d.block_size, engine_id="D", is_mla=gd.use_mla,
                  is_mamba=False, total_num_kv_heads=heads, attn_backends=[_Backend])
        topo = cls(**{k: v for k, v in kw.items() if k in fields})
        topo.tp_ratio(p.tp)  # handshake_target_ranks, before any request
        self.g["_pre_add"](NS(block_size=d.block_size), self._meta(p))
        info = dict(remote_tp_size=p.tp, remote_block_size=p.block_size, remote_block_len=gp.block_len,
                    remote_physical_blocks_per_logical=1, remote_dcp_size=1)
        params = list(inspect.signature(topo.register_remote_engine).parameters)
        if "info" in params:
            names = {f.name for f in dataclasses.fields(self.g["EngineTransferInfo"])}
            topo.register_remote_engine("P", self.g["EngineTransferInfo"](**{k: v for k, v in info.items()
                                                                              if k in names}))
        else:
            topo.register_remote_engine("P", **{k: v for k, v in info.items() if k in params})
        topo.block_size_ratio(p.block_size)
        me = self._worker(d, transfer_topo=topo, dst_num_blocks={"P": p.blocks[0]})
        self.g["_validate_remote_agent_handshake"](me, self._meta(p), p.tp)
        return ("ok", None)
