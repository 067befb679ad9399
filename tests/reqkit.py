"""Run vLLM's own request-path code, read from an unpacked wheel, against small stand-ins (no GPU, no vllm import).

A directory SRC/<release>/vllm/... holds the .py files of one wheel. From it this module executes, as the release
wrote them, the NixlConnector methods of the request path:
- scheduler: request_finished (the kv_transfer_params P hands out, whether it delays freeing, the expiry it
  stamps), get_num_new_matched_tokens + update_state_after_alloc + build_connector_meta (what D does with the
  params a router forwards), on_new_request (0.22+: heartbeat tracking);
- worker: _get_new_notifs (P's parsing of D's done notification and of "HB:" heartbeats), the expiry sweep (the
  `while self._reqs_to_send` loop of get_finished, or _reap_expired_send_leases), _handle_heartbeat,
  _pop_done_transfers (what a failed READ does), and the f-string D's _read_blocks builds its notification from.
The stand-ins: a clock the test moves, a logger that keeps the records, a NIXL wrapper that hands out given
notifications and transfer states, and the scheduler / worker attributes these methods read. Nothing here is part
of pdcheck; tests/test_requests_against_wheels.py compares pdcheck's request models with it.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import logging
import queue
import re
import sys
import textwrap
import threading
import types
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace as NS
from typing import Any

_SOURCES: dict[str, str] = {}


def key(release: str) -> tuple[int, ...]:
    return tuple(int(x) for x in release.split(".")[:3])


class Clock:
    """time.perf_counter / time.time / monotonic for the release's code: the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def perf_counter(self) -> float:
        return self.now

    time = monotonic = perf_counter


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))

    def at(self, level: str) -> list[str]:
        return [m for lv, m in self.lines if lv == level]


class _Any:
    """An attribute bag whose unknown methods do nothing (stats recorders and the like)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()


class Wrapper:
    """nixl_wrapper stand-in: notifications and transfer states given by the test, sends recorded."""

    def __init__(self) -> None:
        self.inbox: list[bytes] = []
        self.sent: list[tuple[str, bytes]] = []
        self.states: dict[int, str] = {}
        self.released: list[int] = []

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.inbox = self.inbox, []
        return {"D-agent": out} if out else {}

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.sent.append((agent, notif_msg))

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


def _methods(files: list[Path], suffix: str) -> dict[str, str]:
    """Source of every method of the classes named *<suffix> in files; a later file's (subclass) wins."""
    out: dict[str, str] = {}
    for path in files:
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith(suffix):
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef):
                        out[fn.name] = textwrap.dedent(ast.get_source_segment(text, fn) or "")
    return out


def _classes(files: list[Path], names: set[str]) -> list[str]:
    out = []
    for path in files:
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name in names:
                decos = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
                out.append(decos + (ast.get_source_segment(text, node) or ""))
    return out


def _exec(code: str, g: dict[str, Any], tag: str) -> None:
    name = f"<vllm {tag} #{len(_SOURCES)}>"
    _SOURCES[name] = code
    exec(compile(code, name, "exec"), g)  # noqa: S102 - vLLM's own source, read from the wheel on disk


_STUBS = {"vllm": types.ModuleType("vllm"), "vllm.v1": types.ModuleType("vllm.v1"),
          "vllm.v1.request": types.ModuleType("vllm.v1.request")}
_STUBS["vllm.v1.request"].RequestStatus = RequestStatus  # type: ignore[attr-defined]


def _stubbed(fn: Any) -> Any:
    """The method with `from vllm.v1.request import RequestStatus` answered by the stand-in, for its call only."""

    @functools.wraps(fn)
    def call(*a: Any, **k: Any) -> Any:
        saved = {n: sys.modules.get(n) for n in _STUBS}
        sys.modules.update(_STUBS)
        try:
            return fn(*a, **k)
        finally:
            for n, mod in saved.items():
                if mod is None:
                    sys.modules.pop(n, None)
                else:
                    sys.modules[n] = mod
    return call


