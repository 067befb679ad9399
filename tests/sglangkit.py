"""Runs SGLang's own NIXL disaggregation code (manager, sender, receiver, bootstrap server) from an unpacked wheel,
one release per subprocess, for tests/test_sglang_fidelity.py.

Child side (`python tests/sglangkit.py ROLE ROOT PARAMS_JSON`): sys.path starts with ROOT (one release's `sglang/`
tree, never installed), so releases never mix. SGLang's package __init__ files and the modules that pull in a
GPU or a model zoo (server_args, the attention-TP getters, the distributed groups, 0.5.23's runtime context,
model configs, tracing) are replaced in sys.modules by stand-ins; a stand-in's other names are SGLang's own
top-level definitions, compiled from that module's source on first use (with the imports they need), so helpers
such as get_zmq_socket_on_host or run_with_deadline are the release's code. Everything else is real: the
disaggregation package (base/common/nixl conn.py, utils), the aiohttp bootstrap server, ZMQ, and NIXL agents
(UCX on host memory; "VRAM" is registered as "DRAM", the one GPU-only piece of the transfer).
The child writes JSON lines on stdout: {"ready": ...} then {"done": ...}; it exits when stdin closes.

Parent side: `releases()`, `Child` (spawn, read the lines, always reaped).
"""

from __future__ import annotations

import ast
import json
import os
import queue
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SRC = Path(os.environ.get("PDCHECK_SGLANG_SRC", "/nonexistent"))
CONN = "sglang/srt/disaggregation/nixl/conn.py"


# Releases unpacked whole that the kit cannot start: their code predates what the stand-ins start from.
UNSUPPORTED = {"0.4.5.post3": "its NIXL disaggregation predates disaggregation/common (CommonKVBootstrapServer, the "
                              "common manager) that this kit starts SGLang's roles from"}


def releases() -> list[str]:
    """The releases under PDCHECK_SGLANG_SRC unpacked whole (not only disaggregation/)."""
    whole = ("sglang/srt/utils.py", "sglang/srt/utils/common.py")  # <= 0.4.x, 0.5+
    out = [p.name for p in SRC.glob("0.*") if (p / CONN).is_file() and any((p / w).is_file() for w in whole)]
    return sorted(out, key=lambda v: tuple(int(x) for x in v.split(".")[:3]))


