"""Bounds on every input, checked before any process starts (README: "Input bounds").

Each bound keeps a run within what one machine can do and what pdcheck's own encodings hold: the block
pattern packs P rank in 8 bits, region in 12 and block id in 32 (kvcache.coord_word), rank memory is an
anonymous NORESERVE mmap (virtual until touched), and a run forks one process per rank.
"""

from __future__ import annotations

import ipaddress
import math
import os
import re
import stat
from pathlib import Path
from typing import Annotated, Any, TypeVar

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


def check_out_file(flag: str, path: Path | None) -> None:
    """A file pdcheck writes (--plot, --junit, from-logs -o), checked before anything runs: not a directory,
    in a directory that exists (nothing is created for it) and can be written, and writable if it exists.
    None (the flag not given) passes."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise BadInput(f"{flag} {path}: is a directory")
    parent = p.resolve().parent
    if not parent.is_dir():
        raise BadInput(f"{flag} {path}: directory does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise BadInput(f"{flag} {path}: exists and is not writable")
    if not p.exists():
        import tempfile

        try:  # a real try (as root, os.access says yes to /proc and to a read-only mount)
            tempfile.TemporaryFile(dir=parent).close()
        except OSError as exc:
            raise BadInput(f"{flag} {path}: cannot write in {parent}: {exc.strerror}") from None


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
    cell or error line never renders a peer's megabyte, nor its control characters."""
    text = value if isinstance(value, str) else repr(value)
    if len(text) > limit:
        text = f"{text[:limit]}… ({len(text)} characters)"
    return "".join(c if c.isprintable() else "?" for c in text)
