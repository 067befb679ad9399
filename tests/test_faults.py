"""Fault injection against the real CLI: kill each kind of process at each phase, signal the parent, run in
parallel, squat the ports a release contacts. Each case asserts the documented exit code, one error line,
no traceback, a bounded time, and nothing left behind (processes, pymp-* temp dirs).

Ranks name themselves in /proc/PID/comm (pdcheck-D1, pdcheck-D1:hs, pdcheck-D1:xfer), which is how the
tests find a rank and the phase it is in.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS
from portkit import free_run, machine_wide

SEED = str(SCENARIOS / "seed-19338-tp8.toml")
SMALL = ["--prefill-tp", "2", "--decode-tp", "2", "--prefill-blocks", "64", "--decode-blocks", "64"]
# ~130 MiB of tagged blocks per rank: the transfer proof lasts a few seconds, long enough to kill in it.
LONG_TRANSFER = """vllm = ["0.9.2"]
[prefill]
tp_size = 2
num_blocks = 4096
layers = 4
[decode]
tp_size = 2
num_blocks = 4096
layers = 4
[transfer]
requests = 2
blocks_per_request = 512
"""


def _as_a_terminal_starts_it(new_group: bool = False) -> Callable[[], None]:
    """preexec_fn: the signal dispositions a command started from an interactive shell has, whatever this test
    run inherited (under `nohup` SIGHUP is ignored, in a background job SIGINT; an ignored signal stays ignored
    in pdcheck, so the test would not test what it claims). new_group: its own process group, as a shell job
    gets one, so that the test can signal the whole group as a terminal's Ctrl-C does."""
    def preexec() -> None:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if new_group:
            os.setpgid(0, 0)

    return preexec


