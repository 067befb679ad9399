"""`pdcheck probe` against vLLM's OWN side-channel listener and metadata classes, read from unpacked wheels.

Opt-in: PDCHECK_VLLM_SRC=DIR, where DIR/<release>/vllm/... holds the .py files of one wheel
(`pip download vllm==X --no-deps`, `unzip whl 'vllm/*.py'`). The listener function, GET_META_MSG and the
NixlAgentMetadata / NixlHandshakePayload dataclasses run as the release wrote them; only the imports they make
from the rest of vLLM (zmq_ctx, make_zmq_path, envs, logger, the abstract base class) are small stand-ins.
Nothing here is part of pdcheck.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import inspect
import itertools
import logging
import os
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import zmq
from portkit import free_run
from test_live import pdcheck, probe_json

SRC = os.environ.get("PDCHECK_VLLM_SRC")
pytestmark = pytest.mark.skipif(not SRC, reason="PDCHECK_VLLM_SRC (unpacked vLLM wheels) not set")

NUM_BLOCKS = [3008, 2992]
HASH = "ab" * 32


def _sources(release: str) -> list[Path]:
    root = Path(SRC or "") / release / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    return sorted(p for p in root.rglob("*.py") if "nixl" in str(p.relative_to(root)))


def _segment(release: str, name: str) -> str:
    """The source of the first class/function `name` in the release's NixlConnector files, decorators included
    (staticmethod dropped: the listener runs as a plain function)."""
    for path in _sources(release):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name == name:
                decos = [d for d in node.decorator_list if ast.unparse(d) != "staticmethod"]
                start = min([d.lineno for d in decos] + [node.lineno]) - 1
                return textwrap.dedent("\n".join(lines[start:node.end_lineno]))
    raise LookupError(f"{name} not found in {release}")


def _zmq_ctx(bind: bool) -> Any:
    """vLLM's zmq_ctx helper: a socket that binds (listener) or connects (decode), its context destroyed with
    linger 0."""

    @contextlib.contextmanager
    def zmq_ctx(socket_type: Any, addr: str) -> Any:
        ctx = zmq.Context()
        try:
            sock = ctx.socket(socket_type)
            if bind:
                sock.bind(addr)
            else:
                sock.connect(addr)
            yield sock
        finally:
            ctx.destroy(linger=0)

    return zmq_ctx


def _load(release: str) -> dict[str, Any]:
    zmq_ctx = _zmq_ctx(bind=True)  # vLLM's listener: its ROUTER binds

    class KVConnectorHandshakeMetadata:  # vLLM's is an empty ABC
        pass

    ns: dict[str, Any] = {
        "msgspec": msgspec, "zmq": zmq, "time": time, "threading": threading, "Any": Any,
        "dataclass": dataclasses.dataclass, "field": dataclasses.field, "logger": logging.getLogger("vllm-src"),
        "KVConnectorHandshakeMetadata": KVConnectorHandshakeMetadata, "zmq_ctx": zmq_ctx,
        "make_zmq_path": lambda scheme, host, port=None: f"{scheme}://{host}:{port}",
        "envs": SimpleNamespace(VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1"), "GET_META_MSG": b"get_meta_msg",
    }
    for name in ("NixlAgentMetadata", "NixlHandshakePayload", "_nixl_handshake_listener"):
        exec(compile(_segment(release, name), f"<vllm {release} {name}>", "exec"), ns)  # noqa: S102
    return ns


def _serve_real(release: str, port: int) -> tuple[threading.Thread, threading.Event]:
    ns = _load(release)
    meta_cls, payload_cls, listener = ns["NixlAgentMetadata"], ns["NixlHandshakePayload"], ns["_nixl_handshake_listener"]
    enc = msgspec.msgpack.Encoder()
    values = dict(engine_id="vllm-prefill", kv_caches_base_addr=[4096, 8192], device_id=0, block_lens=[4096, 4096],
                  block_strides=[4096, 4096], kv_cache_layout="HND", block_size=16, ssm_sizes=(0, 0),
                  attn_backend_name="FLASH_ATTN", physical_blocks_per_logical_kv_block=1)
    fields = {f.name for f in dataclasses.fields(meta_cls)}
    params = list(inspect.signature(listener).parameters)
    src = _segment(release, "_nixl_handshake_listener")
    data: dict[Any, bytes] = {}
    for r, n in enumerate(NUM_BLOCKS):
        blob = b"nixlSerDes|Agent" + len(f"p{r}").to_bytes(8, "little") + f"p{r}".encode() + b"|"
        meta = meta_cls(**{k: v for k, v in {**values, "agent_metadata": blob, "num_blocks": n}.items()
                           if k in fields})
        payload = payload_cls(compatibility_hash=HASH, agent_metadata_bytes=enc.encode(meta))
        data[(0, r) if "tuple[int, int]" in src else r] = enc.encode(payload)
    ready, stop = threading.Event(), threading.Event()
    args = (data, ready, stop, "127.0.0.1", port) if "host" in params else (data, ready, stop, port)
    t = threading.Thread(target=listener, args=args, daemon=True)
    t.start()
    assert ready.wait(5)
    return t, stop


def with_vllm_handshake(release: str) -> dict[str, Any]:
    """The release's module namespace with its own decode-side `_nixl_handshake` compiled into it."""
    ns = _load(release)

    zmq_ctx = _zmq_ctx(bind=False)  # vLLM's decode: its REQ connects

    ns.update(zmq_ctx=zmq_ctx, itertools=itertools)
    exec(compile(_segment(release, "_nixl_handshake"), f"<vllm {release} _nixl_handshake>", "exec"), ns)  # noqa: S102
    return ns