# ----------------------------------------------------------------------------------------------- parent
class Child:
    """One release's SGLang role in its own process; every line it prints is a JSON object."""

    def __init__(self, role: str, release: str, params: dict[str, Any]) -> None:
        env = dict(os.environ, SGLANG_HOST_IP="127.0.0.1", PYTHONUNBUFFERED="1",
                   SGLANG_DISAGGREGATION_WAITING_TIMEOUT=str(params.get("waiting_timeout", 300)),
                   SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL="2")
        env.pop("PYTHONPATH", None)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), role, str(SRC / release),
                                      json.dumps(params)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT))
        self.lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.put(json.loads(line))
        self.lines.put(None)

    def expect(self, key: str, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while True:
            try:
                got = self.lines.get(timeout=max(0.05, end - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no {key!r} line within {timeout_s:g} s; stderr:\n{self.stderr()}") from None
            if got is None:
                time.sleep(0.2)
                raise RuntimeError(f"the child ended before {key!r}; stderr:\n{self.stderr()}")
            if key in got:
                return got[key]
            if "harness" in got:
                raise RuntimeError(f"the child failed: {got['harness']}; stderr:\n{self.stderr()}")

    def stderr(self) -> str:
        return "".join(self.err[-60:])

    def close(self) -> int:
        """Close stdin (the child's signal to stop), then wait; killed if it does not end."""
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)

    def __enter__(self) -> Child:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ child: stand-ins
class _Placeholder:
    """A name SGLang imports that this harness never needs; using it says which one."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *a: Any, **k: Any) -> Any:
        raise RuntimeError(f"sglangkit: {self._name} is a stand-in and was called")

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Partial(types.ModuleType):
    """A stand-in module: `given` names first, then SGLang's own top-level definition of the name from `source`
    (compiled on first use, with the definitions and imports it refers to), else a _Placeholder."""

    def __init__(self, name: str, source: Path | None, given: dict[str, Any], package: Path | None = None) -> None:
        super().__init__(name)
        self.__dict__.update(given)
        self.__dict__["__sgk_index"] = _index(source) if source and source.is_file() else {}
        self.__dict__["__sgk_source"] = str(source)
        if package is not None:
            self.__path__ = [str(package)]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        _define(self.__dict__, name, set())
        return self.__dict__.setdefault(name, _Placeholder(f"{self.__name__}.{name}"))


def _index(path: Path) -> dict[str, ast.stmt]:
    tree = ast.parse(path.read_text(), str(path))
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out.setdefault(node.target.id, node)
        elif isinstance(node, ast.Import | ast.ImportFrom) and not (
                isinstance(node, ast.ImportFrom) and node.module == "__future__"):
            for a in node.names:
                out.setdefault((a.asname or a.name).split(".")[0], node)
    return out


def _define(ns: dict[str, Any], name: str, busy: set[str]) -> None:
    index: dict[str, ast.stmt] = ns["__sgk_index"]
    node = index.get(name)
    if node is None or name in ns or name in busy:
        return
    busy.add(name)
    if isinstance(node, ast.Import | ast.ImportFrom):
        alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == name)
        stmt = ast.Import([alias]) if isinstance(node, ast.Import) else ast.ImportFrom(node.module, [alias], node.level)
        try:
            exec(compile(ast.fix_missing_locations(ast.Module([stmt], [])), ns["__sgk_source"], "exec"), ns)  # noqa: S102
        except Exception:  # a heavy import: the name stays a placeholder
            ns[name] = _Placeholder(f"{ns['__name__']}.{name}")
        return
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id != name:
            _define(ns, sub.id, busy)
    exec(compile(ast.Module([node], []), ns["__sgk_source"], "exec"), ns)  # noqa: S102 - SGLang's own source


class _Group:
    """A one-rank process group (get_pp_group / get_world_group / pp_group): nothing to synchronise."""

    world_size = 1
    rank_in_group = 0
    rank = 0
    is_first_rank = True
    is_last_rank = True
    cpu_group = None
    device_group = None

    def barrier(self, *a: Any, **k: Any) -> None:
        pass


class _Ctx(types.SimpleNamespace):
    """0.5.23's runtime-context views (get_parallel(), get_serving(), ...): the values given, None otherwise
    (every flag off)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return None


def install(root: Path, p: dict[str, Any]) -> None:
    """The stand-ins, before the first `import sglang...`."""
    sys.path.insert(0, str(root))
    srt = root / "sglang" / "srt"
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.distributed", "sglang.srt.configs",
                 "sglang.srt.mem_cache", "sglang.srt.observability"):
        if name not in ("sglang.srt.distributed",):
            mod = types.ModuleType(name)
            mod.__path__ = [str(root / name.replace(".", "/"))]
            sys.modules[name] = mod
    tp, rank = p.get("tp_size", 1), p.get("tp_rank", 0)

    class ServerArgs(types.SimpleNamespace):
        pass

    def part(name: str, rel: str | None, package: bool = False, **given: Any) -> None:
        path = srt / rel if rel else None
        sys.modules[name] = _Partial(name, path, given, (root / name.replace(".", "/")) if package else None)

    part("sglang.srt.server_args", None, ServerArgs=ServerArgs, get_global_server_args=lambda: None)
    if (srt / "utils.py").is_file():  # <= 0.4.x: one module
        part("sglang.srt.utils", "utils.py", is_npu=lambda: False)
    else:
        part("sglang.srt.utils", "utils/common.py", package=True, is_npu=lambda: False)
    part("sglang.srt.utils.common", "utils/common.py", is_npu=lambda: False)
    if (srt / "utils" / "network.py").is_file():
        part("sglang.srt.utils.network", "utils/network.py")
    part("sglang.srt.distributed", None, package=True, get_pp_group=_Group, get_world_group=_Group,
         get_tensor_model_parallel_rank=lambda: rank, get_tensor_model_parallel_world_size=lambda: tp)
    part("sglang.srt.distributed.parallel_state", "distributed/parallel_state.py", GroupCoordinator=_Group)
    part("sglang.srt.layers.dp_attention", None, get_attention_tp_size=lambda: tp, get_attention_tp_rank=lambda: rank,
         get_attention_dp_size=lambda: 1, get_attention_dp_rank=lambda: 0, get_attention_cp_size=lambda: 1,
         get_attention_cp_rank=lambda: 0)
    part("sglang.srt.configs.model_config", "configs/model_config.py", is_deepseek_dsa=lambda *a, **k: False)
    part("sglang.srt.observability.trace", "observability/trace.py")
    part("sglang.srt.mem_cache.page_interleave", "mem_cache/page_interleave.py")
    if (srt / "runtime_context.py").is_file():
        parallel = _Ctx(attn_tp_size=tp, attn_tp_rank=rank, tp_size=tp, tp_rank=rank, attn_cp_size=1,
                        attn_cp_rank=0, attn_dcp_size=1, attn_dcp_rank=0, attn_dp_size=1, attn_dp_rank=0, dp_size=1, num_dp_ranks=1,
                        pp_size=1, pp_rank=0, dist_init_addr=None, pp_group=_Group(), nnodes=1, node_rank=0)
        serving = _Ctx(host="127.0.0.1", port=p.get("http_port", 30000))
        disagg = _Ctx(disaggregation_bootstrap_port=p.get("bootstrap_port", 8998),
                      disaggregation_mode=p.get("mode"), disaggregation_transfer_backend="nixl",
                      disaggregation_decode_allocation_policy=p.get("allocation_policy", "early"),
                      disaggregation_ib_device=None)
        device = _Ctx(device="cpu", gpu_id=0)
        part("sglang.srt.runtime_context", "runtime_context.py", get_parallel=lambda: parallel,
             get_serving=lambda: serving, get_disagg=lambda: disagg, get_device=lambda: device,
             get_schedule=lambda: _Ctx(), get_observability=lambda: _Ctx(), get_spec=lambda: _Ctx(),
             get_resources=lambda: _Ctx(), linear_attn_tp_size=lambda: tp, max_prefill_buffer_tokens=lambda: 1 << 20)
    _dram_only()


def _nixl_by_its_name() -> None:
    """SGLang imports `nixl`, the meta package that picks nixl_cu12 or nixl_cu13 by the CUDA it finds (with no
    CUDA, the first installed). pdcheck depends on nixl-cu13 only: the same library, under SGLang's name."""
    import importlib.util

    if importlib.util.find_spec("nixl") is not None:
        return
    import nixl_cu13

    sys.modules["nixl"] = nixl_cu13
    for sub in ("_api", "_bindings", "logging"):
        sys.modules[f"nixl.{sub}"] = importlib.import_module(f"nixl_cu13.{sub}")


def _settled(state: str, side: Any) -> dict[str, str]:
    """A room's end on a sender or receiver: its state, and for Failed the exception SGLang raises for it."""
    out = {"state": state}
    if state == "Failed":
        try:
            side.failure_exception()
        except Exception as exc:
            out["exception"] = f"{type(exc).__name__}: {exc}"
    return out


def _dram_only() -> None:
    """Host buffers stand in for VRAM: every "VRAM" SGLang hands NIXL becomes "DRAM" (reference §10); and the
    NIXL 1.5 API: register_memory lost its is_sorted keyword, which 0.4.x passes."""
    _nixl_by_its_name()
    from nixl._api import nixl_agent

    def wrap(fn: Any, pos: int) -> Any:
        def call(self: Any, *a: Any, **k: Any) -> Any:
            a = list(a)
            if len(a) > pos and a[pos] == "VRAM":
                a[pos] = "DRAM"
            if k.get("mem_type") == "VRAM":
                k["mem_type"] = "DRAM"
            k.pop("is_sorted", None)  # <= 0.4.9's hint for the NIXL of its day; NIXL 1.5 has no such argument
            return fn(self, *a, **k)
        return call

    for name, pos in (("register_memory", 1), ("get_xfer_descs", 1), ("get_reg_descs", 1), ("prep_xfer_dlist", 2),
                      ("deregister_memory", 99)):
        setattr(nixl_agent, name, wrap(getattr(nixl_agent, name), pos))



# ------------------------------------------------------------------------------------------- child: roles
def _emit(key: str, value: Any) -> None:
    print(json.dumps({key: value}), flush=True)


def _kv_args(KVArgs: type, **given: Any) -> Any:
    """SGLang's KVArgs as its scheduler fills it for a plain MHA pool: the given fields, the rest empty."""
    a = KVArgs()
    for name, ann in getattr(KVArgs, "__annotations__", {}).items():  # strings: the modules defer annotations
        if hasattr(a, name):
            continue
        s = str(ann)
        setattr(a, name, None if s.startswith("Optional") else [] if s.startswith(("List", "list")) else
                0 if s == "int" else False if s == "bool" else None)
    for k, v in given.items():
        setattr(a, k, v)
    return a


class _Setup:
    """One SGLang server's KV pool and metadata buffers on host memory, pdcheck's layout and pattern."""

    def __init__(self, root: Path, p: dict[str, Any], mode: str) -> None:
        import numpy as np
        from sglang.srt.disaggregation.base.conn import KVArgs
        from sglang.srt.disaggregation.utils import DisaggregationMode

        from pdcheck.kvcache import KVCache
        from pdcheck.sglang.engine import Side
        from pdcheck.sglang.ranks import sglang_order

        self.side = Side(**p["side"])
        self.kv = KVCache(self.side.geometry(), self.side.num_pages, "cpu", 0, "HND")
        ptrs = sglang_order(self.kv)
        item = self.kv.block_len
        self.aux = np.zeros((16, 64), dtype=np.uint8)  # the metadata buffers: 16 slots of 64 bytes
        rank, tp = p.get("tp_rank", 0), self.side.tp_size
        g = self.side.geometry()
        self.args = _kv_args(
            KVArgs, engine_rank=rank, kv_data_ptrs=ptrs, kv_data_lens=[item * self.side.num_pages] * len(ptrs),
            kv_item_lens=[item] * len(ptrs), kv_layer_ids=[], aux_data_ptrs=[self.aux.ctypes.data],
            aux_data_lens=[self.aux.nbytes], aux_item_lens=[64], ib_device=None, ib_traffic_class=None, gpu_id=0,
            decode_tp_size=tp, kv_head_num=g.local_kv_heads, total_kv_head_num=self.side.kv_heads,
            page_size=self.side.page_size, prefill_pp_size=1, pp_rank=0, prefill_start_layer=0, system_dp_rank=0,
            kv_cache_dtype_str=self.side.kv_cache_dtype, state_types=[], state_data_ptrs=[], state_data_lens=[],
            state_item_lens=[], state_layer_ids=[], state_dim_per_tensor=[], state_slice_outer_counts=[],
            state_conv_shard_groups=[], is_hybrid_mla_backend=False, kv_buf_groups=1)
        self.server_args = types.SimpleNamespace(
            host="127.0.0.1", disaggregation_bootstrap_port=p["bootstrap_port"], dist_init_addr=None,
            enable_dp_attention=False, dp_size=1, tp_size=tp, pp_size=1, page_size=self.side.page_size,
            kv_cache_dtype=self.side.kv_cache_dtype, load_balance_method="round_robin",
            disaggregation_decode_allocation_policy="early", disaggregation_mode=mode,
            enable_hisparse=False)  # ServerArgs' default: 0.5.10 - 0.5.12's D reads it on a page-size mismatch
        self.mode = DisaggregationMode.PREFILL if mode == "prefill" else DisaggregationMode.DECODE


def _state(x: Any) -> str:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return {int(getattr(KVPoll, n)): n for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring",
                                                   "Success")}.get(int(x), str(x))


