"""`pdcheck doctor` against hostile peers and listeners, signals and bad input (docs/reliability.md, "Doctor's peers
and signals").

The hostile end is pdcheck's own doctor (tests/hostile_doctor.py: the real --listen or --peer with its real rank
and sockets, what it sends rewritten on the way out); the end under test is the real CLI in its own session and
temporary directory. Each case asserts the contract: its exit code; on stderr one `pdcheck: error:` line (after a
listener's own announcement) and no traceback; no control character but the page's own newlines on stdout or
stderr, whatever the peer sent; the peak RSS of it and every process it reaped (wait4) under 1 GiB; its wall time
within the timeout; nothing left running in its session, nothing left in its $TMPDIR, no UCX segment left in
/dev/shm. The signal cases find their moments in /proc (the forkserver's command line, the rank's name
pdcheck-P0 / pdcheck-D0), as tests/test_faults.py does, rather than sleeping blindly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from portkit import free_run

from pdcheck import bounds
from pdcheck.launcher import SHM_DIR, UCX_SHM_PREFIX, _held_segments

ROOT = Path(__file__).resolve().parent.parent
HOSTILE = ROOT / "tests" / "hostile_doctor.py"
MiB = 1 << 20
RSS_MB = 1024
# A terminal's escape sequences, a bell, a carriage return that rewrites the line, a newline that starts a fake
# one, a C1 CSI, and a length far past every cap.
EVIL = "\x1b[31mRED\x07\r\nFAKE: pdcheck: error: nothing\x9b2J\x00" + "x" * 5000
# EVIL's head as the one renderer of untrusted text shows it (pdcheck.render.text, through bounds.peer_text)
SHOWN = "\\x1b[31mRED\\x07\\r\\nFAKE: pdcheck: error: nothing\\x9b2J\\x00"
CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


@pytest.fixture
def tmp(request: pytest.FixtureRequest) -> Path:
    """A short temporary directory of the test's own (the subject's $TMPDIR: the forkserver's Unix socket lives
    there, and a socket's path holds 107 bytes, fewer than pytest's own tmp_path under xdist may take)."""
    import shutil

    path = Path(tempfile.mkdtemp(prefix="pdck-hd-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(path, ignore_errors=True))
    return path


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    return dict(env, PYTHONPATH=str(ROOT), TMPDIR=str(tmp), COLUMNS="400", **extra)


# Forks and execs the command, then reports its peak RSS from wait4 (it and every process it reaped: its ranks,
# through the forkserver). Forked from this small interpreter, not from pytest, whose high-water mark a fork
# would inherit. Exit code: the child's, or 128 + the signal that ended it.
# The child starts with the signal dispositions a terminal gives it (this test run may have inherited some
# ignored: an ignored signal stays ignored in pdcheck, and the signal tests would test nothing); its pid goes to
# RSS_FILE.pid for the signal tests, which signal it, not this wrapper.
WRAP = r"""
import os, signal, sys
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_DFL)
signal.pthread_sigmask(signal.SIG_SETMASK, set())
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
with open(sys.argv[1] + ".pid", "w") as f:
    f.write(str(pid))
for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
    signal.signal(sig, signal.SIG_IGN)
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as f:
    f.write(str(usage.ru_maxrss))
