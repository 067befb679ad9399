"""pdcheck's SGLang models against SGLang's own code, read from unpacked wheels (skipped unless they are there).

    for v in 0.4.6.post1 0.4.7 0.4.9.post2 0.5.3 0.5.8 0.5.13 0.5.23; do
        pip download sglang==$v --no-deps -d /tmp/w$v && mkdir -p /tmp/sglang-src/$v &&
        unzip -q /tmp/w$v/*.whl 'sglang/srt/disaggregation/*' -d /tmp/sglang-src/$v; done
    PDCHECK_SGLANG_SRC=/tmp/sglang-src python -m pytest -q tests/test_sglang_against_wheels.py

From each wheel this executes, as the release wrote them, TransferInfo.from_zmq and KVArgsRegisterInfo.from_zmq
(nixl/conn.py) with the helpers they call (common/utils.py, staging_handler.py), behind the bootstrap thread's
dispatch (guard, "None" room), on the frames pdcheck's D of every release sends: the parse must succeed or fail
exactly as pdcheck's wire.decode says (exception type and text). It also reads PrefillServerInfo's fields and
the error texts pdcheck quotes from the same sources.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import struct
import typing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdcheck.sglang import wire
from pdcheck.sglang.releases import MODELLED, resolve

SRC = Path(os.environ.get("PDCHECK_SGLANG_SRC", "/nonexistent"))
DIS = "sglang/srt/disaggregation"
RELEASES = sorted((p.name for p in SRC.glob("0.*") if (p / DIS / "nixl" / "conn.py").is_file()),
                  key=lambda v: resolve(v).tag)
pytestmark = pytest.mark.skipif(not RELEASES, reason="set PDCHECK_SGLANG_SRC to a directory of unpacked SGLang wheels")
NAMES = {"TransferInfo", "KVArgsRegisterInfo", "_unpack_kv_mem_kinds", "_normalize_kv_mem_kinds", "KV_MEM_KINDS",
         "GUARD", "unpack_int_lists", "unpack_list_of_buffers", "StagingRegisterInfo"}


def _segments(path: Path, names: set[str]) -> list[str]:
    if not path.is_file():
        return []
    text = path.read_text()
    out = []
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef | ast.FunctionDef) and node.name in names:
            decos = "".join(f"@{ast.get_source_segment(text, d)}\n" for d in node.decorator_list)
            out.append(decos + (ast.get_source_segment(text, node) or ""))
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and node.targets[0].id in names:
            out.append(ast.get_source_segment(text, node) or "")
    return out


def _load(release: str) -> dict[str, Any]:
    import sys
    import types

    root = SRC / release / DIS
    mod = types.ModuleType(f"pdcheck_sglang_wheel_{release.replace('.', '_')}")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up to resolve string annotations
    g: dict[str, Any] = mod.__dict__
    g.update({"dataclasses": dataclasses, "struct": struct, "np": np, "npt": np.typing,
              **{n: getattr(typing, n) for n in typing.__all__}})
    for path in (root / "common" / "utils.py", root / "common" / "staging_handler.py", root / "nixl" / "conn.py"):
        for seg in _segments(path, NAMES):
            exec(compile("from __future__ import annotations\n" + seg, f"<sglang {release} {path.name}>", "exec"), g)  # noqa: S102 - SGLang's own source from the wheel
    return g


def _their_parse(tag: str, g: dict[str, Any], frames: list[bytes]) -> Any:
    """The bootstrap thread's dispatch (R1 nixl/conn.py:324-334, R2 :320-345, R4 :620-650, R7 :3378-3396)."""
    if tag == "R1":
        room = frames[0].decode("ascii")
        if room == "None":
            return None
        int(room)
        return g["TransferInfo"].from_zmq(frames)
    if frames[0] != g["GUARD"]:  # the release's assert (spelled out: pytest would rewrite an assert's message)
        raise AssertionError(f"First message should be {g['GUARD']}. Foreign traffic?")
    msg = frames[1:]
    room = msg[0].decode("ascii")
    if tag == "R2":
        int(msg[10].decode("ascii"))
        int(room)
        msg[4].decode("ascii")
        return g["TransferInfo"].from_zmq(msg)
    msg[3].decode("ascii")
    if room == "None":
        return g["KVArgsRegisterInfo"].from_zmq(msg)
    int(room)
    return g["TransferInfo"].from_zmq(msg)


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        got = fn()
    except Exception as exc:  # the listener thread's death, as text
        return ("dies", wire.death(exc))
    if got is None:
        return ("ignored", "")
    pages = getattr(got, "dst_kv_indices", getattr(got, "pages", None))
    ptrs = getattr(got, "dst_kv_ptrs", getattr(got, "kv_ptrs", None))
    return ("ok", repr((list(pages) if pages is not None else None, ptrs)))