def _stdin(wait_s: float = 0.0) -> str | None:
    """The parent's word: "line" (report now), "eof" (stop), None (nothing yet)."""
    import select

    r, _w, _x = select.select([sys.stdin], [], [], wait_s)
    if not r:
        return None
    return "line" if sys.stdin.readline() else "eof"


def prefill(root: Path, p: dict[str, Any]) -> None:
    """SGLang's bootstrap server and PREFILL NixlKVManager; one NixlKVSender per room, driven as the prefill
    scheduler does (poll until WaitingForInput, init(num_pages, aux_index), send(pages)); KV pages tagged with
    pdcheck's pattern (p["tag"], P rank) so the D that receives them can check every byte."""
    import inspect

    import numpy as np
    from sglang.srt.disaggregation.common.conn import CommonKVBootstrapServer
    from sglang.srt.disaggregation.nixl import conn

    # (host, port) from 0.5.3; earlier releases bind every interface: CommonKVBootstrapServer(port)
    two = len(inspect.signature(CommonKVBootstrapServer.__init__).parameters) > 2
    server = CommonKVBootstrapServer(*(("127.0.0.1",) if two else ()), p["bootstrap_port"])
    s = _Setup(root, p, "prefill")
    rank = p.get("tp_rank", 0)
    pages_all = sorted({pg for r in p["requests"] for pg in r["pages"]})
    s.kv.tag_many(p["tag"], rank, {r: pages_all for r in range(s.side.num_ptrs)})
    mgr = conn.NixlKVManager(s.args, s.mode, s.server_args, False)
    _emit("ready", {"agent": mgr.agent.name, "rank_port": mgr.rank_port})
    addr = f"127.0.0.1:{p['bootstrap_port']}"
    params = inspect.signature(conn.NixlKVSender.__init__).parameters
    senders: dict[int, Any] = {}
    for r in p["requests"]:
        kw = {k: v for k, v in (("dest_tp_ranks", [rank]), ("pp_rank", 0)) if k in params}
        senders[r["room"]] = conn.NixlKVSender(mgr, addr, r["room"], **kw)
    pages = {r["room"]: np.asarray(r["pages"], dtype=_index_dtype(conn.NixlKVSender.send)) for r in p["requests"]}
    result: dict[str, Any] = {}
    last: dict[int, str] = {}
    sent: set[int] = set()
    end = time.monotonic() + p.get("timeout_s", 30)
    word = None
    while len(result) < len(senders) and time.monotonic() < end and word is None:
        word = _stdin()
        for room, snd in senders.items():
            if str(room) in result:
                continue
            try:
                st = last[room] = _state(snd.poll())
                if st == "WaitingForInput" and room not in sent:
                    snd.init(len(pages[room]), 0)
                    snd.send(pages[room]) if "state_indices" not in inspect.signature(snd.send).parameters \
                        else snd.send(pages[room], None)
                    sent.add(room)
                elif st in ("Success", "Failed"):
                    result[str(room)] = _settled(st, snd)
            except Exception as exc:
                result[str(room)] = {"state": "raised", "exception": f"{type(exc).__name__}: {exc}"}
        time.sleep(0.01)
    for room in senders:
        result.setdefault(str(room), {"state": "pending", "last": last.get(room)})
    _emit("done", {"rooms": result, "bootstrap_thread_alive": _thread_alive("bootstrap"),
                   "status": {str(k): _state(v) for k, v in dict(mgr.request_status).items()},
                   "infos": [str(k) for k in getattr(mgr, "transfer_infos", {})]})
    while word != "eof":
        word = _stdin(1.0)
    server.close()


