"""`pdcheck doctor`: the pure rules (environment, sysfs parsing on a fake tree, the exit rule) and real
processes: one node's doctor with a real loopback transfer, a --listen/--peer pair on loopback, and hostile
peers (dead, lying about its address, trickling) that end in exit 3 with one line, bounded."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from loadkit import time_scale
from portkit import free_run, refusing

from pdcheck.doctor import envcheck, netdevs
from pdcheck.doctor.addr import Endpoint, advertised, parse_listen, parse_peer
from pdcheck.doctor.model import check, exit_code, summary
from pdcheck.doctor.netdevs import Devices, Gpu, Nic, RdmaPort
from pdcheck.errors import BadInput
from pdcheck.netio import PeerError
from pdcheck.vllm import doctor as vllm_doctor

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


# ------------------------------------------------------------------------------------------------ fake sysfs
def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_tree(root: Path) -> Path:
    ib = root / "sys/class/infiniband"
    for dev, numa, state, netdev in (("mlx5_0", "0", "4: ACTIVE", "ens1"), ("mlx5_1", "1", "1: DOWN", None),
                                     ("mlx5_2", "1", "4: ACTIVE", None)):
        _w(ib / dev / "device/numa_node", numa)
        p = ib / dev / "ports/1"
        _w(p / "state", state)
        _w(p / "phys_state", "5: LinkUp" if "ACTIVE" in state else "3: Disabled")
        _w(p / "link_layer", "Ethernet" if netdev else "InfiniBand")
        _w(p / "rate", "200 Gb/sec (4X HDR)")
        _w(p / "gids/0", "fe80:0000:0000:0000:0a00:27ff:fe00:0001")
        if netdev:
            (ib / dev / "device/net" / netdev).mkdir(parents=True)
    net = root / "sys/class/net"
    _w(net / "lo/operstate", "unknown")
    _w(net / "lo/address", "00:00:00:00:00:00")
    _w(net / "eno1/operstate", "up")
    _w(net / "eno1/address", "0a:00:27:00:00:01")
    _w(net / "eno1/speed", "1000")
    _w(net / "eno1/device/numa_node", "0")
    pci = root / "sys/bus/pci/devices"
    for addr, numa in (("0000:17:00.0", "0"), ("0000:ca:00.0", "1")):
        _w(pci / addr / "vendor", "0x10de")
        _w(pci / addr / "class", "0x030200")
        _w(pci / addr / "numa_node", numa)
    _w(pci / "0000:00:1f.0/vendor", "0x8086")  # not a GPU
    _w(pci / "0000:00:1f.0/class", "0x060100")
    return root


def test_sysfs_parsing(tmp_path: Path) -> None:
    devs = netdevs.scan(fake_tree(tmp_path))
    assert [(p.ucx_name, p.state, p.numa_node, p.netdev) for p in devs.rdma] == [
        ("mlx5_0:1", "ACTIVE", 0, "ens1"), ("mlx5_1:1", "DOWN", 1, None), ("mlx5_2:1", "ACTIVE", 1, None)]
    assert devs.rdma[0].link_layer == "Ethernet" and devs.rdma[1].phys_state == "Disabled"
    assert [(g.pci, g.numa_node) for g in devs.gpus] == [("0000:17:00.0", 0), ("0000:ca:00.0", 1)]
    eno = next(n for n in devs.nics if n.name == "eno1")
    assert (eno.operstate, eno.speed_mbps, eno.virtual, eno.numa_node) == ("up", 1000, False, 0)
    assert next(n for n in devs.nics if n.name == "lo").virtual
    sug = netdevs.suggest(devs)
    assert sug.value == "mlx5_0:1,mlx5_2:1"
    assert sug.per_gpu == {"0000:17:00.0": ["mlx5_0:1"], "0000:ca:00.0": ["mlx5_2:1"]}


def test_empty_tree(tmp_path: Path) -> None:
    devs = netdevs.scan(tmp_path)
    assert devs == Devices([], [], [])
    assert netdevs.suggest(devs).value is None


def _devs(tmp_path: Path) -> Devices:
    devs = netdevs.scan(fake_tree(tmp_path))
    for n in devs.nics:
        n.addresses = {"eno1": ["10.0.0.5"], "lo": ["127.0.0.1"]}.get(n.name, [])
    return devs


@pytest.mark.parametrize(("value", "status", "words"), [
    (None, "WARN", "export UCX_NET_DEVICES=mlx5_0:1,mlx5_2:1"),
    ("all", "WARN", "management NICs"),
    ("mlx5_0:1,eno1", "PASS", "every device exists"),
    ("mlx5_1:1", "FAIL", "DOWN"),
    ("mlx5_9:1", "FAIL", "does not exist"),
    ("mlx5_0:2", "FAIL", "no such port"),
    ("eth7", "FAIL", "does not exist"),
])
def test_ucx_net_devices(tmp_path: Path, value: str | None, status: str, words: str) -> None:
    env = {} if value is None else {"UCX_NET_DEVICES": value}
    c = envcheck.ucx_net_devices(env, _devs(tmp_path))
    assert c.status == status
    assert words in c.detail + (c.fix or "")


def test_ucx_net_devices_without_rdma() -> None:
    assert envcheck.ucx_net_devices({}, Devices([], [], [])).status == "PASS"


@pytest.mark.parametrize(("value", "status"), [
    (None, "PASS"), ("tcp", "WARN"), ("^rc,ud,dc", "WARN"), ("rc,cuda_copy,cuda_ipc,tcp", "PASS"), ("all", "PASS"),
    ("rc,tcp", "WARN"),  # GPUs but no CUDA transport
])
def test_ucx_tls(tmp_path: Path, value: str | None, status: str) -> None:
    env = {} if value is None else {"UCX_TLS": value}
    assert envcheck.ucx_tls(env, _devs(tmp_path)).status == status


@pytest.mark.parametrize(("value", "multi", "status"), [
    (None, False, "WARN"), (None, True, "FAIL"), ("0.0.0.0", False, "FAIL"), ("::", False, "FAIL"),
    ("localhost", False, "PASS"),  # a name: resolved by each decode
    ("127.0.0.1", False, "WARN"), ("127.0.0.1", True, "FAIL"), ("10.0.0.5", True, "PASS"),
    ("10.9.9.9", True, "FAIL"),
])
def test_side_channel_host(tmp_path: Path, value: str | None, multi: bool, status: str) -> None:
    env = {} if value is None else {"VLLM_NIXL_SIDE_CHANNEL_HOST": value}
    c = vllm_doctor.side_channel_host(env, _devs(tmp_path), vllm=True, multi_node=multi)
    assert c.status == status, c
    if status != "PASS":
        assert c.fix == "export VLLM_NIXL_SIDE_CHANNEL_HOST=10.0.0.5"


def test_side_channel_host_without_vllm(tmp_path: Path) -> None:
    assert vllm_doctor.side_channel_host({}, _devs(tmp_path), vllm=False, multi_node=False).status == "SKIP"


def test_side_channel_ports(tmp_path: Path) -> None:
    devs = _devs(tmp_path)  # two GPUs: 5600 and 5601
    assert vllm_doctor.side_channel_ports({}, devs, is_free=lambda h, p: True).detail == "5600-5601 free on 0.0.0.0"
    c = vllm_doctor.side_channel_ports({"VLLM_NIXL_SIDE_CHANNEL_PORT": "7000"}, devs, is_free=lambda h, p: p != 7001)
    assert c.status == "WARN" and c.detail.startswith("7001 of 7000-7001")
    assert vllm_doctor.side_channel_ports({"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"}, devs).status == "FAIL"
    # a real port held by this test is seen as taken
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        c = vllm_doctor.side_channel_ports({"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port),
                                         "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1"}, Devices([], [], []))
        assert c.status == "WARN", c


def test_alloc_conf_and_telemetry(tmp_path: Path) -> None:
    assert envcheck.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}).status == "WARN"
    assert envcheck.alloc_conf({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}).status == "PASS"
    assert envcheck.telemetry({}).status == "PASS"
    assert envcheck.telemetry({"NIXL_TELEMETRY_ENABLE": "n"}).status == "WARN"
    assert envcheck.telemetry({"NIXL_TELEMETRY_EXPORTER": "graphite"}).status == "WARN"
    assert envcheck.telemetry({"NIXL_TELEMETRY_DIR": str(tmp_path / "absent")}).status == "FAIL"
    assert envcheck.telemetry({"NIXL_TELEMETRY_DIR": str(tmp_path)}).status == "PASS"


def test_exit_rule() -> None:
    checks = [check("a", "PASS", "x"), check("b", "WARN", "y", "z"), check("c", "SKIP", "w")]
    assert exit_code(checks) == 0
    assert exit_code([*checks, check("d", "FAIL", "v")]) == 1
    assert summary([*checks, check("d", "FAIL", "v")]) == "4 checks: 1 FAIL, 1 WARN, 1 PASS, 1 SKIP (failed: d)"


def test_addresses() -> None:
    assert parse_listen("") == Endpoint("127.0.0.1", "127.0.0.1", 0)
    assert parse_listen("10.0.0.5") == Endpoint("10.0.0.5", "10.0.0.5", 0)
    assert parse_listen("[::1]:7777") == Endpoint("::1", "::1", 7777)
    assert parse_peer("10.0.0.5:7777") == Endpoint("10.0.0.5", "10.0.0.5", 7777)
    # a name is resolved once, and shown with the address it resolved to
    local = parse_peer("localhost:7777")
    assert local.host == "localhost" and local.ip in ("127.0.0.1", "::1") and local.label.startswith("localhost:7777 (")
    for bad in ("10.0.0.5", "10.0.0.5:0", "10.0.0.5:x", "10.0.0.5:\u00b3", "10.0.0.5:\u0663", "no such host!:7777",
                "pdcheck-no-such-host.invalid:7777"):
        with pytest.raises(BadInput):
            parse_peer(bad)
    with pytest.raises(BadInput):
        parse_listen("127.0.0.1:\u00b2")
    assert advertised("10.0.0.5:7777", "w") == Endpoint("10.0.0.5", "10.0.0.5", 7777)
    for lie in ("0.0.0.0:7777", "pdcheck-no-such-host.invalid:7777", "10.0.0.5:99999", "not an address", "\x1b[2J:1"):
        with pytest.raises(PeerError):
            advertised(lie, "w")


# ------------------------------------------------------------------------------------------------ real processes
def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdcheck", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


def test_doctor_json_names_the_transport() -> None:
    r = _cli("--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["command"] == "doctor" and doc["exit_code"] == 0
    t = doc["transfers"][0]
    assert t["memory"] == "host" and t["blocks_checked"] > 0 and t["blocks_wrong"] == 0
    # the payload's transport as UCX's protocol table names it (CMA on one host)
    assert any(d.startswith("cma/") for d in t["data"]), t
    names = {c["name"]: c for c in doc["checks"]}
    assert names["loopback transfer (host memory)"]["status"] == "PASS"
    assert names["NIXL plugins"]["status"] == "PASS"
    if not os.path.exists("/proc/driver/nvidia/version"):
        assert names["loopback transfer (gpu memory)"]["status"] == "SKIP"
    # how long doctor takes is the machine's figure, not a bound here (13.8 s beside a second copy of the suite)
    assert r.stderr == ""  # no progress when stderr is not a terminal


def test_doctor_table_agrees_with_json() -> None:
    r = _cli("--no-transfer")
    assert r.returncode == 0, r.stderr
    for name in ("NIXL wheel", "NIXL plugins", "env UCX_NET_DEVICES", "side-channel ports"):
        assert name in r.stdout
    assert "checks:" in r.stdout.splitlines()[-1]


def test_bad_input_is_exit_2() -> None:
    for args in (("--peer", "nohost"), ("--listen", "1.2.3.4:5", "--peer", "1.2.3.4:5"), ("--advertise", "1.2.3.4:5")):
        r = _cli(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("pdcheck: error:") and len(r.stderr.strip().splitlines()) == 1


def _listener(*extra: str) -> tuple[subprocess.Popen[str], int]:
    """60 s: the wait for the Hello holds the peer's whole start-up (an interpreter, a rank), over 18 s beside a
    second copy of the suite; every test whose peer fails tells the listener, so none waits it out."""
    p = subprocess.Popen([sys.executable, "-m", "pdcheck", "doctor", "--listen", "127.0.0.1:0", "--json",
                          "--timeout", "60", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=ENV, cwd=ROOT)
    assert p.stderr is not None
    line = p.stderr.readline()  # "pdcheck doctor: listening on 127.0.0.1:PORT (advertising ...)"
    assert "listening on 127.0.0.1:" in line, line
    return p, int(line.split("127.0.0.1:")[1].split()[0])


def test_pair_on_loopback() -> None:
    lis, port = _listener()
    try:
        r = _cli("--peer", f"127.0.0.1:{port}", "--json", "--timeout", "20")
        out, err = lis.communicate(timeout=60)
    finally:
        lis.kill()
    assert r.returncode == 0, r.stderr
    assert lis.returncode == 0, err
    peer, listen = json.loads(r.stdout), json.loads(out)
    for doc, role in ((peer, "peer"), (listen, "listen")):
        pr = doc["pair"]
        assert pr["role"] == role and pr["wrong"] == 0 and pr["checked"] > 0
        assert pr["side_channel"] == f"TCP 127.0.0.1:{port}"
    # both ends carry both ends' evidence: the decode end's READ table names the payload's transport
    assert any(d.startswith("cma/") for d in peer["pair"]["local"]["data"])
    assert listen["pair"]["remote"]["data"] == peer["pair"]["local"]["data"]
    assert peer["pair"]["remote"]["transports"]  # the listener's own protocol tables
    # each end names itself and the other by address and role, never by a bind-all address
    assert listen["pair"]["local"]["host"] == "127.0.0.1" and listen["pair"]["local"]["role"] == "prefill"
    assert peer["pair"]["remote"]["host"] == "127.0.0.1" and peer["pair"]["local"]["role"] == "decode"
    # one host: both ends WARN that no link was exercised, naming the payload's and the prefill end's lanes
    for doc in (peer, listen):
        c = next(c for c in doc["checks"] if c["name"] == "pair transfer")
        assert c["status"] == "WARN" and "no link exercised" in c["detail"], c
        assert "the prefill end's UCX lanes: " in c["detail"] and "cma/memory" in c["detail"], c


def test_pair_table_names_both_ends_lanes() -> None:
    """The table's pair lines: the prefill end's lanes (it READs nothing, so no 'payload over -'), the decode end's
    payload, and a bind-all listener named by the address it advertises."""
    p = subprocess.Popen([sys.executable, "-m", "pdcheck", "doctor", "--listen", "0.0.0.0:0", "--timeout", "60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**ENV, "COLUMNS": "300"},
                         cwd=ROOT)
    assert p.stderr is not None
    line = p.stderr.readline()
    port = int(line.split("listening on 0.0.0.0:")[1].split()[0])
    adv = line.split("(advertising ")[1].split(":")[0]
    try:
        r = _cli("--peer", f"127.0.0.1:{port}", "--timeout", "20", "--no-transfer")
        out, _err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert r.returncode == 0 and p.returncode == 0, r.stderr
    both = out + r.stdout
    assert "payload over -" not in both, both[max(0, both.find("payload over -") - 300):][:400]
    assert ", 0.0.0.0)" not in both, both
    assert f"this end (prefill, {adv}): UCX lanes " in out, out
    assert "other end (decode, 127.0.0.1): payload over cma/memory" in out, out
    assert f"other end (prefill, {adv}): UCX lanes " in r.stdout, r.stdout


def _one_line_exit_3(r: subprocess.CompletedProcess[str]) -> str:
    assert r.returncode == 3, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdcheck: error:"), r.stderr
    return lines[0]


def test_dead_peer() -> None:
    t0 = time.monotonic()
    line = _one_line_exit_3(_cli("--peer", f"127.0.0.1:{free_run()}", "--timeout", "2", "--no-transfer"))
    assert "no reply within 2000 ms" in line and "--peer 127.0.0.1:" in line
    # the 2 s deadline is the line's own claim; the bound here only says nothing waits on (start-up and the node's
    # checks take their time on a loaded machine: 16 s at load 20, beside the rest of the suite)
    assert time.monotonic() - t0 < 60


def test_lying_listener() -> None:
    """The listener advertises an address it does not listen on: the peer's connection there is refused, the
    peer says so at once, and tells the listener over the address that answered; both end with one line, exit 3,
    neither waiting out a deadline."""
    with refusing() as lie:
        lis, port = _listener("--advertise", f"127.0.0.1:{lie}")
        try:
            line = _one_line_exit_3(_cli("--peer", f"127.0.0.1:{port}", "--timeout", "20"))
            assert f"advertises 127.0.0.1:{lie}, where nothing answered (connection refused)" in line
            _, err = lis.communicate(timeout=30)
        finally:
            lis.kill()
    assert lis.returncode == 3
    last = err.strip().splitlines()[-1]
    assert last.startswith("pdcheck: error: --listen: the peer says this listener advertises "
                           f"127.0.0.1:{lie}, where nothing answered (connection refused)"), err


def test_advertisements_that_cannot_work_are_bad_input() -> None:
    """A bind-all address, a name that does not resolve, or no address at all: refused before anything starts
    (the peer's side of a bind-all advertisement: tests/test_hostile_doctor.py)."""
    for adv, says in (("0.0.0.0:7777", "a bind-all address"), ("not an address", "is not HOST:PORT"),
                      ("pdcheck-no-such-host.invalid:7777", "does not resolve here")):
        r = _cli("--listen", "127.0.0.1:0", "--advertise", adv, "--timeout", "60")
        assert r.returncode == 2, (adv, r.stderr)
        assert r.stderr.startswith("pdcheck: error: --advertise: ") and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and r.stdout == ""


def test_trickling_peer() -> None:
    """A 'listener' that accepts and sends one byte at a time never completes the exchange: bounded."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    port = srv.getsockname()[1]
    stop = threading.Event()

    def trickle() -> None:
        conn, _ = srv.accept()
        with conn:
            while not stop.is_set():
                try:
                    conn.send(b"\xff")
                except OSError:
                    return
                time.sleep(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        t0 = time.monotonic()
        _one_line_exit_3(_cli("--peer", f"127.0.0.1:{port}", "--timeout", "2", "--no-transfer"))
        # 3.6 s quiet (the rank's start-up, then --timeout 2); the bound proves an end, in the load's slow motion
        assert time.monotonic() - t0 < 15 * time_scale()
    finally:
        stop.set()
        srv.close()


def test_listener_without_peer_and_with_garbage() -> None:
    lis, port = _listener("--timeout", "1")
    _, err = lis.communicate(timeout=30)
    assert lis.returncode == 3 and "nothing arrived within 1 s" in err.strip().splitlines()[-1]
    # a peer that speaks ZMQ but not the protocol
    import zmq

    lis, port = _listener("--timeout", "5")
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    s.send(b"\x93garbage")
    _, err = lis.communicate(timeout=30)
    s.close(0)
    assert lis.returncode == 3 and "not a pdcheck-doctor/2 message" in err.strip().splitlines()[-1]


def test_fake_devices_feed_the_pure_rules() -> None:
    """The Struct types stay constructible by hand (a fake inventory for the rules)."""
    devs = Devices([RdmaPort("mlx5_0", 1, "ACTIVE", "LinkUp", "InfiniBand", "400", "fe80::1", 0, None)],
                   [Nic("eth0", "up", "", 0, False, None, ["10.0.0.5"])], [Gpu("0000:17:00.0", 0)])
    assert netdevs.suggest(devs).value == "mlx5_0:1"
