"""The messages between the parent and its rank processes that every command shares (start, stop, fail, the
block-tag routing of the transfer proof, a framework's opaque final word), and the codec every pipe uses: msgspec
msgpack, never pickle. A framework's or a tool's own messages live in its package (pdcheck/vllm/messages.py,
pdcheck/vllm/requests/messages.py, pdcheck/bench/messages.py, ...): each subclasses Msg and registers with
protocol(), so the codec decodes exactly the messages of the packages this process imported."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import msgspec


class Msg(msgspec.Struct, tag=True):
    """A message over a launcher pipe: tagged by its class name, registered with protocol()."""


_types: dict[str, type[Msg]] = {}
_enc = msgspec.msgpack.Encoder()
_dec: msgspec.msgpack.Decoder[Any] | None = None


def protocol(*types: type[Msg]) -> None:
    """Add message types to the codec (a package's messages module calls this once, at import). A tag two
    packages both claim is a programming error, caught at import."""
    global _dec
    for t in types:
        tag = t.__struct_config__.tag
        if not isinstance(tag, str):
            raise TypeError(f"{t.__qualname__}: a message subclasses messages.Msg")
        if _types.get(tag, t) is not t:
            raise TypeError(f"message tag {tag!r}: {_types[tag].__module__} and {t.__module__} both define it")
        _types[tag] = t
    _dec = None


def _decoder() -> msgspec.msgpack.Decoder[Any]:
    global _dec
    if _dec is None:
        from typing import Union

        _dec = msgspec.msgpack.Decoder(Union[tuple(_types.values())])  # noqa: UP007 - a runtime-built union
    return _dec


def pack(msg: Msg) -> bytes:
    return _enc.encode(msg)


def unpack(data: bytes) -> Msg:
    return _decoder().decode(data)


def send(conn: Connection, msg: Msg) -> None:
    """One message over a launcher pipe (either end)."""
    conn.send_bytes(pack(msg))


def recv(conn: Connection) -> Msg:
    return unpack(conn.recv_bytes())


# ---- every command's ranks ---------------------------------------------------------------------------------
class Ready(Msg):
    tp_rank: int
    agent: str
    setup_ms: float
    # P: this rank's metadata values as its framework encodes them (msgpack), opaque to the launcher: P rank 0
    # serves them on per-DP listeners
    values: bytes | None = None

class Failed(Msg):
    tp_rank: int
    error: str

class Go(Msg):
    """Start the handshakes. `ports` maps every layout port a release may contact to the port pdcheck really
    bound for it in this run; anything else goes to `silent`, a port pdcheck holds that never answers."""

    ports: dict[int, int] = {}
    silent: int = 0
    # Where each P-served layout port listens (its P rank's node address); every other port, `silent` included,
    # on `host` (where the parent holds them). Empty: the scenario's P host (one machine).
    hosts: dict[int, str] = {}
    host: str = ""

class Stop(Msg):
    pass

class Ack(Msg):
    pass

class Armed(Msg):
    pass

class TagReq(Msg):
    ticket: int
    p_rank: int
    blocks: dict[int, list[int]]  # region -> physical block ids to tag

class Tagged(Msg):
    ticket: int

class Mismatch(msgspec.Struct):
    region: int
    local_block: int
    remote_block: int
    p_rank: int
    expected: str
    found: str

class TransferResult(msgspec.Struct):
    status: str  # "ok" | "wrong" | "error" | "skipped" | "arrived" (READ DONE, content not checkable)
    blocks: int = 0
    wrong: int = 0
    first_mismatch: Mismatch | None = None
    wrong_regions: list[int] = []
    message: str | None = None
    stride: int | None = None
    bytes: int = 0
    seconds: float = 0.0

class FrameworkFinal(Msg):
    """A rank of another serving framework (pdcheck.sglang) reports its end: `body` is msgpack of that
    framework's own result type, decoded by its runner (this codec stays framework-neutral)."""

    tp_rank: int
    body: bytes


protocol(Ready, Failed, Go, Stop, Ack, Armed, TagReq, Tagged, FrameworkFinal)
