"""Bounds on every input, checked before any process starts (README: "Input bounds").

Each bound keeps a run within what one machine can do and what pdcheck's own encodings hold: the block
pattern packs P rank in 8 bits, region in 12 and block id in 32 (pattern.coord_word), rank memory is an
anonymous NORESERVE mmap (virtual until touched), and a run forks one process per rank.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import math
import os
import re
import stat
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, BinaryIO, TypeVar

import msgspec

from pdcheck.errors import BadInput

MAX_FILE_BYTES = 1 << 20  # a scenario file is a few hundred bytes; 1 MiB is generous
MAX_TP = 64  # per side, by default; --max-tp raises it up to HARD_MAX_TP
HARD_MAX_TP = 256  # P rank is 8 bits in the block pattern
MAX_NUM_BLOCKS = 1 << 24  # per rank (vLLM's largest GPUs hold ~10^6 blocks)
MAX_BLOCK_SIZE = 1024  # tokens per block
MAX_LAYERS = 1024  # regions (2 per layer) stay below the pattern's 4096
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 8192
MAX_DP_RANK = 1023
# DP ranks per side that run as real rank groups (each a full TP group), and PP stages per side
MAX_DP_SIZE = 8
MAX_PP_SIZE = 16
# Nodes one instance's TP group spans (each node's ranks on their own loopback address, 127.0.0.(k+1))
MAX_NODES = 8
MAX_DEVICE_ID = 1023
MAX_REQUESTS = 256
MAX_BLOCKS_PER_REQUEST = 4096
MAX_SEED = 2**32 - 1
MIN_BASE_PORT = 1024  # below: privileged ports, which an unprivileged run cannot bind
MAX_RANK_BYTES = 1 << 38  # 256 GiB of virtual KV cache per rank (NORESERVE: only touched pages cost)
MAX_RELEASES = 64
# Bytes the transfer proof tags, reads and checks per rank and release: ~1 s per 40 MiB on a 2-core host.
MAX_PROOF_BYTES = 1 << 28
HANG_TIMEOUT_S = (0.01, 3600.0)
RUN_TIMEOUT_S = (0.1, 86400.0)
# transfer-bench's own quantities (its shape, TP, seed, block size and timeout use the bounds above)
MAX_BENCH_REQUESTS = 4096  # distinct block tables one row cycles through (--requests 0 picks up to this many)
MAX_TOKENS = 1 << 22  # tokens per request
MAX_SWEEP = 64  # values in one --block-size or --tokens list
MAX_RUN_LENGTH = 1 << 20
MAX_ITERS = 10**7
MAX_WARMUP = 10**6
MAX_CORRUPT_BLOCK = 2**31 - 1  # a descriptor index of request 0
MIN_TIME_S = (0.001, 3600.0)
MIN_RATE = 0.01  # arrivals per second (requests --rate): one every 100 s at the slowest
# requests --lease (and [requests] lease): a line's first request waits for D's handshake with P (tens of ms on
# loopback, more on a loaded machine), which the model does not time; a shorter lease expires it during that wait
LEASE_S = (0.1, 600.0)
# --time-scale / PDCHECK_TIME_SCALE: a request run in slow motion (never faster than written: its sub-second
# leases already sit close to a handshake's length; docs/requests.md, "Slow motion")
TIME_SCALE = (1.0, 20.0)

# Untrusted input: a live peer, a --version-url, a log file (docs/reliability-untrusted.md). Frame and HTTP
# caps live beside the code that enforces them (pdcheck.netio).
PROBE_TIMEOUT_S = (0.01, 3600.0)  # probe --timeout: per side-channel exchange and for the --version-url GET
SERVE_DURATION_S = (0.01, 365 * 86400.0)  # serve --duration
MAX_LOG_BYTES = 512 << 20  # bytes read from one log, after gzip inflation (a start-up log is KB to MB)
MAX_LOG_LINES = 4 << 20  # lines read from one log (a gzip bomb of empty lines stops here, quickly)
MAX_LOG_LINE = 64 << 10  # bytes kept of one line; the rest of a longer line is skipped unread into memory
MAX_PEER_STR = 256  # engine id, backend, layout names a peer advertises
MAX_PEER_REGIONS = 2 * MAX_LAYERS  # kv_caches_base_addr / block_lens entries (two regions per layer)
MAX_PEER_BLOCK_LEN = 1 << 32  # bytes in one block of one region
# A saved --json document (pdcheck report): a document of 256 ranks and every release is a few MB, nests 6 levels
# and holds a few hundred thousand values. The shape is measured on the bytes before anything is decoded
# (json_shape): a decoded value costs 50-100 bytes of memory whatever its size in the file ("[]," is 3 bytes and a
# 56-byte list), so 64 MiB of "[[],[],...]" would take 3 GiB to decode.
MAX_DOC_BYTES = 64 << 20
MAX_DOC_DEPTH = 32  # nesting levels
MAX_DOC_VALUES = 2_000_000  # arrays, objects and the commas between values: a bound on what decoding creates
MAX_PEER_TEXT = 1024  # a peer's free text (an error it reports, a refusal's reason): NIXL's errors run to ~300
MAX_PEER_ITEMS = 32  # entries of a list a peer sends (a doctor end's UCX lanes: a handful)
# What a doctor peer may report of a transfer (pdcheck.doctor.wire): beyond these it is not a measurement.
MAX_PEER_GBPS = 1e5  # GB/s: 100 TB/s, far above any link or memory bus
MAX_PEER_LATENCY_US = 3600e6  # one READ within an hour
MAX_MATRIX_LISTENERS = 64  # doctor --matrix: 2016 pairs
MAX_HOST_NAME = 253  # a DNS name (RFC 1035), dots included


def open_regular(path: Path, what: str, hint: str) -> int:
    """A read-only fd of `path`, refused unless a regular file: a FIFO, a device (/dev/zero), a directory or
    a socket is named before anything blocks or fills memory. BadInput names the path and `what` it should be
    (`hint`: what to give instead). The caller closes the fd."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{path}: no such {what}") from None
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise BadInput(f"{path}: is a directory, not a {what}")
    if not stat.S_ISREG(st.st_mode):
        raise BadInput(f"{path}: not a regular file (a FIFO, device or socket); {hint}")
    try:
        # O_NONBLOCK: if the path was swapped for a FIFO since stat(), open() still returns at once.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"{path}: not a regular file (a FIFO, device or socket); {hint}")
    return fd