D0 = wire.DFacts("127.0.0.1", 5555, "agent-d0", b"nixlSerDes|Agent\x08\x00\x00\x00\x00\x00\x00\x00agent-d0\xb8",
                 [0x1000, 0x2000], [0x3000], 0, 2, 1, 4096)
REQ = wire.Request(7, [1, 2, 3], 0)
PAIRS = [(d, p) for p in RELEASES for d in MODELLED]


@pytest.mark.parametrize(("d_rel", "p_name"), PAIRS, ids=[f"D{d.name}-P{p}" for d, p in PAIRS])
def test_p_parses_every_era_as_the_wheel_does(d_rel, p_name) -> None:
    """Every message D of d_rel sends (registration, request; also a request whose aux index is None): the wheel's
    parse of P p_name and pdcheck's agree on success (pages, pointers) or on the exact exception."""
    g = _load(p_name)
    p_rel = resolve(p_name)
    msgs = wire.encode(d_rel, D0, REQ) + wire.encode(d_rel, D0, wire.Request(8, [4], None), register=False)
    for frames in msgs:
        theirs = _outcome(lambda f=frames: _their_parse(p_rel.tag, g, f))
        ours = _outcome(lambda f=frames: wire.decode(p_rel, f))
        if theirs[0] == "ok" and ours[0] == "ok":
            continue  # field names differ; pages and pointers are compared by the same-era test below
        assert ours == theirs


@pytest.mark.parametrize("p_name", RELEASES)
def test_same_era_fields(p_name) -> None:
    g = _load(p_name)
    rel = resolve(p_name)
    for frames in wire.encode(rel, D0, REQ):
        theirs = _their_parse(rel.tag, g, frames)
        ours = wire.decode(rel, frames)
        if hasattr(theirs, "dst_kv_indices"):
            assert list(theirs.dst_kv_indices) == ours.pages == [1, 2, 3]
        if hasattr(theirs, "dst_kv_ptrs"):
            reg = ours if isinstance(ours, wire.Registration) else ours.inline
            assert theirs.dst_kv_ptrs == reg.kv_ptrs and theirs.agent_metadata == reg.agent_metadata


def _fields(path: Path, cls: str) -> tuple[list[str], list[str]]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign)]
            required = [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and n.value is None]
            return names, required
    return [], []


def _or_skip(found: list[str], why: str) -> list[Any]:
    """The releases a test applies to, or one case that says why none of the unpacked ones does."""
    return found or [pytest.param(None, marks=pytest.mark.skip(reason=why))]


@pytest.mark.parametrize("p_name", _or_skip([r for r in RELEASES if resolve(r).bootstrap in ("B5", "B6")],
                                            "no unpacked release has PrefillServerInfo (bootstrap B5+)"))
def test_prefill_server_info_keys(p_name) -> None:
    names, required = _fields(SRC / p_name / DIS / "common" / "conn.py", "PrefillServerInfo")
    rel = resolve(p_name)
    assert sorted(names) == sorted(rel.info_keys) and required == list(rel.info_required)


