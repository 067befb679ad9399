"""`pdcheck doctor --listen` / `--peer` over a real link: two network namespaces joined by a veth pair
(netkit._veth_pair, the same link test_ray.py uses), a real transfer between two pdcheck processes, and each
end's transport evidence as UCX's own protocol tables name it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from conftest import ROOT
from netkit import _dev, _veth_pair

pytestmark = pytest.mark.slow


@dataclass
class End:
    code: int
    out: str
    err: str

    def doc(self) -> dict:
        return json.loads(self.out)

    def check(self, name: str) -> dict:
        return next(c for c in self.doc()["checks"] if c["name"] == name)


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return dict(env, PYTHONPATH=str(ROOT), **extra)


def _pair(ns: tuple[str, str], a_ip: str, *, env_a: dict[str, str], env_b: dict[str, str],
          listen: tuple[str, ...] = (), peer: tuple[str, ...] = (), timeout: int = 40,
          listen_timeout: int | None = None) -> tuple[End, End, int]:
    """The listener in namespace A on A's veth address (a port the OS picks), the peer in B dialling it. The
    listener's wait for the Hello includes the peer's own start-up (an interpreter, a rank: seconds on a busy
    machine), so a short peer timeout gets a listener timeout of its own."""
    cmd = ["ip", "netns", "exec", ns[0], sys.executable, "-m", "pdcheck", "doctor", "--listen", f"{a_ip}:0",
           "--json", "--timeout", str(listen_timeout or timeout), *listen]
    lis = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(env_a), cwd=ROOT)
    try:
        assert lis.stderr is not None
        line = lis.stderr.readline()  # "pdcheck doctor: listening on 10.231.0.1:PORT (advertising ...)"
        assert f"listening on {a_ip}:" in line, line + lis.stderr.read()
        port = int(line.split(f"{a_ip}:")[1].split()[0])
        p = subprocess.run(["ip", "netns", "exec", ns[1], sys.executable, "-m", "pdcheck", "doctor", "--peer",
                            f"{a_ip}:{port}", "--json", "--timeout", str(timeout), *peer],
                           capture_output=True, text=True, env=_env(env_b), cwd=ROOT, timeout=_ceiling(timeout))
        out, err = lis.communicate(timeout=_ceiling(listen_timeout or timeout))
    finally:
        if lis.poll() is None:
            lis.kill()
            lis.communicate(timeout=30)
    return End(lis.returncode, out, line + err), End(p.returncode, p.stdout, p.stderr), port


def _ceiling(timeout: int) -> int:
    """How long a doctor process may take in all: its start-up (an interpreter, a rank's agent and registration)
    is not bounded by --timeout, and took over 18 s beside a second copy of the suite (load 25 on 2 cores)."""
    return max(timeout * 4, 120)


@pytest.fixture(scope="module")
def link():
    with _veth_pair() as (ns_a, ns_b, a_ip, b_ip):
        yield (ns_a, ns_b), a_ip, b_ip, _dev(ns_a), _dev(ns_b)


def test_payload_over_tcp_across_the_veth_link(link) -> None:
    """UCX_TLS=tcp on both nodes: the payload crosses the veth link, and both ends say so."""
    ns, a_ip, b_ip, dev_a, dev_b = link
    lis, peer, port = _pair(ns, a_ip, env_a={"UCX_TLS": "tcp"}, env_b={"UCX_TLS": "tcp"},
                            peer=("--expect", "tcp"))
    assert peer.code == 0, peer.err
    assert lis.code == 0, lis.err
    pd, ld = peer.doc()["pair"], lis.doc()["pair"]
    for d, role in ((pd, "peer"), (ld, "listen")):
        assert d["role"] == role and d["checked"] > 0 and d["wrong"] == 0
        assert d["side_channel"] == f"TCP {a_ip}:{port}" and d["advertised"] == f"{a_ip}:{port}"
    # the decode end (the peer, in B) READ over TCP on its veth device, as its UCX protocol table says
    assert pd["local"]["host"] == b_ip and pd["remote"]["host"] == a_ip
    assert pd["local"]["data"] and all(x.startswith(f"tcp/{dev_b}") for x in pd["local"]["data"]), pd["local"]
    assert ld["remote"]["data"] == pd["local"]["data"] and ld["remote"]["host"] == b_ip
    # the listener's own lanes: TCP on A's veth device, never loopback
    assert f"tcp/{dev_a}" in ld["local"]["transports"] and not any("/lo" in t for t in ld["local"]["transports"])
    for end in (peer, lis):
        c = end.check("pair transfer")
        assert c["status"] == "PASS" and f"payload over tcp/{dev_b}" in c["detail"], c
        assert end.check("pair side channel")["detail"] == f"TCP {a_ip}:{port}, advertised {a_ip}:{port}"


def test_payload_not_over_the_transport_asked_for(link) -> None:
    """UCX_NET_DEVICES names the veth on both nodes and the peer expects tcp, but both namespaces share one
    host's memory: UCX moves the payload by CMA. Both ends FAIL (the peer's --expect travels in its Hello: both
    ends judge against it) and say that no link was exercised, naming what carried the payload and each end's
    UCX lanes; the listener adds that its UCX_NET_DEVICES asked for the network."""
    ns, a_ip, _, dev_a, dev_b = link
    lis, peer, _ = _pair(ns, a_ip, env_a={"UCX_NET_DEVICES": dev_a}, env_b={"UCX_NET_DEVICES": dev_b},
                         peer=("--expect", "tcp"))
    assert peer.code == 1, peer.err
    assert lis.code == 1, lis.err
    data = peer.doc()["pair"]["local"]["data"]
    assert data and all(x.startswith("cma/") for x in data), data
    assert lis.doc()["pair"]["expect"] == peer.doc()["pair"]["expect"] == ["tcp"]
    for end, dev in ((peer, dev_b), (lis, dev_a)):
        c = end.check("pair transfer")
        assert c["status"] == "FAIL", c
        assert "the payload went over cma/memory" in c["detail"] and "--expect asks for tcp" in c["detail"], c
        assert "no link exercised" in c["detail"] and "the prefill end's UCX lanes: " in c["detail"], c
        assert f"UCX_NET_DEVICES={dev}" in c["fix"]
        assert "failed: pair transfer" in end.doc()["summary"]
    assert f"UCX_NET_DEVICES={dev_a} asks for the network" in lis.check("pair transfer")["detail"]


def test_loopback_devices_cannot_reach_the_other_node(link) -> None:
    """UCX_NET_DEVICES=lo on both nodes: NIXL cannot reach the other agent (its bare NIXL_ERR_BACKEND). Both ends
    FAIL the transfer, exit 1, and the fix names the variable."""
    ns, a_ip, _, _, _ = link
    lis, peer, _ = _pair(ns, a_ip, env_a={"UCX_NET_DEVICES": "lo"}, env_b={"UCX_NET_DEVICES": "lo"})
    assert peer.code == 1, peer.err
    assert lis.code == 1, lis.err
    for end in (peer, lis):
        c = end.check("pair transfer")
        assert c["status"] == "FAIL" and "no KV moved" in c["detail"] and "NIXL_ERR" in c["detail"], c
        assert "UCX_NET_DEVICES=lo names only loopback" in c["fix"], c
    assert "the peer's READ failed" in lis.check("pair transfer")["detail"]


def test_listener_advertising_an_address_it_does_not_listen_on(link) -> None:
    """The listener tells the peer to use A's address on a port nobody listens on: exit 3, one line, bounded."""
    ns, a_ip, _, _, _ = link
    lis, peer, _ = _pair(ns, a_ip, env_a={}, env_b={}, listen=("--advertise", f"{a_ip}:9"), timeout=6,
                         listen_timeout=60)
    assert peer.code == 3, peer.err
    lines = peer.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdcheck: error:"), peer.err
    assert f"advertises {a_ip}:9, where nothing answered" in lines[0], (lis.code, lis.err)
    assert peer.out == ""
    assert lis.code == 3 and lis.err.strip().splitlines()[-1].startswith("pdcheck: error: --listen"), lis.err