def read_scenario_text(path: Path) -> str:
    """The text of a scenario file: a regular file of at most MAX_FILE_BYTES of UTF-8 (open_regular)."""
    data = read_file_bytes(path, "scenario file", "give a .toml file", MAX_FILE_BYTES)
    if data.startswith(b"\xef\xbb\xbf"):
        data = data[3:]  # a UTF-8 byte-order mark is still UTF-8
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        bad = data[exc.start:exc.start + 1].hex()
        raise BadInput(f"{path}: not UTF-8 text: byte 0x{bad} at offset {exc.start} (save the file as UTF-8)") from None


def read_file_bytes(path: Path, what: str, hint: str, limit: int) -> bytes:
    """The bytes of a regular file (open_regular) of at most `limit` bytes, read no further than that."""
    fd = open_regular(path, what, hint)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise BadInput(f"{path}: {size} bytes; a {what} is at most {limit} bytes")
        chunks: list[bytes] = []
        left = limit + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 16))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise BadInput(f"{path}: more than {limit} bytes; a {what} is at most {limit} bytes")
    return data


def check_int(flag: str, v: int, lo: int, hi: int) -> None:
    if not lo <= v <= hi:
        raise BadInput(f"{flag}: {v} is out of range ({lo} to {hi})")


def check_number(flag: str, v: float, lo: float, hi: float = math.inf) -> None:
    """A finite number in [lo, hi]."""
    if not (math.isfinite(v) and lo <= v <= hi):
        want = f"from {lo:g} to {hi:g}" if math.isfinite(hi) else f">= {lo:g}"
        raise BadInput(f"{flag}: {v:g} is out of range (a finite number {want})")