# The listener thread dying on the wrong-era request is the point: its traceback is expected.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("release", ["0.13.0", "0.20.0", "0.26.0", "0.34.0"])
def test_probe_reads_vllms_own_listener_and_wrong_era_kills_it(release):
    if not (Path(SRC or "") / release).is_dir():
        pytest.skip(f"{release} not unpacked under PDCHECK_VLLM_SRC")
    port = free_run()
    thread, stop = _serve_real(release, port)
    try:
        for _ in range(2):  # the real listener survives a probe of its own era
            code, rep = probe_json(f"127.0.0.1:{port}", "--vllm", release, "--tp-size", "2")
            assert code == 0, rep
            assert [r["num_blocks"] for r in rep["prefill_ranks"]] == NUM_BLOCKS
            assert [r["agent_name"] for r in rep["prefill_ranks"]] == ["p0", "p1"]
            assert all(r["compat_hash"] == HASH for r in rep["prefill_ranks"])
        assert thread.is_alive()
        # One request of another era and vLLM's own listener thread is gone: why --vllm auto sends nothing.
        other = "0.26.0" if release < "0.26" else "0.13.0"
        r = pdcheck("probe", f"127.0.0.1:{port}", "--vllm", other, "--tp-size", "1", "--timeout", "1")
        assert r.returncode == 3 and "no reply" in r.stderr
        thread.join(3)
        assert not thread.is_alive()
    finally:
        stop.set()
        thread.join(3)


@pytest.mark.parametrize("release", ["0.13.0", "0.20.0", "0.26.0", "0.34.0"])
def test_vllms_own_decode_handshake_against_serve(release):
    """vLLM's own D-side `_nixl_handshake` (request framing, reply framing, payload and metadata decoders,
    hash and engine-id checks) against `pdcheck serve`; its add_remote_agent stand-in loads P's agent blob into
    a real NIXL agent. The compatibility hash is serve's own (whether it equals a GPU deployment's is the
    release models' concern)."""

    from test_live import serve

    from pdcheck.nixlagent import Agent

    if not (Path(SRC or "") / release).is_dir():
        pytest.skip(f"{release} not unpacked under PDCHECK_VLLM_SRC")
    ns = with_vllm_handshake(release)
    handshake = ns["_nixl_handshake"]
    agent = Agent("vllm-decode")
    added: list[Any] = []

    def add_remote_agent(metadata: Any, *_args: Any) -> str:
        added.append(metadata)
        return agent.add_remote(metadata.agent_metadata)  # the real NIXL load of P's blob

    with serve("--prefill-tp", "2", "--prefill-blocks", "3008,2992", "--vllm", release) as s:
        for rank in (0, 1):
            me = SimpleNamespace(
                compat_hash=s.doc["compat_hash"], enforce_compat_hash=True, block_size=16, use_host_buffer=True,
                device_id=rank, _is_csa_linear=False, add_remote_agent=add_remote_agent,
                _validate_remote_parallel_config=lambda _m: None,
                kv_topo=SimpleNamespace(get_target_remote_rank=lambda _tp, r=rank: r),
                transfer_topo=SimpleNamespace(handshake_target_ranks=lambda *_a, r=rank: [r]))
            out = handshake(me, "127.0.0.1", s.doc["base_port"], 2, "prefill-engine")
            names = out[0] if isinstance(out, tuple) else out
            assert list(names.values()) == [f"prefill-engine-p{rank}"]
    assert [m.num_blocks for m in added] == [3008, 2992]
    assert [m.engine_id for m in added] == ["prefill-engine"] * 2


def _assert_in(release: str, function: str, text: str) -> Any:
    """The release's own `assert` statement inside `function` whose message holds `text`, compiled to run
    against stand-in locals."""
    tree = ast.parse(_segment(release, function))
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.Assert) and n.msg is not None
                and text in ast.unparse(n.msg))
    return compile(ast.Module([node], []), f"<vllm {release} {function} assert>", "exec")