def start(tmp_path: Path, *args: str, new_group: bool = False) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    return subprocess.Popen([sys.executable, "-m", "pdcheck", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                            preexec_fn=_as_a_terminal_starts_it(new_group))


def _ppid_comm(pid: int) -> tuple[int, str, str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    rest = stat.rsplit(")", 1)[1].split()
    if rest[0] == "Z":
        return None
    return int(rest[1]), comm, cmd


def descendants(root: int) -> dict[int, tuple[str, str]]:
    """Live (non-zombie) descendants of root: pid -> (comm, cmdline)."""
    info = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            got = _ppid_comm(int(d.name))
            if got is not None:
                info[int(d.name)] = got
    out: dict[int, tuple[str, str]] = {}
    frontier = {root}
    while frontier:
        nxt = {pid for pid, (ppid, _c, _m) in info.items() if ppid in frontier and pid not in out}
        for pid in nxt:
            out[pid] = info[pid][1:]
        frontier = nxt
    return out


class Watch:
    """Every descendant ever seen, so that the test can check they are all gone after the parent exits
    (orphans are re-parented and no longer descendants)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        self.seen: dict[int, tuple[str, str]] = {}

    def poll(self) -> dict[int, tuple[str, str]]:
        now = descendants(self.proc.pid)
        self.seen.update(now)
        return now

    def wait_for(self, match: Callable[[str, str], bool], timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for pid, (comm, cmd) in self.poll().items():
                if match(comm, cmd):
                    return pid
            if self.proc.poll() is not None:
                break
            time.sleep(0.01)
        out, err = self.proc.communicate(timeout=30)
        raise AssertionError(f"never saw the process (exit {self.proc.returncode}): {err[-2000:]}")

    def alive(self) -> list[str]:
        return [f"{pid} {comm}" for pid, (comm, _c) in self.seen.items() if _ppid_comm(pid) is not None]


def finish(w: Watch, timeout: float = 60) -> tuple[int, str, str]:
    try:
        out, err = w.proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        w.proc.kill()
        out, err = w.proc.communicate()
        raise AssertionError(f"pdcheck did not end within {timeout} s: {err[-2000:]}") from None
    deadline = time.monotonic() + 5
    while w.alive() and time.monotonic() < deadline:  # SIGKILLed orphans may need a moment to be reaped
        time.sleep(0.05)
    return w.proc.returncode, out, err


def assert_clean(w: Watch, tmp_path: Path, err: str) -> None:
    assert "Traceback" not in err, err
    assert not w.alive(), f"left running: {w.alive()}"
    assert not list(tmp_path.glob("pymp-*")), "multiprocessing temp dir left behind"


def error_lines(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("pdcheck: error:")]


# ---- a process killed at each phase -------------------------------------------------------------------
KILLS = [
    # (victim comm, phase word in the report, extra args)
    ("pdcheck-D1", "start-up", []),
    ("pdcheck-P0", "start-up", []),
    ("pdcheck-D1:hs", "handshake", ["--inject", "mute:P1", "--hang-timeout", "60"]),
    ("pdcheck-P1:hs", "handshake", ["--inject", "mute:P1", "--hang-timeout", "60"]),
    ("pdcheck-D0:xfer", "transfer", ["LONG"]),
    ("pdcheck-P1:xfer", "transfer", ["LONG"]),
]


@pytest.mark.parametrize(("victim", "phase", "extra"), KILLS, ids=[f"{v}-{p}" for v, p, _ in KILLS])
def test_killed_rank_is_reported_within_2s(tmp_path: Path, victim: str, phase: str, extra: list[str]) -> None:
    if extra == ["LONG"]:
        sc = tmp_path / "long.toml"
        sc.write_text(LONG_TRANSFER)
        args = [str(sc), "--json"]
    else:
        args = [*SMALL, "--vllm", "0.9.2", "--json", *extra]
    w = Watch(start(tmp_path, "handshake", *args))
    pid = w.wait_for(lambda comm, _cmd: comm == victim)
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    line = w.proc.stderr.readline()  # type: ignore[union-attr]  # the parent says so at once
    detect_s = time.monotonic() - t_kill
    code, out, err = finish(w, timeout=30)
    total_s = time.monotonic() - t_kill
    err = line + err
    rank = victim.split(":")[0].removeprefix("pdcheck-")
    label = f"{'P' if rank[0] == 'P' else 'D'} rank {rank[1:]}"
    if phase == "start-up":
        # Start-up failures are a harness error before any report: one error line, exit 3.
        assert code == 3, err
        assert error_lines(err) and label in error_lines(err)[0] and "start-up" in error_lines(err)[0], err
    else:
        assert code == 3, err
        doc = json.loads(out)
        assert any(label in e and phase in e and "SIGKILL" in e for e in doc["harness_errors"]), doc["harness_errors"]
        # stdout is the document; stderr repeats why it is exit 3 for a CI log that keeps only stderr
        assert [ln.removeprefix("pdcheck: harness error: ") for ln in err.splitlines()
                if ln.startswith("pdcheck: harness error: ")] == doc["harness_errors"][:5], err
    assert label in line and "SIGKILL" in line, err
    assert detect_s < 2.0, f"dead rank reported after {detect_s:.2f} s"
    assert total_s < 5.0, f"run ended {total_s:.2f} s after the kill"
    assert_clean(w, tmp_path, err)


@pytest.mark.parametrize("when", ["start-up", "handshake"])
def test_forkserver_killed_is_exit_3(tmp_path: Path, when: str) -> None:
    extra = ["--inject", "mute:P1", "--hang-timeout", "60"] if when == "handshake" else []
    w = Watch(start(tmp_path, "handshake", *SMALL, "--vllm", "0.9.2", *extra))
    pid = w.wait_for(lambda _comm, cmd: "forkserver" in cmd)
    if when == "handshake":
        w.wait_for(lambda comm, _cmd: comm == "pdcheck-D1:hs")
    os.kill(pid, signal.SIGKILL)
    t_kill = time.monotonic()
    code, out, err = finish(w, timeout=45)
    assert code == 3, err
    # Seen at the forkserver's death, not at the 60 s start-up timeout (or --hang-timeout 60): well before half of
    # it. A tighter bound measures the machine: at start-up the parent may still be importing the CLI, 5.5 s at
    # load 24, and a second copy beside the suite made it 15.8 s.
    assert time.monotonic() - t_kill < 30.0
    assert "forkserver" in err and len(error_lines(err)) <= 1, err
    assert_clean(w, tmp_path, err)


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)])
def test_signal_stops_and_reaps_everything(tmp_path: Path, sig: int, code: int) -> None:
    w = Watch(start(tmp_path, "handshake", *SMALL, "--vllm", "0.9.2", "--inject", "mute:P1",
                    "--hang-timeout", "60"))
    w.wait_for(lambda comm, _cmd: comm == "pdcheck-D1:hs")
    w.poll()
    w.proc.send_signal(sig)
    t_sig = time.monotonic()
    got, _out, err = finish(w, timeout=30)
    assert got == code, err
    assert time.monotonic() - t_sig < 5.0
    assert len(w.seen) >= 5  # forkserver + 4 ranks (+ resource tracker) were seen, and are gone now
    assert_clean(w, tmp_path, err)


def _group(pgid: int) -> list[str]:
    """Live processes of a process group: 'pid comm'."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                rest = (d / "stat").read_text().rsplit(")", 1)[1].split()
                comm = (d / "comm").read_text().strip()
            except OSError:
                continue
            if rest[0] != "Z" and int(rest[3]) == pgid:
                out.append(f"{d.name} {comm}")
    return out


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.4, 0.7, 1.0])
def test_ctrl_c_to_the_whole_group_during_start_up_is_quiet(tmp_path: Path, delay: float) -> None:
    """A terminal's Ctrl-C reaches every process of the job: the parent, the forkserver (maybe still importing
    NIXL), the resource tracker and the ranks (maybe sending Ready). Only the parent acts on it: exit 130, no
    traceback or error from any of them, nothing left in the group. The delay counts from the forkserver's
    start (before it, the interpreter is still starting: Python's own traceback, nothing pdcheck can stop)."""
    # P rank 1 never answers (and the hang timeout is long): the run is still going at every delay.
    proc = start(tmp_path, "handshake", SEED, "--vllm", "0.9.1", "--inject", "mute:P1", "--hang-timeout", "60",
                 new_group=True)
    w = Watch(proc)
    w.wait_for(lambda _comm, cmd: "forkserver" in cmd, timeout=30)
    t_end = time.monotonic() + delay
    while time.monotonic() < t_end:
        w.poll()
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)
    code, out, err = finish(w, timeout=30)
    assert code == 130, (code, err[-2000:])
    for text in (out, err):
        assert "Traceback" not in text and "Error" not in text and "nixl_agent" not in text, text[-2000:]
    deadline = time.monotonic() + 5
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group(proc.pid), f"left running in the group: {_group(proc.pid)}"
    assert_clean(w, tmp_path, err)
    assert not list(tmp_path.glob("pdcheck-logs-*")), "rank-log directory left behind"