def check_out_dir(flag: str, path: Path) -> None:
    """A directory pdcheck writes into: used if it exists, created with its parents if it does not. Refused
    when it is something else than a directory, or cannot be created or written."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise BadInput(f"{flag} {path}: exists and is not a directory")
    have = p
    while not have.exists():  # the nearest existing ancestor decides whether it can be created
        have = have.parent
    if not have.is_dir():
        raise BadInput(f"{flag} {path}: {have} is not a directory")
    if not os.access(have, os.W_OK | os.X_OK):
        raise BadInput(f"{flag} {path}: {have} is not writable")


# --force of the running command: an output file may then be a symbolic link, written through (set once by
# pdcheck.commands.output_flags for every command's output files: --output, --junit, --plot).
_FORCE: ContextVar[bool] = ContextVar("pdcheck_force_output", default=False)


@contextlib.contextmanager
def forced_output(force: bool) -> Iterator[None]:
    token = _FORCE.set(force)
    try:
        yield
    finally:
        _FORCE.reset(token)


def check_out_file(flag: str, path: Path | None, force: bool | None = None) -> None:
    """A file pdcheck writes (--output, --junit, --plot, from-logs -o), checked before anything runs: a regular
    file or none yet (a FIFO would block the run for ever with no reader, a device or socket is no place for a
    report), not a symbolic link unless `force` (default: the command's --force; a link would be followed to
    whatever it names, a dangling one would create its target), in a directory that exists and can be written,
    and writable if it exists (tried, not asked: root is refused /proc and a read-only mount too). None (the flag
    not given) passes. write_out then writes it without following a link that appeared since."""
    if path is None:
        return
    force = _FORCE.get() if force is None else force
    p = Path(path)
    try:
        st: os.stat_result | None = os.lstat(p)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot use it: {exc.strerror}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        if not force:
            raise BadInput(f"{flag} {path}: is a symbolic link (to {os.readlink(p)}); name the file itself, or pass "
                           "--force to write through the link")
        try:
            st = os.stat(p)
        except FileNotFoundError:  # dangling: --force creates what it names
            st = None
        except OSError as exc:
            raise BadInput(f"{flag} {path}: cannot use it: {exc.strerror}") from None
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise BadInput(f"{flag} {path}: is a directory")
        if not stat.S_ISREG(st.st_mode):
            raise BadInput(f"{flag} {path}: not a regular file (a FIFO, device or socket); name a file")
        try:  # opened for writing without truncating it: refuses what os.access would let root through
            os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        except OSError as exc:
            raise BadInput(f"{flag} {path}: exists and cannot be written: {exc.strerror}") from None
        return
    parent = Path(os.path.realpath(p)).parent
    if not parent.exists():
        raise BadInput(f"{flag} {path}: directory does not exist")
    if not parent.is_dir():
        raise BadInput(f"{flag} {path}: {parent} is not a directory")
    import tempfile

    try:  # a real try (as root, os.access says yes to /proc and to a read-only mount)
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot write in {parent}: {exc.strerror}") from None


def open_out(flag: str, path: Path, force: bool | None = None) -> BinaryIO:
    """`path` opened to be written (created or truncated), as check_out_file allowed it: a symbolic link only
    with `force` (O_NOFOLLOW otherwise, so a link put there since the check is refused, not followed), never
    blocking on a FIFO (O_NONBLOCK: no reader is ENXIO), and a regular file (fstat) or refused."""
    force = _FORCE.get() if force is None else force
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK | os.O_CLOEXEC | (0 if force else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise BadInput(f"{flag} {path}: is a symbolic link; pass --force to write through it") from None
        raise BadInput(f"{flag} {path}: cannot write: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise BadInput(f"{flag} {path}: not a regular file (a FIFO, device or socket); name a file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "wb")


def write_out(flag: str, path: Path, data: bytes, force: bool | None = None) -> None:
    """`data` written to `path` (open_out), every failure one BadInput line naming the flag."""
    f = open_out(flag, path, force)
    try:
        f.write(data)
        f.close()
    except OSError as exc:
        raise BadInput(f"{flag} {path}: cannot write: {exc.strerror}") from None
    finally:
        if not f.closed:
            with contextlib.suppress(OSError):
                f.close()


def check_timeouts(hang_timeout: float, timeout: float | None = None) -> None:
    check_seconds("--hang-timeout", hang_timeout, HANG_TIMEOUT_S)
    if timeout is not None:
        check_seconds("--timeout", timeout, RUN_TIMEOUT_S)


def check_seconds(flag: str, v: float, bounds: tuple[float, float]) -> None:
    """A finite number of seconds within bounds (nan, inf and 1e300 are refused, not converted)."""
    lo, hi = bounds
    if not (math.isfinite(v) and lo <= v <= hi):
        raise BadInput(f"{flag}: {v:g} s is out of range (a finite number of seconds from {lo:g} to {hi:g})")


def check_max_tp(max_tp: int) -> None:
    if not 1 <= max_tp <= HARD_MAX_TP:
        raise BadInput(f"--max-tp: {max_tp} is out of range (1 to {HARD_MAX_TP})")


def check_host(where: str, key: str, host: str) -> None:
    """An IP literal: the side channel binds it, and a name would need a resolver ZMQ does not use."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise BadInput(f"{where}: {key}: {host!r} is not an IP address (e.g. 127.0.0.1 or ::1)") from None


