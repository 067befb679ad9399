"""Two-node helpers for the tests: Ray nodes started with Ray's own launcher (`ray start --block`), and two
network namespaces joined by a veth pair (a real network link on one host). Used by test_ray.py and the doctor's
pair tests; a module that uses the Ray nodes imports `_ray_tmpdir` too (its autouse fixture)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import ROOT
from portkit import free_run

RAY = str(Path(sys.executable).parent / "ray")

_RAY_TMP: dict[str, str] = {}


@pytest.fixture(scope="module", autouse=True)
def _ray_tmpdir() -> Iterator[None]:
    """Ray keeps its sessions and the last cluster's address (ray_current_cluster) under RAY_TMPDIR/ray, by
    default /tmp/ray, where they outlive the test and a later `--ray auto` would find a cluster long gone.
    Every node and CLI run of this module uses one directory of its own, removed at the end (short: Ray's
    Unix sockets live under it). TMPDIR is a directory of the module's own too: what a rank actor leaves there
    (its log file) is this run's, not a second copy of the suite's."""
    import tempfile

    _RAY_TMP["dir"] = tempfile.mkdtemp(prefix="pdck-ray-", dir="/tmp")
    os.mkdir(os.path.join(_RAY_TMP["dir"], "tmp"))
    try:
        yield
    finally:
        shutil.rmtree(_RAY_TMP.pop("dir"), ignore_errors=True)


def _env(**extra: str) -> dict[str, str]:
    # RAY_raylet_start_wait_time_s: how long `ray start` and ray.init wait for the GCS to list their node
    # (Ray's default, 30 s). Beside a second copy of the suite a worker node took longer and gave up with "GCS
    # cannot find the node ... Try increase the RAY_raylet_start_wait_time_s config." (docs/performance.md).
    return dict(os.environ, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0", RAY_TMPDIR=_RAY_TMP["dir"],
                RAY_raylet_start_wait_time_s=str(RAY_START_WAIT_S), TMPDIR=actor_tmp(), **extra)


def actor_tmp() -> str:
    """The TMPDIR of this module's Ray nodes and CLI runs."""
    return os.path.join(_RAY_TMP["dir"], "tmp")


# Ray's own wait for its node to register (RAY_raylet_start_wait_time_s, set above); a node that has not started
# after it and a margin has failed. Our wait was 90 s, under Ray's own 120 s: beside a second copy of the suite
# (load 12-15) a head still starting at 90 s was called dead.
RAY_START_WAIT_S = 120


@contextmanager
def _ray_node(args: list[str], netns: str | None = None, env: dict[str, str] | None = None,
              timeout: float = RAY_START_WAIT_S + 30) -> Iterator[subprocess.Popen[str]]:
    """One Ray node (`ray start --block`), in a network namespace when given; stopped on exit."""
    cmd = [*(["ip", "netns", "exec", netns] if netns else []), RAY, "start", "--block", "--disable-usage-stats",
           "--num-cpus=1", *(["--include-dashboard=false"] if "--head" in args else []), *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env or _env(),
                            cwd=ROOT, start_new_session=True)
    seen: list[str] = []
    up = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if "Ray runtime started" in line:
                up.set()
        up.set()  # it ended: say so at once

    threading.Thread(target=read, daemon=True).start()
    try:
        if not up.wait(timeout) or proc.poll() is not None:
            raise AssertionError(f"ray node did not start: {' '.join(cmd)}\n{''.join(seen)[-3000:]}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # ray start --block stops the processes it started
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)



@contextmanager
def _two_nodes(head_ip: str, worker_ip: str, ns: tuple[str, str] | None = None,
               envs: tuple[dict[str, str], dict[str, str]] | None = None) -> Iterator[str]:
    port = free_run() if ns is None else 6379  # a namespace of our own has every port free
    addr = f"{head_ip}:{port}"
    e_head, e_worker = envs or (_env(), _env())
    with _ray_node(["--head", f"--port={port}", f"--node-ip-address={head_ip}",
                    '--resources={"pdcheck_prefill": 8}'], ns[0] if ns else None, e_head), \
         _ray_node([f"--address={addr}", f"--node-ip-address={worker_ip}",
                    '--resources={"pdcheck_decode": 8}'], ns[1] if ns else None, e_worker):
        yield addr




# ---------------------------------------------------------------------------------- a real network link
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@contextmanager
def _veth_pair() -> Iterator[tuple[str, str, str, str]]:
    """Two fresh network namespaces joined by a veth pair: (ns A, ns B, A's address, B's address)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command here")
    tag = uuid.uuid4().hex[:6]
    ns_a, ns_b, dev_a, dev_b = f"pdck-a-{tag}", f"pdck-b-{tag}", f"pdva{tag}", f"pdvb{tag}"
    a_ip, b_ip = "10.231.0.1", "10.231.0.2"
    try:
        _ip("netns", "add", ns_a)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"network namespaces cannot be created here (needs root / CAP_SYS_ADMIN): {exc}")
    try:
        _ip("netns", "add", ns_b)
        _ip("link", "add", dev_a, "type", "veth", "peer", "name", dev_b)
        for ns, dev, ip in ((ns_a, dev_a, a_ip), (ns_b, dev_b, b_ip)):
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield ns_a, ns_b, a_ip, b_ip
    finally:
        for ns in (ns_a, ns_b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)  # takes the veth with it




def _dev(ns: str) -> str:
    out = subprocess.run(["ip", "-n", ns, "-o", "link", "show", "type", "veth"], capture_output=True, text=True,
                         check=True, timeout=20).stdout
    return out.split(":")[1].strip().split("@")[0]




@contextmanager
def _bridged(n: int, names: dict[str, list[int]] | None = None) -> Iterator[list[tuple[str, str, str]]]:
    """n fresh network namespaces on one bridge, a switch in a namespace of its own (every pair of them a real
    link): [(namespace, its address, its device)]. names: host names each namespace resolves (its
    /etc/netns/NS/hosts, which `ip netns exec` mounts over /etc/hosts), name -> the indexes it names (several:
    every address, as a headless Service's name gives every pod's)."""
    if shutil.which("ip") is None:
        pytest.skip("network namespaces: no `ip` command here")
    tag = uuid.uuid4().hex[:6]
    hub = f"pdck-hub-{tag}"
    spokes = [(f"pdck-{i}-{tag}", f"10.232.0.{i + 1}", f"pdn{i}{tag}") for i in range(n)]
    made: list[str] = []
    try:
        try:
            _ip("netns", "add", hub)
        except (subprocess.CalledProcessError, OSError) as exc:
            pytest.skip(f"network namespaces cannot be created here (needs root / CAP_SYS_ADMIN): {exc}")
        made.append(hub)
        _ip("-n", hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", hub, "link", "set", "br0", "up")
        for i, (ns, ip, dev) in enumerate(spokes):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", dev, "type", "veth", "peer", "name", f"pdh{i}{tag}")
            _ip("link", "set", dev, "netns", ns)
            _ip("link", "set", f"pdh{i}{tag}", "netns", hub)
            _ip("-n", hub, "link", "set", f"pdh{i}{tag}", "master", "br0")
            _ip("-n", hub, "link", "set", f"pdh{i}{tag}", "up")
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if names:
                etc = Path("/etc/netns") / ns
                etc.mkdir(parents=True, exist_ok=True)
                lines = ["127.0.0.1 localhost"] + [f"{spokes[k][1]} {name}" for name, ks in names.items() for k in ks]
                (etc / "hosts").write_text("\n".join(lines) + "\n")
        yield spokes
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)  # takes its veths along
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