code = os.waitstatus_to_exitcode(status)
os._exit(code if code >= 0 else 128 - code)
"""


@dataclass
class Done:
    code: int
    out: str
    err: str
    wall_s: float
    rss_mb: float
    left: list[str]

    @property
    def lines(self) -> list[str]:
        return self.err.strip().splitlines()


class Subject:
    """The pdcheck under test: `pdcheck doctor ARGS` in its own session and $TMPDIR, its peak RSS measured."""

    def __init__(self, tmp: Path, *args: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="s", dir=tmp))
        self.rss = tempfile.NamedTemporaryFile("r", dir=tmp, delete=False)  # noqa: SIM115 - read at the end
        self.shm = _ucx_segments()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([sys.executable, "-c", WRAP, self.rss.name, sys.executable, "-m", "pdcheck",
                                      "doctor", *args], cwd=ROOT, env=_env(self.tmp), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        self.head = ""

    def port(self) -> int:
        """A listener's port, from its announcement (the first stderr line)."""
        assert self.proc.stderr is not None
        self.head = self.proc.stderr.readline()
        got = re.search(r"listening on 127\.0\.0\.1:(\d+)", self.head)
        assert got, self.head + self.wait(30).err
        return int(got[1])

    def wait(self, limit_s: float) -> Done:
        try:
            out, err = self.proc.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            out, err = self.proc.communicate()
            err += f"\n(killed after {limit_s} s)"
        wall = time.monotonic() - self.t0
        deadline = time.monotonic() + 5
        while _session(self.proc.pid) and time.monotonic() < deadline:  # SIGKILLed ranks: a moment to be reaped
            time.sleep(0.05)
        rss = int(Path(self.rss.name).read_text() or 0) / 1024
        return Done(self.proc.returncode, out, self.head + err, wall, rss, _session(self.proc.pid))

    def pid(self) -> int:
        """The pdcheck process itself (the wrapper's child)."""
        path = Path(self.rss.name + ".pid")
        deadline = time.monotonic() + 30
        while not path.exists() or not path.read_text():
            assert time.monotonic() < deadline, "the wrapper never started pdcheck"
            time.sleep(0.001)
        return int(path.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.communicate()


def _session(sid: int) -> list[str]:
    alive = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                alive.append(d)
    return alive


def _ucx_segments() -> set[str]:
    try:
        return {n for n in os.listdir(SHM_DIR) if n.startswith(UCX_SHM_PREFIX)}
    except OSError:
        return set()


class Hostile:
    """The hostile end: pdcheck's own doctor with what it sends rewritten (tests/hostile_doctor.py)."""

    def __init__(self, tmp: Path, mutation: dict, *args: str) -> None:
        self.tmp = tmp / f"hostile-{time.monotonic_ns()}"
        self.tmp.mkdir()
        what = self.tmp / "mutation.json"  # a file: a list of long strings is past what one argument may hold
        what.write_text(json.dumps(mutation))
        self.proc = subprocess.Popen([sys.executable, str(HOSTILE), f"@{what}", "--", "doctor", *args],
                                     cwd=ROOT, env=_env(self.tmp), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, errors="replace", start_new_session=True)

    def port(self) -> int:
        assert self.proc.stderr is not None
        line = self.proc.stderr.readline()
        got = re.search(r"listening on 127\.0\.0\.1:(\d+)", line)
        assert got, line + self.proc.communicate(timeout=30)[1]
        return int(got[1])

    def close(self) -> str:
        """Stop it; what it printed, for a failure's detail (the other end's side of the story)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        out, err = self.proc.communicate()
        return f"the hostile end (exit {self.proc.returncode}) said: {(out + err)[-2000:]}"


def contract(r: Done, subject: Subject, code: int, *, within_s: float, says: str | None = None,
             other: str = "") -> None:
    detail = f"exit {r.code}, {r.wall_s:.1f} s, {r.rss_mb:.0f} MB; stderr: {r.err[-3000:]}; {other}"
    assert r.code == code, detail
    assert "Traceback" not in r.err + r.out, detail
    errors = [ln for ln in r.lines if ln.startswith("pdcheck: error:")]
    if code in (2, 3):
        others = [ln for ln in r.lines if not ln.startswith(("pdcheck: error:", "pdcheck doctor: listening on "))]
        assert len(errors) == 1 and not others, detail
    if says is not None:
        assert says in r.err + r.out, detail
    for name, text in (("stdout", r.out), ("stderr", r.err)):
        bad = CONTROL.search(text)
        assert bad is None, f"a control character {bad[0]!r} reached {name}: {text[max(0, bad.start() - 80):][:200]!r}"
    assert r.wall_s < within_s, detail
    assert r.rss_mb < RSS_MB, detail
    assert not r.left, f"left running: {r.left}"
    left = sorted(p.name for p in subject.tmp.iterdir())
    assert not left, f"left in $TMPDIR: {left}"
    assert not _leaked_segments(subject.shm), f"left in /dev/shm: {_leaked_segments(subject.shm)}"


def _leaked_segments(before: set[str], grace_s: float = 15.0) -> set[str]:
    """UCX segments new since `before` that nobody holds and that stay. /dev/shm is the machine's: a test beside
    this one that SIGKILLs a rank mid start-up leaves a segment there for a moment, until its own pdcheck parent
    removes it at exit (launcher.remove_leaked_segments); one this subject leaked has nobody left to remove it."""
    deadline = time.monotonic() + grace_s
    while True:
        leaked = _ucx_segments() - before
        leaked -= _held_segments(leaked) if leaked else set()
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.5)


def _peer_args(port: int, timeout: str = "20") -> list[str]:
    return ["--peer", f"127.0.0.1:{port}", "--timeout", timeout, "--no-transfer"]


# ------------------------------------------------------------------------------- a hostile peer, the listener
PEER_CASES = [
    # (id, what the peer sends, the listener's exit, what it says, --json)
    ("negative-counts-nan", {"Result": {"checked": -5, "gbps": float("nan"), "p50_us": -1.0}}, 3,
     "reports blocks checked = -5: outside its physical range"),
    ("more-checked-than-sent", {"Result": {"checked": 10**9}}, 3, "reports blocks checked = 1000000000"),
    ("more-wrong-than-checked", {"Result": {"wrong": 5000}}, 3, "reports wrong blocks = 5000"),
    ("infinite-bandwidth", {"Result": {"gbps": float("inf")}}, 3, "reports a bandwidth = inf GB/s"),
    ("negative-latency", {"Result": {"p50_us": -1.0}}, 3, "reports a median latency = -1.0 µs"),
    ("escapes-in-hello", {"Hello": {"protocol": EVIL, "pdcheck": EVIL}}, 3, "the peer at 127.0.0.1 speaks"),
    ("escapes-in-aborted", {"Result": {"__as__": "Aborted", "error": EVIL}}, 1, "the peer's READ failed: \\x1b[31mRED\\x07"),
    ("metadata-unreadable", {"Result": {"__as__": "Aborted", "error": "NIXL_ERR_MISMATCH", "stage": "metadata"}},
     3, "its NIXL cannot read this listener's agent metadata"),
    ("escapes-in-evidence", {"End": {"host": EVIL, "data": [EVIL] * 100, "notifications": [EVIL],
                                     "transports": [EVIL], "ucx": EVIL}}, 0, f"… ({len(EVIL)} characters)"),
]


@pytest.mark.parametrize(("mutation", "code", "says"), [c[1:] for c in PEER_CASES], ids=[c[0] for c in PEER_CASES])
def test_listener_against_a_hostile_peer(tmp: Path, mutation: dict, code: int, says: str) -> None:
    lis = Subject(tmp, "--listen", "127.0.0.1:0", "--timeout", "60")
    try:
        port = lis.port()
        peer = Hostile(tmp, mutation, *_peer_args(port))
        try:
            r = lis.wait(180)
        finally:
            other = peer.close()
    finally:
        lis.kill()
    contract(r, lis, code, within_s=180, says=says, other=other)
    if code == 0:  # the peer's words are in the table, made safe and cut with a mark of what was cut
        assert "… (68 more)" in r.out and SHOWN in r.out, r.out[-3000:]


# ------------------------------------------------------------------------------- a hostile listener, the peer
LISTENER_CASES = [
    ("refused-with-escapes", {"Offer": {"__as__": "Refused", "reason": EVIL}}, 3,
     "the other end refused: " + SHOWN[:30]),
    ("garbage-metadata", {"Offer": {"metadata": "not NIXL metadata", "__bytes__": ["metadata"]}}, 3,
     "is not NIXL metadata this end's NIXL can read (NIXL_ERR_MISMATCH): a peer speaking garbage"),
    ("bind-all-advertised", {"Offer": {"advertise": "0.0.0.0:7777"}}, 3, "a bind-all address"),
    ("unresolvable-advertised", {"Offer": {"advertise": "pdcheck-no-such-host.invalid:7777"}}, 3,
     "a name that does not resolve here"),
    ("escapes-advertised", {"Offer": {"advertise": EVIL}}, 3, "not an IP address or host name and a port"),
    ("nan-fill-time", {"Filled": {"ms": float("nan")}}, 3, "the listener reports its fill time = nan ms"),
    ("answered-then-died", {"__exit_before__": "Filled"}, 3, "the listener answered, then went away"),
    ("escapes-in-evidence", {"End": {"host": EVIL, "transports": [EVIL] * 40, "ucx": EVIL},
                             "Offer": {"agent_name": EVIL, "ucx": EVIL}}, 0, f"… ({len(EVIL)} characters)"),
]


@pytest.mark.parametrize(("mutation", "code", "says"), [c[1:] for c in LISTENER_CASES],
                         ids=[c[0] for c in LISTENER_CASES])
def test_peer_against_a_hostile_listener(tmp: Path, mutation: dict, code: int, says: str) -> None:
    lis = Hostile(tmp, mutation, "--listen", "127.0.0.1:0", "--timeout", "60")
    try:
        port = lis.port()
        # a listener that died: the peer's Fill finds no answer within --timeout (shorter here)
        peer = Subject(tmp, *_peer_args(port, "8" if "__exit_before__" in mutation else "20"))
        r = peer.wait(180)
    finally:
        other = lis.close()
    contract(r, peer, code, within_s=180, says=says, other=other)
    if code == 0:
        assert "… (8 more)" in r.out and SHOWN in r.out, r.out[-3000:]


def test_markdown_page_of_a_hostile_peer_has_no_control_character(tmp: Path) -> None:
    """The same evidence into `--format markdown`: a page a peer cannot write escapes into."""
    lis = Subject(tmp, "--listen", "127.0.0.1:0", "--timeout", "60", "--format", "markdown")
    try:
        port = lis.port()
        peer = Hostile(tmp, {"End": {"host": EVIL, "data": [EVIL], "transports": [EVIL], "ucx": EVIL}},
                       *_peer_args(port))
        try:
            r = lis.wait(180)
        finally:
            peer.close()
    finally:
        lis.kill()
    contract(r, lis, 0, within_s=180)
    # the peer's words are on the page, made visible (escapes, then Markdown's own escaping), never raw
    assert "x1b\\[31mRED" in r.out or "x1b[31mRED" in r.out, r.out[-3000:]
    assert "\nFAKE: pdcheck" not in r.out and not any(c in r.out for c in "\x1b\x07\r\x9b\x00")


def test_matrix_against_a_listener_that_reports_the_impossible(tmp: Path) -> None:
    """A --keep-listening listener that answers a matrix pair with NaN GB/s and more blocks than were sent: the
    matrix is a harness error naming that listener (exit 3), never a PASS."""
    good = Subject(tmp, "--listen", "127.0.0.1:0", "--keep-listening", "--timeout", "30")
    bad = Hostile(tmp, {"Leg": {"gbps": float("nan"), "checked": 10**6}}, "--listen", "127.0.0.1:0",
                  "--keep-listening", "--timeout", "30")
    try:
        ports = [good.port(), bad.port()]
        mx = Subject(tmp, "--matrix", ",".join(f"127.0.0.1:{p}" for p in ports), "--timeout", "30")
        r = mx.wait(240)
    finally:
        bad.close()
        good.kill()
    contract(r, mx, 3, within_s=240, says=f" 127.0.0.1:{ports[1]} reports blocks checked = 1000000")
    assert "--matrix: the listener " in r.err


# ----------------------------------------------------------------------------------- inputs refused up front
@pytest.mark.parametrize(("args", "says"), [
    (["--listen", "127.0.0.1:0", "--advertise", "not an address"], "--advertise: 'not an address' is not HOST:PORT"),
    (["--listen", "127.0.0.1:0", "--advertise", "0.0.0.0:7777"], "--advertise: 0.0.0.0:7777 is a bind-all"),
    (["--peer", "127.0.0.1:\u00b3"], "--peer: '\u00b3' is not a port"),
    (["--peer", "127.0.0.1:\u0663"], "--peer: '\u0663' is not a port"),
    (["--listen", "127.0.0.1:\u00b2"], "--listen: '\u00b2' is not a port"),
    (["--peer", "pdcheck-no-such-host.invalid:7777"], "--peer: pdcheck-no-such-host.invalid does not resolve"),
    (["--peer", EVIL[:60].replace("\x00", "") + ":7777"], "' is not HOST:PORT"),
    (["--peer", "\x1b[2Jhost\x07:7777"], "--peer: '\\x1b[2Jhost\\x07:7777': not an IP address or a host name"),
    (["--matrix", "127.0.0.1:7777"], "a pair needs two"),
    (["--matrix", "127.0.0.1:7777,127.0.0.1:\u00b9"], "--matrix: '\u00b9' is not a port"),
    (["--keep-listening"], "--keep-listening: only with --listen"),
    (["--matrix", "127.0.0.1:1,127.0.0.1:2", "--peer", "127.0.0.1:3"], "--matrix: not with --peer"),
])
def test_bad_input_is_one_line_and_nothing_started(tmp: Path, args: list[str], says: str) -> None:
    s = Subject(tmp, *args, "--timeout", "30")
    r = s.wait(60)
    contract(r, s, 2, within_s=60, says=says)
    assert r.out == ""


# ------------------------------------------------------------------------------------ --ray: not a Ray GCS
def _not_a_gcs(kind: str) -> tuple[socket.socket, list[float]]:
    """A port that accepts TCP on every address and is no GCS: silent, random bytes, or HTTP/2-looking junk (a
    server SETTINGS frame, then empty SETTINGS acks forever). Returns it and when each connection came."""
    srv = socket.socket()
    srv.bind(("0.0.0.0", 0))
    srv.listen(16)
    seen: list[float] = []
    held: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            seen.append(time.monotonic())
            held.append(c)
            try:
                if kind == "random":
                    c.sendall(os.urandom(1 << 16))
                elif kind == "h2":
                    c.sendall(b"\x00\x00\x06\x04\x00\x00\x00\x00\x00\x00\x03\x00\x00\x00\x64")
                    threading.Thread(target=_drip, args=(c,), daemon=True).start()
            except OSError:
                pass

    threading.Thread(target=serve, daemon=True).start()
    return srv, seen


def _drip(c: socket.socket) -> None:
    try:
        while True:
            c.sendall(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00")
            time.sleep(0.3)
    except OSError:
        pass


@pytest.mark.parametrize("kind", ["silent", "random", "h2"])
def test_ray_address_that_is_not_a_gcs_ends_within_the_timeout(tmp: Path, kind: str) -> None:
    pytest.importorskip("ray")
    srv, seen = _not_a_gcs(kind)
    try:
        s = Subject(tmp, "--ray", f"127.0.0.1:{srv.getsockname()[1]}", "--timeout", "5")
        r = s.wait(120)
    finally:
        srv.close()
    contract(r, s, 2, within_s=120, says="is not a Ray cluster's GCS")
    assert seen, "pdcheck never connected"
    # --timeout bounds the exchange with the address: from its first connection to the end (Ray's own client
    # would retry for minutes)
    end = s.t0 + r.wall_s
    assert end - seen[0] < 5 + 3, f"{end - seen[0]:.1f} s after the connection"
    assert "WARN" not in r.err and "rpc_client" not in r.err


# ------------------------------------------------------------------------------------------------- signals
SIGNALS = [signal.SIGTERM, signal.SIGINT, signal.SIGHUP]


def _descendants(root: int) -> dict[int, tuple[str, str]]:
    info: dict[int, tuple[int, str, str]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
                comm = Path(f"/proc/{d}/comm").read_text().strip()
                cmd = Path(f"/proc/{d}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            info[int(d)] = (ppid, comm, cmd)
    out: dict[int, tuple[str, str]] = {}
    frontier = {root}
    while frontier:
        nxt = {pid for pid, (ppid, _c, _m) in info.items() if ppid in frontier and pid not in out}
        out.update({pid: info[pid][1:] for pid in nxt})
        frontier = nxt
    return out


def _wait_for(s: Subject, match, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(match(comm, cmd) for comm, cmd in _descendants(s.proc.pid).values()):
            return
        if s.proc.poll() is not None:
            break
        time.sleep(0.005)
    raise AssertionError(f"the moment never came: {s.wait(30).err[-2000:]}")


def _rank(comm: str, cmd: str) -> bool:
    return comm.startswith(("pdcheck-P0", "pdcheck-D0"))


# (the moment, how it is found in /proc, how long after it the signal goes, which signal): the interpreter just
# exec'd (SIGTERM: a SIGINT there is Python's own KeyboardInterrupt, before any code of pdcheck's runs), the
# forkserver spawned, the pair's rank forked and in its first 0.3 s (it names itself pdcheck-P0 / pdcheck-D0).
MOMENTS = [
    ("exec", lambda comm, cmd: cmd.split()[1:3] == ["-m", "pdcheck"], 0.0, [signal.SIGTERM]),
    ("forkserver", lambda comm, cmd: "forkserver" in cmd, 0.0, SIGNALS),
    ("rank-start", _rank, 0.0, SIGNALS),
    ("rank-start+0.1", _rank, 0.1, SIGNALS),
    ("rank-start+0.3", _rank, 0.3, SIGNALS),
]
SIGNAL_CASES = [(mode, name, match, after, sigs[(i + j) % len(sigs)])
                for j, mode in enumerate(("listen", "peer"))
                for i, (name, match, after, sigs) in enumerate(MOMENTS)]


@pytest.mark.parametrize(("mode", "name", "match", "after", "sig"), SIGNAL_CASES,
                         ids=[f"{c[0]}-{c[1]}-{signal.Signals(c[4]).name}" for c in SIGNAL_CASES])
def test_signal_at_a_start_up_moment_ends_promptly_and_cleanly(tmp: Path, mode: str, name: str, match,
                                                                after: float, sig: int) -> None:
    """SIGTERM, SIGINT or SIGHUP at each moment of a doctor's start-up: 128 + the signal within a few seconds,
    every rank reaped, nothing in $TMPDIR or /dev/shm. The --peer dials a port where nothing answers, so it is
    still starting or waiting whenever the signal comes."""
    args = ["--listen", "127.0.0.1:0"] if mode == "listen" else ["--peer", f"127.0.0.1:{free_run()}"]
    s = Subject(tmp, *args, "--timeout", "60", "--no-transfer")
    pid = s.pid()
    deadline = time.monotonic() + 90
    while not any(match(comm, cmd) for p, (comm, cmd) in {**_descendants(s.proc.pid)}.items()):
        assert s.proc.poll() is None and time.monotonic() < deadline, f"never came: {s.wait(30).err[-2000:]}"
        time.sleep(0.002)
    time.sleep(after)
    assert s.proc.poll() is None, s.wait(30).err[-2000:]
    os.kill(pid, sig)
    t_sig = time.monotonic()
    r = s.wait(60)
    took = time.monotonic() - t_sig
    assert r.code == 128 + sig, f"exit {r.code}: {r.err[-2000:]}"
    assert took < 10, f"{took:.1f} s after the signal"
    contract(r, s, 128 + sig, within_s=120)
    assert not [ln for ln in r.lines if ln.startswith("pdcheck: error:")], r.err


def test_second_signal_during_clean_up_changes_nothing(tmp: Path) -> None:
    """A second Ctrl-C while the first one's clean-up runs is recorded, not raised: the same exit, as prompt."""
    s = Subject(tmp, "--listen", "127.0.0.1:0", "--timeout", "60", "--no-transfer")
    pid = s.pid()
    _wait_for(s, _rank)
    os.kill(pid, signal.SIGINT)
    time.sleep(0.02)
    if s.proc.poll() is None:
        os.kill(pid, signal.SIGINT)
    r = s.wait(60)
    contract(r, s, 130, within_s=120)


def test_bounds_marks_what_it_cuts() -> None:
    """The one bound of a peer's text: printable, capped, and saying how long it was."""
    text = bounds.peer_text(EVIL)
    assert not CONTROL.search(text) and text.endswith(f"… ({len(EVIL)} characters)")
    assert len(text) < bounds.MAX_PEER_STR + 40
    items = bounds.peer_list([EVIL] * 50)
    assert len(items) == bounds.MAX_PEER_ITEMS + 1 and items[-1] == f"… ({50 - bounds.MAX_PEER_ITEMS} more)"


SHUTDOWN = r"""
import sys, time
import msgspec
from pdcheck import launcher, lifecycle
from pdcheck.bench.rank import bench_main
from pdcheck.doctor.pair import _spec, _ucx_env

lau = launcher.Launcher()
rank = lau.start("P", 0, bench_main, msgspec.msgpack.encode(_spec("P", "127.0.0.1", 1 << 24, _ucx_env())),
                 log=sys.argv[1])
print(rank.pid, flush=True)
time.sleep(0.3)  # the rank is starting; nobody closes its launcher (a command interrupted before its `try`)
t0 = time.monotonic()
lifecycle.shutdown(130)
print(time.monotonic() - t0, flush=True)
"""


def test_shutdown_stops_a_rank_nobody_closed(tmp: Path) -> None:
    """The shared mechanism under every command: lifecycle.shutdown reaps a rank whose launcher was never closed
    and does not wait for ever on the resource tracker (each rank holds the tracker's pipe: the stdlib's stop
    waited until that rank ended, which was never)."""
    p = subprocess.run([sys.executable, "-c", SHUTDOWN, str(tmp / "P0.log")], capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=_env(tmp))
    assert p.returncode == 0, p.stderr[-2000:]
    pid, took = p.stdout.split()
    assert float(took) < 5, took
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]
    assert not [x.name for x in tmp.iterdir() if x.name.startswith("pymp-")]