def check_device(device: str) -> None:
    """--device cuda needs an NVIDIA driver. Ask the kernel and libcuda directly (milliseconds) instead of
    letting every rank import torch first (seconds and ~100 MB each) only to learn there is none."""
    if device not in ("cpu", "cuda"):
        raise BadInput(f"--device: expected cpu or cuda, got {device!r}")
    if device != "cuda":
        return
    import ctypes

    if not os.path.exists("/proc/driver/nvidia/version"):
        raise BadInput("--device cuda: no NVIDIA driver on this machine (/proc/driver/nvidia absent); "
                       "use --device cpu")
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        raise BadInput("--device cuda: the NVIDIA driver's libcuda.so.1 cannot be loaded; use --device cpu") from None
    count = ctypes.c_int(0)
    rc = cuda.cuInit(0)
    if rc == 0:
        rc = cuda.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0 or count.value < 1:
        raise BadInput(f"--device cuda: no usable GPU (cuInit/cuDeviceGetCount returned {rc}, "
                       f"{count.value} devices); use --device cpu")


def json_shape(data: bytes) -> tuple[int, int]:
    """(nesting depth, values) of a JSON text, measured on its bytes without decoding it, in 4 MiB steps of numpy:
    escaped backslashes and quotes are dropped first, so every quote left opens or closes a string; outside
    strings, each '[' or '{' is one level deeper and one value, each ',' one more value. About a second and two
    copies of the text for 64 MiB; bytes that are not JSON give some answer, and the decoder refuses them after."""
    import numpy as np

    bare = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    quote, comma = ord('"'), ord(",")
    inside = 0  # 1 while in a string, carried from step to step
    level = depth = values = 0
    step = 4 << 20
    for at in range(0, len(bare), step):
        chunk = np.frombuffer(bare, dtype=np.uint8, count=min(step, len(bare) - at), offset=at)
        q = chunk == quote
        parity = (np.cumsum(q, dtype=np.uint8) + inside) & 1  # 1 inside a string (its opening quote included)
        inside = int(parity[-1])
        out = (parity == 0) & ~q
        opens = out & ((chunk == ord("[")) | (chunk == ord("{")))
        closes = out & ((chunk == ord("]")) | (chunk == ord("}")))
        values += int(opens.sum()) + int((out & (chunk == comma)).sum())
        levels = np.cumsum(opens.astype(np.int32) - closes.astype(np.int32)) + level
        if levels.size:
            depth = max(depth, int(levels.max()))
            level = int(levels[-1])
    return depth, values


def check_json_doc(data: bytes, where: str) -> None:
    """A JSON document's shape within MAX_DOC_DEPTH and MAX_DOC_VALUES before it is decoded: BadInput (exit 2)
    naming `where` and the bound, in milliseconds and a few times the file's size in memory."""
    depth, values = json_shape(data)
    if values > MAX_DOC_VALUES:
        raise BadInput(f"{where}: more than {MAX_DOC_VALUES} values (arrays, objects and commas: {values}); a pdcheck "
                       "--json document holds far fewer")
    if depth > MAX_DOC_DEPTH:
        raise BadInput(f"{where}: nested {depth} levels deep; a pdcheck --json document nests at most "
                       f"{MAX_DOC_DEPTH}")