class Wheel:
    """One unpacked wheel's request-path code, loaded into its own namespace."""

    def __init__(self, src: Path, release: str) -> None:
        self.release = release
        self.root = src / release / "vllm"
        v1 = self.root / "distributed/kv_transfer/kv_connector/v1"
        if (v1 / "nixl" / "pull_scheduler.py").exists():
            nixl = v1 / "nixl"
            sched_files = [nixl / "base_scheduler.py", nixl / "pull_scheduler.py"]
            worker_files = [nixl / "base_worker.py", nixl / "pull_worker.py"]
            meta_files = [nixl / "metadata.py", nixl / "utils.py"]
        elif (v1 / "nixl" / "scheduler.py").exists():  # 0.20 - 0.23: the package before the pull/push split
            nixl = v1 / "nixl"
            sched_files, worker_files = [nixl / "scheduler.py"], [nixl / "worker.py"]
            meta_files = [nixl / "metadata.py", nixl / "utils.py"]
        else:
            sched_files = worker_files = meta_files = [v1 / "nixl_connector.py"]
        self.worker_text = "\n".join(p.read_text() for p in worker_files)
        self.sched_text = "\n".join(p.read_text() for p in sched_files)
        self.log = Records()
        logger = logging.getLogger(f"reqkit.{release}")
        logger.handlers[:] = [self.log]
        logger.setLevel(logging.DEBUG)
        logger.propagate = False
        self.clock = Clock()
        mod = types.ModuleType(f"reqwheel_{release.replace('.', '_')}")
        sys.modules[mod.__name__] = mod  # dataclasses look their module up
        g = mod.__dict__
        self.envs = NS(VLLM_NIXL_ABORT_REQUEST_TIMEOUT=self.abort_timeout_default() or 0,
                       VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1", VLLM_NIXL_SIDE_CHANNEL_PORT=5600)
        g.update(dataclass=dataclasses.dataclass, field=dataclasses.field, logger=logger, time=self.clock,
                 envs=self.envs, defaultdict=defaultdict, queue=queue, Any=Any, Optional=Any,
                 RequestStatus=RequestStatus, KVConnectorMetadata=object, EngineId=str, ReqId=str,
                 TransferHandle=int, BlockIds=tuple, current_platform=NS(is_rocm=lambda: False, device_type="cuda"),
                 round_down=lambda x, m: x // m * m, cdiv=lambda a, b: -(-a // b))
        for code in _classes(meta_files, {"RemoteMeta", "ReqMeta", "NixlConnectorMetadata", "HeartbeatInfo"}):
            _exec("from __future__ import annotations\n" + code, g, release)
        self.g = g
        self.sched_src = _methods(sched_files, "ConnectorScheduler")
        self.worker_src = _methods(worker_files, "ConnectorWorker")
        self.sched_cls = self._cls("Sched", self.sched_src, ("request_finished", "get_num_new_matched_tokens",
                                                             "update_state_after_alloc", "build_connector_meta",
                                                             "on_new_request", "_stop_heartbeat",
                                                             "get_exchange_clipped_blocks", "get_sw_clipped_blocks", "_prefill_backoff", "_mamba_prefill_token_count",
                                                             "_get_remote_prefill_token_count",
                                                             "_truncate_request_for_prefill"))
        self.worker_cls = self._cls("Worker", self.worker_src, ("_get_new_notifs", "_handle_heartbeat",
                                                                "_reap_expired_send_leases", "_pop_done_transfers",
                                                                "_handle_failed_transfer", "_log_failure",
                                                                "_try_release_xfer_handle", "_send_heartbeats"))
        self._expire_fn = self._expiry_sweep()
        self._loader: type | None = None

    # ---- facts the release states as literals
    def abort_timeout_default(self) -> float | None:
        envs = self.root / "envs.py"
        m = re.search(r'"VLLM_NIXL_ABORT_REQUEST_TIMEOUT",\s*"(\d+)"', envs.read_text()) if envs.exists() else None
        return float(m.group(1)) if m else None

    def lease_default(self) -> float | None:
        for node in ast.walk(ast.parse(self.sched_text)):
            if (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "get_from_extra_config"
                    and len(node.args) == 2 and isinstance(node.args[0], ast.Constant)
                    and node.args[0].value == "kv_lease_duration"):
                return float(ast.literal_eval(node.args[1]))
        return None

    def lease_extension(self, lease: float) -> float | None:
        """What a heartbeat extends a lease to from now (the worker's `_lease_extension = ...`)."""
        for node in ast.walk(ast.parse(self.worker_text)):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute)
                    and node.targets[0].attr == "_lease_extension"):
                return eval(compile(ast.Expression(node.value), "<lease>", "eval"),  # noqa: S307 - the wheel's expr
                            {"kv_lease_duration": int(lease)})
        return None

    def failure_policy_default(self) -> str | None:
        cfg = self.root / "config/kv_transfer.py"
        if not cfg.exists():
            return None
        for node in ast.walk(ast.parse(cfg.read_text())):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and node.target.id == "kv_load_failure_policy" and node.value is not None):
                return ast.literal_eval(node.value)
        return None

    def failure_types(self) -> set[str]:
        return set(re.findall(r'failure_type="([a-z_]+)"', self.worker_text))

    def failure_log(self) -> str | None:
        m = re.search(r'"(NIXL transfer failure: %s[^"]*)"', self.worker_text)
        return m.group(1) if m else None

    def notif_format(self, req: str, consumers: int) -> bytes:
        """D's done notification as _read_blocks builds it (its `notif_id = f"..."` with the names bound)."""
        tree = ast.parse(self.worker_src["_read_blocks"])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                    and node.targets[0].id == "notif_id"):
                env = {"request_id": req, "remote_request_id": req, "tp_ratio": consumers,
                       "expected_consumers": consumers, "self": NS(world_size=consumers)}
                return eval(compile(ast.Expression(node.value), "<notif>", "eval"), env)  # noqa: S307
        raise LookupError(f"{self.release}: no notif_id in _read_blocks")

    def engine_id_checked(self) -> bool:
        """0.10+: the handshake refuses metadata whose engine_id is not the one the params named."""
        return "engine_id" in self.worker_text and bool(
            re.search(r"Remote NIXL agent engine ID mismatch", self.worker_text))

    # ---- the methods, bound to stand-in objects
    def _cls(self, name: str, src: dict[str, str], names: tuple[str, ...]) -> type:
        ns: dict[str, Any] = {}
        for n in names:
            if n in src:
                _exec("from __future__ import annotations\n" + src[n], self.g, self.release)
                ns[n] = _stubbed(self.g[n])
        return type(name, (), ns)

    def _expiry_sweep(self) -> Any:
        """The release's expiry statements: `_reap_expired_send_leases`, or get_finished's (0.30:
        get_transfer_results') `now = ...; while self._reqs_to_send: ...` as a function of done_sending; None before
        0.10 (nothing expires)."""
        if hasattr(self.worker_cls, "_reap_expired_send_leases"):
            return self.worker_cls._reap_expired_send_leases
        # 0.30 sweeps in get_transfer_results (get_finished wraps it), the others in get_finished
        src = self.worker_src.get("get_transfer_results") or self.worker_src.get("get_finished", "")
        fn = ast.parse(src).body[0]
        assert isinstance(fn, ast.FunctionDef)
        body = fn.body
        for i, st in enumerate(body):
            if isinstance(st, ast.While) and ast.unparse(st.test) == "self._reqs_to_send":
                prev = body[i - 1]
                stmts = [ast.get_source_segment(src, prev), ast.get_source_segment(src, st)]
                code = "def _expire(self, done_sending):\n" + textwrap.indent("\n".join(
                    textwrap.dedent(s or "") for s in stmts), "    ")
                _exec(code, self.g, self.release)
                return self.g["_expire"]
        return None

    def scheduler(self, lease: float | None = None) -> Any:
        s = self.sched_cls()
        lease = lease if lease is not None else (self.lease_default() or 30)
        pc = NS(tensor_parallel_size=1, decode_context_parallel_size=1, pipeline_parallel_size=1,
                data_parallel_rank_local=0, data_parallel_index=0)
        s.__dict__.update(
            vllm_config=NS(parallel_config=pc, cache_config=NS(block_size=16), num_prefill_lookahead_tokens=0),
            engine_id="P", side_channel_host="127.0.0.1", side_channel_port=5600, block_size=16, transfer_tp_size=1,
            _kv_lease_duration=lease, _heartbeat_interval=lease // 6, decoder_kv_blocks_ttl=480,
            is_bidirectional_kv_xfer_enabled=False, use_host_buffer=False, _reqs_need_recv={}, _reqs_need_save={},
            _reqs_need_send={}, _reqs_in_batch=set(), _reqs_not_processed=set(), _heartbeat_by_engine={},
            _heartbeat_req_engine={}, _last_heartbeat_time=0.0, _registration_generation=0, _TRANSFER_MODE="pull",
            blocks_per_sw=[0], _is_hma_required=False, _has_mamba=False, _bounded_replay=False,
            _ssm_spec_blocks=[None], kv_recompute_threshold=0,
            kv_cache_config=NS(select_transfer_block_ids=lambda b: b))
        return s

    def worker(self, lease: float | None = None) -> Any:
        w = self.worker_cls()
        lease = lease if lease is not None else (self.lease_default() or 30)
        ext = self.lease_extension(lease)
        w.__dict__.update(
            nixl_wrapper=Wrapper(), engine_id="P", tp_rank=0, world_size=1, _reqs_to_send={}, _reqs_to_process=set(),
            consumer_notification_counts_by_req=defaultdict(int), expected_consumer_notifications_by_req={},
            _lease_extension=ext if ext is not None else lease, xfer_stats=_Any(), _recving_metadata={},
            _recving_transfers=defaultdict(list), _invalid_block_ids=set(), _failed_recv_reqs=set(),
            transfer_topo=NS(tp_ratio=_tp_ratio), kv_topo=NS(tp_ratio=_tp_ratio), _recv_failures=set(),
            _xfer_handles_to_release={}, _pending_recv_notifs={}, use_mla=False, _is_hma_required=False)
        return w

    def heartbeats(self, params: dict[str, Any], lease: float | None = None) -> list[bytes]:
        """What D sends P for a request with these params while its scheduler tracks it (0.24+): on_new_request,
        then the worker's _send_heartbeats on the scheduler's heartbeat_by_engine (the handshake done)."""
        s, wk = self.scheduler(lease), self.worker(lease)
        if not hasattr(s, "on_new_request") or not hasattr(wk, "_send_heartbeats"):
            return []
        s.on_new_request(request("d-0", dict(params), RequestStatus.WAITING))
        wk.__dict__.update(_ensure_handshake=lambda *a, **k: None, _engine_last_active={},
                           _hb_handshake_notif_only=False,
                           _remote_agents={e: {0: f"{e}-agent"} for e in s._heartbeat_by_engine})
        wk._send_heartbeats(NS(heartbeat_by_engine=s._heartbeat_by_engine))
        return [msg for _agent, msg in wk.nixl_wrapper.sent]

    def load(self, metadata: Any, known: bool, **state: Any) -> tuple[str, Any]:
        """D's worker takes the scheduler's metadata (start_load_kv, as the release wrote it) with P's engine
        already handshaken (known) or not: ("read", what it looked up: the state recorded at the handshake) when
        it goes on to the READ, ("handshake", the tp_size it hands the handshake) when it starts one. state: worker
        attributes over the defaults (e.g. the registration generations a heartbeat's handshake recorded)."""
        if self._loader is None:
            self._loader = self._cls("Loader", self.worker_src, ("start_load_kv", "_read_blocks_for_req",
                                                                "_read_blocks"))
        w = self._loader()

        def handshake(*a: Any) -> None:
            meta = a[2] if len(a) == 3 else None  # (req_id, engine_id, meta); 0.9.1's _nixl_handshake(host, port)
            raise Reached("handshake", getattr(meta, "tp_size", None))

        def read(_req_id: str, _meta: Any) -> None:
            raise Reached("read", "_read_blocks_for_req")

        # start_load_kv checks _remote_agents itself (0.9.2 - 0.26): its _read_blocks_for_req is the READ; else
        # the release's own read path runs up to its first look at the engine's recorded state.
        checks = "_remote_agents" in self.worker_src["start_load_kv"]
        w.__dict__.update(
            engine_id="D", tp_rank=0, world_size=1, _remote_agents={"P": {0: "P-agent"}} if known else {},
            _handshake_lock=threading.Lock(), _ready_requests=queue.Queue(), _recving_metadata={},
            _reqs_to_process=set(), _reqs_to_send={}, _background_nixl_handshake=handshake,
            _nixl_handshake=handshake, _send_heartbeats=lambda m: None, _invalid_remote_engines=set(),
            # what D's handshake with P left behind (0.34: the first request's registration generation, 1)
            _remote_registration_generations={"P": 1} if known else {}, _engine_last_active={},
            _bidirectional_kv_xfer_enabled=False, _physical_blocks_per_logical_kv_block=1, pcp_rank=0,
            use_host_buffer=False,  # 0.10.1 - 0.11.0's start_load_kv asks before it reads
            _recving_transfers={},  # 0.32 - 0.33 seed it before they look at the engine's state
            pcp_dcp_sharded=False, transfer_topo=NS(), _logical_to_kernel_block_ids=lambda ids, *a: ids,
            _tp_size=_Recorded("_tp_size", {"D": 1}), tp_mappings=_Recorded("tp_mappings", {}))
        w.__dict__.update(state)
        if checks:
            w._read_blocks_for_req = read
        try:
            w.start_load_kv(metadata)
        except Reached as got:
            return got.what, got.value
        raise AssertionError(f"{self.release}: start_load_kv neither read nor handshook")

    def expire(self, w: Any) -> set[str]:
        done: set[str] = set()
        if self._expire_fn is not None:
            self._expire_fn(w, done)
        return done