def _templates(root: Path) -> set[str]:
    """Every string literal of the sources, f-strings as templates with {} for each replacement field (Python
    joins implicitly concatenated pieces into one node)."""
    out: set[str] = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr):
                out.add("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.add(node.value)
    return out


@pytest.mark.parametrize("p_name", RELEASES)
def test_quoted_texts_are_in_the_source(p_name) -> None:
    """The exact texts pdcheck's D reports are the release's own."""
    from pdcheck.sglang.releases.base import HETERO_TP_ASSERT, NOT_REGISTERED_503

    rel = resolve(p_name)
    texts = _templates(SRC / p_name / DIS)
    for check in rel.checks:
        assert check.text.format(p="{}", d="{}") in texts, check.id
    assert (HETERO_TP_ASSERT in texts) == (rel.hetero_tp == "assert_mla")
    pp = "Decode pp size ({}) should be equal to prefill pp size ({}) or 1"
    assert (pp in texts) == rel.pp_assert
    assert ("First message should be {}. Foreign traffic?" in texts) == rel.guard
    assert (NOT_REGISTERED_503.format(n="{}") in texts) == (rel.not_ready_status == 503)


@pytest.mark.parametrize("p_name", _or_skip([r for r in RELEASES if resolve(r).sends_state],
                                            "no unpacked release sends a hybrid model's state frames"))
def test_hybrid_state_frames(p_name) -> None:
    """A hybrid D's state pointers (registration #7) and state indices (request #7) as the wheel reads them."""
    g = _load(p_name)
    rel = resolve(p_name)
    d = wire.DFacts(D0.ip, D0.port, D0.agent_name, D0.agent_metadata, D0.kv_ptrs, D0.aux_ptrs, 0, 2, 1, 4096,
                    [0x9000], 256)
    reg, req = (_their_parse(rel.tag, g, f) for f in wire.encode(rel, d, wire.Request(7, [1, 2], 0,
                                                                                       state_indices=[3])))
    ours = [wire.decode(rel, f) for f in wire.encode(rel, d, wire.Request(7, [1, 2], 0, state_indices=[3]))]
    # raw arrays up to 0.5.11 (wire.RAW_STATE), one list per state pool from 0.5.12
    raw = rel.wire in wire.RAW_STATE
    assert list(reg.dst_state_data_ptrs) == (ours[0].state_ptrs if raw else [ours[0].state_ptrs])
    assert ours[0].state_ptrs == [0x9000]
    theirs = [int(i) for i in req.dst_state_indices] if raw else req.dst_state_indices
    assert theirs == (ours[1].state_indices if raw else [ours[1].state_indices])
    assert ours[1].state_indices == [3]


@pytest.mark.parametrize("p_name", RELEASES)
def test_failure_class_texts_are_in_the_source(p_name) -> None:
    """The texts of the duplicate-room, prefill-killed, DP-conflict and aux-skew verdicts are the release's own."""
    from pdcheck.sglang.releases.base import DP_CONFLICT, PREFILL_DOWN

    rel = resolve(p_name)
    texts = _templates(SRC / p_name / DIS)
    assert (DP_CONFLICT.format(x="{}", room="{}", y="{}") in texts) == rel.dp_conflict_check
    if rel.node_failure_log:
        assert rel.node_failure_log.format(addr="{}", n="{}") in texts
        assert ("Transfer for room {} failed due to node failure" in texts) == (not rel.records_reason)
    # recorded from PrefillServerInfo's era (0.5.10); only 0.5.13+ put a recorded reason into the exception
    assert (PREFILL_DOWN.format(addr="{}", room="{}") in texts) == (rel.bootstrap in ("B5", "B6"))
    aux = rel.aux_skew_log and rel.aux_skew_log.replace("{peer}", "%s").replace("{d}", "%d").replace(
        "{p}", "%d").replace("{n}", "%d")
    assert (aux in texts) if aux else not any("metadata buffers but this prefill has" in t for t in texts)


@pytest.mark.parametrize("p_name", RELEASES)
def test_page_count_assert_and_parallel_info_retries_are_the_release_s(p_name) -> None:
    """P's assert on fewer D pages (to 0.5.11) or its truncating warning (0.5.12+), and D's scheduler's bounded
    fetch of P's parallel info (0.5.10+): read in the release's nixl/conn.py and decode.py."""
    import re

    from pdcheck.sglang.releases.base import ENSURE_FAILED, PAGE_COUNT_ASSERT, PAGE_COUNT_WARNING

    rel = resolve(p_name)
    conn = (SRC / p_name / DIS / "nixl" / "conn.py").read_text()
    assert (PAGE_COUNT_ASSERT in conn) == rel.page_count_assert
    if not rel.page_count_assert:  # the f-string's fields, as pdcheck formats them
        assert PAGE_COUNT_WARNING.format(d="{len(chunked_dst_kv_indice)}",
                                         p="{len(kv_chunk.prefill_kv_indices)}") in conn
    decode = (SRC / p_name / DIS / "decode.py").read_text()
    retries = re.search(r"self\._max_ensure_retries: int = (\d+)", decode)
    interval = re.search(r"self\._ensure_retry_interval: float = ([0-9.]+)", decode)
    assert (int(retries.group(1)) if retries else None) == rel.ensure_retries
    if rel.ensure_retries is not None:
        assert interval is not None and float(interval.group(1)) == rel.ensure_retry_s
        assert ENSURE_FAILED.format(addr="{bootstrap_addr}", n="{count}") in decode
        assert '"Aborted by AbortReq."' in (SRC / p_name / DIS / "common" / "conn.py").read_text()