def test_keep_listening_serves_on_after_garbage(tmp: Path) -> None:
    """A --keep-listening listener (a DaemonSet's pod) that gets bytes that are not the protocol turns them away
    (a Refused) and serves the next peer, a real one, as before."""
    import zmq

    lis = Subject(tmp, "--listen", "127.0.0.1:0", "--keep-listening", "--json", "--timeout", "30")
    try:
        port = lis.port()
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(f"tcp://127.0.0.1:{port}")
        for bad in ([b"x"] * 10, [b"\x93" + EVIL.encode()]):  # a multi-part message, then garbage
            s.send_multipart(bad)
            assert s.poll(60000), "no answer"
            assert b"Refused" in s.recv()
        s.close(0)
        peer = Subject(tmp, *_peer_args(port), "--json")
        pr = peer.wait(180)
        assert pr.code == 0, pr.err
        assert lis.proc.poll() is None  # still serving
        os.kill(lis.pid(), signal.SIGTERM)
        r = lis.wait(60)
    finally:
        lis.kill()
    contract(r, lis, 143, within_s=300)
    assert json.loads(r.out.splitlines()[0])["pair"]["role"] == "listen"
    assert "session 1: --listen: a 10-part message while waiting" in r.err, r.err
    assert "session 2: --listen: from 127.0.0.1 while waiting for a peer or a matrix coordinator: not a " \
           "pdcheck-doctor/2 message" in r.err, r.err


