"""The plan (pdcheck.vllm.plan) and the port layout (pdcheck.vllm.ports): pure logic, no process started."""

from __future__ import annotations

import msgspec
import pytest

from pdcheck.errors import BadInput
from pdcheck.vllm import messages as vm
from pdcheck.vllm import plan as pl
from pdcheck.vllm import ports
from pdcheck.vllm.engine import Outcome
from pdcheck.vllm.releases import CORRECTED, resolve
from pdcheck.vllm.scenario import load
from pdcheck.vllm.wire import FORMATS


def _sc(**prefill: object):
    return load(None, {"prefill": {"num_blocks": 64, "tp_size": 2, **prefill}, "decode": {"num_blocks": 64}})


def test_default_port_per_era() -> None:
    # VLLM_NIXL_SIDE_CHANNEL_PORT: 5557 up to 0.11.0, 5600 from 0.11.1 (reference §3.1, vllm#25059)
    assert ports.default_port(resolve("0.9.0").wire) == 5557
    assert ports.default_port(resolve("0.11.0").wire) == 5557
    assert ports.default_port(resolve("0.11.1").wire) == 5600
    assert ports.default_port(resolve("0.34.0").wire) == 5600
    assert {ports.default_port(w) for w in FORMATS} == {5557, 5600}
    with pytest.raises(ValueError):
        ports.default_port("Z")


def test_rank_port_per_era() -> None:
    # A-E: base + dp*tp + rank; F-H: base + dp for every rank
    assert [ports.rank_port("B", 7000, 1, 4, r) for r in range(4)] == [7004, 7005, 7006, 7007]
    assert [ports.rank_port("G", 7000, 1, 4, r) for r in range(4)] == [7001] * 4
    assert ports.ports_per_dp("E", 4) == 4 and ports.ports_per_dp("H", 4) == 1


def test_port_plan_profiles_take_their_eras_default_base() -> None:
    sc = _sc()
    rels = [resolve("0.11.0"), resolve("0.11.1")]  # eras E and F
    plan = ports.plan_ports(sc, rels, None)
    assert plan.profiles["0.11.0"].base_port == 5557  # profile 0
    assert plan.profiles["0.11.1"].base_port == 5600 + ports.ERA_PORT_SPAN  # profile 1
    assert plan.profiles[CORRECTED.name] == plan.profiles["0.11.1"]  # corrected: P speaks the last release
    assert not plan.fixed
    assert [ls.port for ls in plan.listeners[0]] == [5557, 5700]
    assert [ls.port for ls in plan.listeners[1]] == [5558]  # the scheduler's listener is on rank 0 only
    assert all(ls.bind_port == 0 for specs in plan.listeners.values() for ls in specs)  # the OS picks


def test_port_plan_explicit_base_binds_the_layout() -> None:
    plan = ports.plan_ports(_sc(base_port=7000, dp_rank=1), [resolve("0.9.1")], None)
    assert [(ls.port, ls.bind_port) for r in (0, 1) for ls in plan.listeners[r]] == [(7002, 7002), (7003, 7003)]
    assert plan.fixed and 7002 in plan.contacted
    with pytest.raises(BadInput, match="past 65535"):
        ports.plan_ports(_sc(base_port=65535), [resolve("0.9.1")], None)


def test_build_resolves_releases_and_geometry_once() -> None:
    sc = _sc(vllm="0.26.0")  # a cross-release pair: P speaks 0.26 (era H), D models 0.9.1
    plan = pl.build(sc, "0.9.1", pl.RunOptions())
    assert plan.names == ["0.9.1"] and plan.p_release is resolve("0.26.0")
    assert plan.p_geometry.kv_regions == "packed" and plan.d_geometry.kv_regions == "split"
    assert plan.ports is not None and [r.name for r in plan.d_releases] == ["0.9.1", "corrected"]
    d91, corr = plan.d_releases
    # D of 0.9.1 addresses P by its own era's layout, at the profile of what P serves (era H)
    assert (d91.p_wire, corr.p_wire) == ("H", "H")
    assert d91.p_base_port == plan.ports.profiles["0.9.1"].base_port
    assert len(plan.requests) == sc.transfer.requests


def test_build_live_needs_the_live_release() -> None:
    live = pl.LiveP("127.0.0.1", 5600, tp_given=True)
    with pytest.raises(BadInput, match="name the release the live P runs"):
        pl.build(_sc(), "0.9.1,0.11.1", pl.RunOptions(), live=live)
    plan = pl.build(_sc(), "0.11.1", pl.RunOptions(), live=live)
    assert plan.ports is None and plan.p_release is resolve("0.11.1") and plan.live == live


def test_serve_plan_with_a_port() -> None:
    sp = pl.build_serve(_sc(dp_rank=1), resolve("0.9.1"), pl.ServeOptions(port=7100))
    assert sp.base_port == 7100 and sp.remote_port == 7102  # era B: base + dp * tp
    assert sp.scenario.prefill.vllm == "0.9.1" and sp.ports.fixed
    with pytest.raises(BadInput, match="--port: 65535"):
        pl.build_serve(_sc(), resolve("0.9.1"), pl.ServeOptions(port=65535))


def test_geometry_travels_typed_in_the_spec() -> None:
    g = _sc().prefill.geometry()
    spec = vm.PrefillSpec(engine_id="P", tp_rank=0, tp_size=2, num_blocks=64, device_id=0, device="cpu",
                         host="127.0.0.1", geometry=g, kv_cache_layout="HND", inject=vm.Inject())
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=vm.PrefillSpec)
    assert back.geometry == g and back.geometry.block_len == g.block_len


def test_outcome_is_the_verdict_the_report_shows() -> None:
    out = Outcome(status="assert", assert_expr="x", contacted=[0, 1], rank_num_blocks={0: 5}, local_num_blocks=9)
    v = out.verdict()
    assert type(v) is vm.Verdict
    assert msgspec.structs.asdict(v) == {f: getattr(out, f) for f in vm.Verdict.__struct_fields__}
    # The report's --json keys for a verdict, in order
    assert list(msgspec.json.decode(msgspec.json.encode(v))) == [
        "status", "assert_expr", "message", "recorded_num_blocks", "contacted", "contacted_stages", "exception",
        "check", "hazard", "handshake", "remote_rank", "stride", "rank_num_blocks"]