@pytest.mark.parametrize("release", ["0.26.0", "0.34.0"])
def test_vllms_own_decode_fetches_stage_0_of_a_pp2_serve_and_refuses_it(release):
    """serve of a P with 2 pipeline stages (scenario pp2-prefill-only); vLLM's own `_nixl_handshake` asks the stages
    P's kv_transfer_params name (0.34: pp_size 2, stage 0 first; 0.26: no pp_size, stage 0 only) and gets stage
    (0, r)'s metadata: half of D's layers. Then the release's own refusal of it: 0.34's `_pair_regions` (the
    RuntimeError naming the layer stage 0 lacks), 0.26's layer-count assert (_validate_remote_agent_handshake)."""
    from test_live import serve

    from pdcheck.nixlagent import Agent

    if not (Path(SRC or "") / release).is_dir():
        pytest.skip(f"{release} not unpacked under PDCHECK_VLLM_SRC")
    ns = with_vllm_handshake(release)
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    if release >= "0.34":
        for name in ("_region_sort_key", "_pair_regions"):
            exec(compile(_segment(release, name), f"<vllm {release} {name}>", "exec"), ns)  # noqa: S102
        shared = next(line for path in _sources(release) for line in path.read_text().splitlines()
                      if line.startswith("_SHARED_REGION_GROUP_ID ="))  # the module constant, as written
        exec(shared, ns)  # noqa: S102
        ns.update(re=__import__("re"), defaultdict=__import__("collections").defaultdict)
    check = None if release >= "0.34" else _assert_in(release, "_validate_remote_agent_handshake",
                                                             "Number of KV layers")
    agent = Agent("vllm-decode-pp")
    with serve("pp2-prefill-only", "--vllm", release) as s:
        pp_size = s.doc["kv_transfer_params"].get("pp_size", 1)  # what D's request metadata reads from P's params
        assert pp_size == (2 if release >= "0.34" else 1)
        for rank in (0, 1):
            got: list[Any] = []
            me = SimpleNamespace(
                compat_hash=s.doc["compat_hash"], enforce_compat_hash=True, block_size=16, use_host_buffer=True,
                device_id=rank, _is_csa_linear=False, _validate_remote_parallel_config=lambda _m: None,
                kv_topo=SimpleNamespace(get_target_remote_rank=lambda _tp, r=rank: r),
                transfer_topo=SimpleNamespace(handshake_target_ranks=lambda *_a, r=rank: [r]),
                # D (PP 1) holds both layers, one region each
                pp_size=1, _regions_by_layer={n: [i] for i, n in enumerate(layers)}, _packed_member_layouts={},
                kv_cache_config=SimpleNamespace(transfer_group_index_by_layer=dict.fromkeys(layers, 0)),
                block_len_per_layer=[s.doc["prefill_ranks"][rank]["block_len"]] * 2, _has_mamba=False)

            def add_remote_agent(metadata: Any, *_args: Any, me: Any = me, got: list[Any] = got) -> str:
                got.append(metadata)
                if "_pair_regions" in ns:
                    ns["_pair_regions"](me, metadata)  # 0.34's add_remote_agent pairs regions by layer first
                else:
                    exec(check, {"self": me, "nixl_agent_meta": metadata})  # noqa: S102
                return agent.add_remote(metadata.agent_metadata)

            me.add_remote_agent = add_remote_agent
            if release >= "0.34":
                with pytest.raises(RuntimeError, match=r"Engine prefill does not hold the KV layers "
                                                       r"\['model\.layers\.1\.self_attn\.attn'\]\."):
                    ns["_nixl_handshake"](me, "127.0.0.1", s.doc["base_port"], 2, "prefill", remote_pp_size=pp_size)
                assert [m.region_names for m in got] == [[layers[0]]]  # stage (0, rank): layer 0 only
            else:
                with pytest.raises(AssertionError, match="Number of KV layers must match"):
                    ns["_nixl_handshake"](me, "127.0.0.1", s.doc["base_port"], 2, "prefill", remote_pp_size=pp_size)
                assert [len(m.block_lens) for m in got] == [1]  # stage (0, rank): one of D's two layers
        s.proc.send_signal(__import__("signal").SIGTERM)
        s.proc.wait(30)
        err = s.proc.stderr.read().decode()
    asked = [line.split("request ")[1].split(" -> ")[0] for line in err.splitlines() if " request " in line]
    # stage 0 of each TP rank, nothing more
    assert asked == ["['get_meta_msg', 0, 0] pp_rank 0 tp_rank 0", "['get_meta_msg', 0, 1] pp_rank 0 tp_rank 1"]