# ---- parallel runs --------------------------------------------------------------------------------------
def test_four_parallel_seed_runs_agree(tmp_path: Path) -> None:
    procs = [start(tmp_path, "handshake", SEED, "--vllm", "0.9.1,0.9.2", "--json") for _ in range(4)]
    results = [p.communicate(timeout=300) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [1, 1, 1, 1], [err[-500:] for _o, err in results]
    docs = [json.loads(out) for out, _err in results]
    assert all(not d["harness_errors"] for d in docs)
    first = {k: [[v["status"], v["contacted"], v["recorded_num_blocks"]] for d in docs[0]["decode_ranks"]
                 for v in [d["verdicts"][k]]] for k in docs[0]["matrix"]}
    for d in docs[1:]:
        got = {k: [[v["status"], v["contacted"], v["recorded_num_blocks"]] for r in d["decode_ranks"]
                   for v in [r["verdicts"][k]]] for k in d["matrix"]}
        assert got == first
    assert docs[0]["matrix"]["0.9.1"] == ["ok", *["assert"] * 7]


# ---- an impostor on the ports a release contacts -----------------------------------------------------------
class Impostor:
    """Listens where vLLM's layout puts an unserved P rank and answers anything with garbage."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.connections = 0
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            try:
                conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03\x00" + b"impostor" * 64)
            except OSError:
                pass
            conn.close()

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.sock.close()


def _hetero_090(tmp_path: Path, *extra: str) -> tuple[int, dict, str]:
    proc = start(tmp_path, "handshake", str(SCENARIOS / "hetero-d4-p2.toml"), "--vllm", "0.9.0", "--json",
                 "--hang-timeout", "1", *extra)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, (json.loads(out) if out.strip() else {}), err


def test_impostor_on_a_contacted_port_gets_no_bytes(tmp_path: Path) -> None:
    from pdcheck.vllm.ports import default_port
    from pdcheck.vllm.releases import resolve

    # 0.9.0 D ranks 2 and 3 contact P ranks 2 and 3 at base + 2, base + 3: P has only ranks 0 and 1.
    base = default_port(resolve("0.9.0").wire)
    with machine_wide(f"port-{base}"):  # the released default: a second copy of the suite squats it too
        squat = [Impostor(base + 2), Impostor(base + 3)]
        try:
            code, doc, err = _hetero_090(tmp_path)
        finally:
            for s in squat:
                s.close()
    assert code == 1, err
    assert doc["matrix"]["0.9.0"][2:] == ["hang", "hang"]  # what vLLM 0.9.0 does: nobody answers
    assert sum(s.connections for s in squat) == 0  # default ports: the layout ports are not the bound ports


def test_explicit_base_port_refuses_a_squatted_layout_port(tmp_path: Path) -> None:
    base = free_run(4)  # D TP 4 contacts P ranks 0-3 at base .. base + 3
    squat = Impostor(base + 2)  # P rank 2's layout port, which pdcheck must hold itself
    try:
        code, doc, err = _hetero_090(tmp_path, "--prefill-base-port", str(base))
    finally:
        squat.close()
    assert code == 3, err
    assert str(base + 2) in err and "Traceback" not in err
    assert squat.connections == 0


def test_a_taken_port_is_one_clean_line(tmp_path: Path) -> None:
    """serve --port on a port another process listens on: what, where, what to do; no class name, the address
    once, exit 3, nothing left running."""
    squat = Impostor(0)
    port = squat.sock.getsockname()[1]
    try:
        w = Watch(start(tmp_path, "serve", "--prefill-tp", "1", "--prefill-blocks", "64", "--vllm", "0.9.2",
                        "--port", str(port), "--duration", "5"))
        code, _out, err = finish(w, timeout=60)
    finally:
        squat.close()
    assert code == 3, err
    (line,) = error_lines(err)
    assert f"127.0.0.1:{port}" in line and line.count(str(port)) == 1, line
    assert "in use" in line and "choose another" in line and "Error:" not in line and "addr=" not in line, line
    assert_clean(w, tmp_path, err)


# ---- a signal to the process group, every command -----------------------------------------------------
# `timeout`, `kill -TERM -PGID` and a systemd unit signal every process of the group: the forkserver, the
# resource tracker and the ranks ignore it (lifecycle.spawn_quietly), so the parent stops them and exits
# 128 + the signal, as for a signal to it alone, with no error line.
def _listener() -> tuple[socket.socket, threading.Event]:
    """A TCP port that accepts and never answers; the event is set once pdcheck has connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    got = threading.Event()
    held: list[socket.socket] = []

    def serve() -> None:
        try:
            while True:
                held.append(srv.accept()[0])
                got.set()
        except OSError:
            pass

    threading.Thread(target=serve, daemon=True).start()
    return srv, got


def _ranks_up(*names: str) -> Callable[[Watch], None]:
    def wait(w: Watch) -> None:
        for name in names:
            w.wait_for(lambda comm, _cmd, n=name: comm.startswith(n), timeout=120)

    return wait


def _ready_line(w: Watch) -> None:
    line = w.proc.stdout.readline()  # type: ignore[union-attr]
    assert line.strip(), w.proc.communicate(timeout=30)[1][-2000:]


SMOKE_ONE = LONG_TRANSFER + '[expect]\n"0.9.2" = "ok"\n'
GROUP_CASES = [
    ("handshake", [*SMALL, "--vllm", "0.9.2", "--inject", "mute:P1", "--hang-timeout", "60"],
     _ranks_up("pdcheck-D1:hs")),
    ("requests", ["--vllm", "0.9.2", "--requests", "200", "--rate", "1"], _ranks_up("pdcheck-P0", "pdcheck-D0")),
    ("probe", ["PORT", "--vllm", "0.9.1", "--tp-size", "1", "--timeout", "60"], None),
    ("probe-sglang", ["http://127.0.0.1:PORT", "--sglang", "auto", "--timeout", "60"], None),
    ("serve", ["--prefill-tp", "1", "--prefill-blocks", "64", "--vllm", "0.9.2", "--json"], _ready_line),
    ("serve-sglang", ["--sglang", "0.5.23", "--json"], _ready_line),
    ("smoke", ["DIR", "--hang-timeout", "60"], _ranks_up("pdcheck-P0", "pdcheck-D0")),
    ("transfer-bench", ["--layers", "2", "--kv-heads", "8", "--head-dim", "64", "--tokens", "256", "--iters", "0",
                        "--min-time", "120"], _ranks_up("pdcheck-P0", "pdcheck-D0")),
]


@pytest.mark.parametrize(("command", "args", "ready"), GROUP_CASES, ids=[c[0] for c in GROUP_CASES])
def test_sigterm_to_the_process_group_is_143_for_every_command(tmp_path: Path, command: str, args: list[str],
                                                                 ready: Callable[[Watch], None] | None) -> None:
    srv, connected = _listener()
    port = str(srv.getsockname()[1])
    (tmp_path / "smoke").mkdir()
    (tmp_path / "smoke" / "long.toml").write_text(SMOKE_ONE)
    args = [a.replace("PORT", f"127.0.0.1:{port}" if a == "PORT" else port) for a in args]
    args = [str(tmp_path / "smoke") if a == "DIR" else a for a in args]
    try:
        w = Watch(start(tmp_path, command.split("-sglang")[0], *args, new_group=True))
        if ready is None:
            assert connected.wait(60), "pdcheck never connected"
        else:
            ready(w)
        w.poll()
        os.killpg(w.proc.pid, signal.SIGTERM)
        t_sig = time.monotonic()
        code, _out, err = finish(w, timeout=60)
    finally:
        srv.close()
    assert code == 143, err[-2000:]
    assert time.monotonic() - t_sig < 10.0
    assert all("interrupted" in ln for ln in error_lines(err)) and len(error_lines(err)) <= 1, err
    assert_clean(w, tmp_path, err)
    deadline = time.monotonic() + 5
    while _group(w.proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _group(w.proc.pid), f"left running in the group: {_group(w.proc.pid)}"


@pytest.mark.parametrize("framework", [["--vllm", "0.9.2", "--prefill-tp", "1", "--prefill-blocks", "64"],
                                       ["--sglang", "0.5.23"]], ids=["vllm", "sglang"])
def test_serve_exits_130_on_sigint(tmp_path: Path, framework: list[str]) -> None:
    w = Watch(start(tmp_path, "serve", *framework, "--json"))
    _ready_line(w)
    w.poll()
    w.proc.send_signal(signal.SIGINT)
    code, _out, err = finish(w, timeout=60)
    assert code == 130, err[-2000:]
    assert not error_lines(err), err
    assert_clean(w, tmp_path, err)