def test_matrix_with_a_dead_listener_fails_its_pairs_only(tmp: Path) -> None:
    """A listener that is not there: each of its pairs is a FAIL naming why (within --timeout), the others run,
    exit 1, the matrix table as --ray's."""
    from portkit import refusing

    good = [Subject(tmp, "--listen", "127.0.0.1:0", "--keep-listening", "--timeout", "30") for _ in range(2)]
    try:
        ports = [g.port() for g in good]
        with refusing() as dead:
            mx = Subject(tmp, "--matrix", ",".join(f"127.0.0.1:{p}" for p in [*ports, dead]), "--timeout", "5",
                         "--json")
            r = mx.wait(300)
    finally:
        for g in good:
            g.kill()
    contract(r, mx, 1, within_s=300)
    doc = json.loads(r.out)
    rows = doc["cluster"]["pairs"]
    assert len(rows) == 3 and [x["status"] for x in rows][:2] == ["FAIL", "FAIL"], rows
    for x in rows[:2]:
        assert x["decode"] == f"127.0.0.1:{dead}", x
        assert x["detail"].startswith(f"no KV moved: the listener at 127.0.0.1:{dead} (Who): "), x
    assert rows[2]["status"] in ("PASS", "WARN") and rows[2]["checked"] > 0, rows[2]