# ---------------------------------------------------------------------------------- what a peer advertises
# Decoding is the validation: an advertised document is converted (strictly: "2" is not 2, true is not 1) into
# a msgspec Struct whose fields carry these bounds, before any value sizes a loop, a list or a table row.
PeerTp = Annotated[int, msgspec.Meta(ge=1, le=HARD_MAX_TP)]
PeerPp = Annotated[int, msgspec.Meta(ge=1, le=MAX_PP_SIZE)]
PeerDp = Annotated[int, msgspec.Meta(ge=1, le=MAX_DP_RANK + 1)]
PeerPageSize = Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
PeerPort = Annotated[int, msgspec.Meta(ge=1, le=65535)]
PeerStr = Annotated[str, msgspec.Meta(max_length=MAX_PEER_STR)]

S = TypeVar("S")


def peer_doc(doc: Any, typ: type[S], where: str) -> S:
    """`doc` (a decoded JSON object a peer sent) as `typ`; netio.PeerError (exit 3) naming the field, the value
    (shortened) and the bound it breaks, `where` first (e.g. "P's bootstrap server")."""
    from pdcheck.netio import PeerError

    try:
        return msgspec.convert(doc, typ, strict=True)
    except msgspec.ValidationError as exc:
        text = str(exc)
        what, _sep, path = text.partition(" - at `$.")
        field = path.rstrip("`").split(".")[0].split("[")[0] if path else None
        if field is None and what.startswith("Object missing required field `"):
            raise PeerError(f"{where}: {what.split('`')[1]} is missing") from None
        if field is not None and isinstance(doc, dict):
            raise PeerError(f"{where}: {field} = {peer_text(doc.get(field), 40)}: {what.lower()}") from None
        raise PeerError(f"{where}: {what}") from None


# A number typed into a flag or a scenario string: ASCII digits only (str.isdigit and int() also take '²' and
# Arabic-Indic digits) and a bounded length, so an error line never echoes a megabyte.
MAX_NUMBER_CHARS = 24
_INT = re.compile(r"[0-9]{1,18}")
_DECIMAL = re.compile(r"(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?")


def ascii_int(text: str) -> int | None:
    """An integer of ASCII digits (no sign, no '_'), or None."""
    return int(text) if _INT.fullmatch(text) else None


def ascii_number(text: str) -> float | None:
    """A non-negative decimal number in ASCII ('1.5', '.5', '2e-3'), or None (no 'nan', 'inf', '_' or sign)."""
    return float(text) if len(text) <= MAX_NUMBER_CHARS and _DECIMAL.fullmatch(text) else None


def peer_text(value: Any, limit: int = MAX_PEER_STR) -> str:
    """A peer's value as printable text of at most `limit` characters (more is cut, its length said): a table
    cell or error line never renders a peer's megabyte, nor its control characters (pdcheck.render.text, the one
    renderer of untrusted text: they are shown as escapes)."""
    from pdcheck.render.text import clean

    return clean(value if isinstance(value, str) else repr(value), limit)


def peer_list(values: list[Any], limit: int = MAX_PEER_STR, items: int = MAX_PEER_ITEMS) -> list[str]:
    """A peer's list of strings as at most `items` entries of peer_text, the last saying how many were cut."""
    out = [peer_text(v, limit) for v in values[:items]]
    if len(values) > items:
        out.append(f"… ({len(values) - items} more)")
    return out


def peer_number(what: str, value: Any, lo: float, hi: float, unit: str = "") -> float:
    """A number a peer reports of a measurement, judged against its physical range [lo, hi] (a count below 0, a
    NaN or infinite rate, more blocks checked than were sent): netio.PeerError (exit 3) naming it otherwise, never
    a verdict built on it. `what` names the peer and the quantity ("the peer at 10.0.0.6: blocks checked")."""
    from pdcheck.netio import PeerError

    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and lo <= value <= hi
    if not ok:
        shown = peer_text(value, 40)
        raise PeerError(f"{what} = {shown}{unit}: outside its physical range ({lo:g} to {hi:g}{unit}); a peer that "
                        "reports this is broken or lying, and its transfer is not judged")
    return float(value)