class Reached(Exception):
    """Where D's worker went with a request: stops the release's code there."""

    def __init__(self, what: str, value: Any) -> None:
        super().__init__(what)
        self.what, self.value = what, value


class _Recorded(dict):  # type: ignore[type-arg]
    """State the release recorded at its handshake: looking up a remote engine's entry is the READ's first step."""

    def __init__(self, name: str, own: dict[str, Any]) -> None:
        super().__init__(own)
        self.name = name

    def __getitem__(self, k: str) -> Any:
        if k in self:
            return super().__getitem__(k)  # D's own entry (0.9.1's `_tp_size[self.engine_id]`)
        raise Reached("read", f"{self.name}[{k!r}]")


def _tp_ratio(remote_tp: int, local_tp: int = 1) -> int:
    """TpKVTopology.tp_ratio for a P of TP 1: negative when the remote (D) has more ranks."""
    return local_tp // remote_tp if local_tp >= remote_tp else -(remote_tp // local_tp)


def request(req_id: str, params: dict[str, Any] | None, status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED,
            tokens: int = 32) -> NS:
    return NS(request_id=req_id, kv_transfer_params=params, status=status, num_computed_tokens=tokens,
              prompt_token_ids=list(range(tokens)), num_prompt_tokens=tokens, num_tokens=tokens)


class Blocks:
    """KVCacheBlocks stand-in: the unhashed block ids D allocated."""

    def __init__(self, ids: list[int], grouped: bool) -> None:
        self.ids, self.grouped = ids, grouped
        self.blocks = ([NS(block_hash=None, is_null=False) for _ in ids],)

    def get_unhashed_block_ids(self) -> list[int]:
        return list(self.ids)

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def grouped(w: Wheel) -> bool:
    """0.2x+: block ids are per KV cache group (a tuple of lists)."""
    return "get_unhashed_block_ids_all_groups" in w.sched_text or "block_ids: \"BlockIds\"" in w.sched_text