@settings(max_examples=300, deadline=None)
@given(text=st.text(), items=st.lists(st.text(), max_size=3 * bounds.MAX_PEER_ITEMS))
def test_whatever_a_peer_writes_enters_printable_and_bounded(text: str, items: list[str]) -> None:
    """Any string or list a peer puts in any field of a message comes out of wire.decode printable (no control,
    format or separator character: nothing a terminal or a page acts on), within its cap plus the mark of what
    was cut, and a list within MAX_PEER_ITEMS plus that mark."""
    from pdcheck.doctor import wire

    end = wire.End(text, items, items, items, text, text)
    for msg in (wire.Result(1, 0, text, 1.0, 1.0, end), wire.Aborted(text, end, text), wire.Refused(text),
                wire.Hello(text, text, [1], items, text), wire.Here(text, text, text, text)):
        for s in _strings(wire.decode(wire.encode(msg), "test")):
            assert s.isprintable(), repr(s)
            assert len(s) <= bounds.MAX_PEER_TEXT + len(f"… ({10**7} characters)"), len(s)


def _strings(v: object) -> list[str]:
    """Every string in a decoded message; every list within MAX_PEER_ITEMS and the mark of the cut."""
    import msgspec

    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        assert len(v) <= bounds.MAX_PEER_ITEMS + 1
        return [s for x in v for s in _strings(x)]
    if isinstance(v, msgspec.Struct):
        return [s for f in v.__struct_fields__ for s in _strings(getattr(v, f))]
    return []