def _index_dtype(fn: Any) -> str:
    """The page-index dtype the release's scheduler hands this method, from its own annotation (int64 up to
    0.4.7, int32 after)."""
    ann = str(getattr(fn, "__annotations__", {}).get("kv_indices", ""))
    return "int64" if "int64" in ann else "int32"


def _thread_alive(word: str) -> bool:
    return any(word in (t.name or "") or word in getattr(getattr(t, "_target", None), "__name__", "")
               for t in threading.enumerate())


def decode(root: Path, p: dict[str, Any]) -> None:
    """SGLang's DECODE NixlKVManager and one NixlKVReceiver per room against a live bootstrap server, driven as
    the decode scheduler does (<= 0.5.8: receiver(...) then init(pages, aux_index); 0.5.13+: receiver(...),
    try_ensure_parallel_info, init(prefill_dp_rank), send_metadata(pages, aux_index)); then every received
    page checked against pdcheck's pattern (p["tag"], P rank 0, the same page ids on P)."""
    import numpy as np
    from sglang.srt.disaggregation.nixl import conn

    from pdcheck.pattern import pattern
    from pdcheck.sglang.ranks import region_of

    s = _Setup(root, p, "decode")
    mgr = conn.NixlKVManager(s.args, s.mode, s.server_args, False)
    _emit("ready", {"agent": mgr.agent.name})
    addr = f"127.0.0.1:{p['bootstrap_port']}"
    result: dict[str, Any] = {}
    recv: dict[int, Any] = {}
    pages = {r["room"]: np.asarray(r["pages"], dtype=np.int32) for r in p["requests"]}
    new = hasattr(conn.NixlKVReceiver, "send_metadata")
    for r in p["requests"]:
        room = r["room"]
        try:
            rc = conn.NixlKVReceiver(mgr, addr, room)
            if new:
                ok = False
                for _ in range(20):  # the scheduler retries the parallel-info fetch
                    ok = mgr.try_ensure_parallel_info(addr)
                    if ok:
                        break
                    time.sleep(0.1)
                if not ok:
                    result[str(room)] = {"state": "bootstrap", "exception": "try_ensure_parallel_info: False"}
                    continue
                rc.init(0)
                rc.send_metadata(pages[room], 0)
            else:
                rc.init(pages[room].astype(_index_dtype(conn.NixlKVReceiver.init)), 0)
            recv[room] = rc
        except Exception as exc:
            result[str(room)] = {"state": "raised", "exception": f"{type(exc).__name__}: {exc}"}
    end = time.monotonic() + p.get("timeout_s", 30)
    while len(result) < len(p["requests"]) and time.monotonic() < end:
        for room, rc in recv.items():
            if str(room) in result:
                continue
            st = _state(rc.poll())
            if st in ("Success", "Failed"):
                result[str(room)] = _settled(st, rc)
        time.sleep(0.01)
    for room, rc in recv.items():
        result.setdefault(str(room), {"state": "pending", "last": _state(rc.poll())})
    side = s.side
    for room, got_pages in pages.items():
        res = result[str(room)]
        if res["state"] != "Success":
            continue
        wrong = checked = 0
        for idx in range(side.num_ptrs):
            region = region_of(idx, side.layers, side.mla)
            got = s.kv.read_blocks(region, got_pages)
            want = pattern(p["tag"], 0, region_of(idx, p["p_layers"], False), got_pages, 0, s.kv.block_len)
            wrong += int((got != want).any(axis=1).sum())
            checked += len(got_pages)
        res.update(checked=checked, wrong=wrong)
    _emit("done", {"rooms": result})
    while _stdin(1.0) != "eof":
        pass


ROLES = {"prefill": prefill, "decode": decode}


if __name__ == "__main__":
    _role, _root, _params = sys.argv[1], Path(sys.argv[2]), json.loads(sys.argv[3])
    import logging

    logging.basicConfig(level=_params.get("log", "INFO"), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    install(_root, _params)
    sys.path.insert(1, str(ROOT))  # pdcheck, for its KV layout and pattern
    import importlib

    for _mod in _params.get("imports", []):
        importlib.import_module(_mod)
    try:
        if _role in ROLES:
            ROLES[_role](_root, _params)
        else:
            _emit("ready", {"imported": _params.get("imports", [])})
    except Exception as _exc:  # the harness's own failure: one line for the parent, the traceback on stderr
        import traceback

        traceback.print_exc()
        _emit("harness", f"{type(_exc).__name__}: {_exc}")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # SGLang's bootstrap and heartbeat threads are not daemons
