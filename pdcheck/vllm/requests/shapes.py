"""The request path on TP and DP shapes, pure: which P ranks each D rank reads (kvsplit, the one rule), how many
consumers each P rank waits for and what number D's done notification carries per release line, the DP routing
(request -> P DP group and D DP group, by the params' engine id), and the names of ranks.

Read in the wheels (docs/vllm-protocol.md §3.7): 0.9.1-0.13 D sends `{req}:{tp_ratio}` (D TP // P TP) and P frees
after that many; 0.14-0.33 D sends its world size and P derives `D TP // P TP` consumers per producer when D TP is
the larger (else 1); 0.34 D sends `expected_consumers` (`local_consumers`: the D ranks reading one P rank) and P
frees after that many. P's scheduler frees a request's blocks once every TP worker reported it done (each on its
consumers' notifications or its own expiry sweep).
"""

from __future__ import annotations

import msgspec

from pdcheck.geometry import Geometry, read_source
from pdcheck.kvsplit import corrected_reads
from pdcheck.verdict import rank_label
from pdcheck.vllm.requests.lines import Lifecycle

WORLD_SINCE = (0, 14, 0)  # D's notification carries its world size (0.14-0.33)
CONSUMERS_SINCE = (0, 34, 0)  # ... the expected consumers again (0.34)
MAX_RANKS = 8  # P ranks plus D ranks of one shape: every rank is a process on this host


class Shape(msgspec.Struct, frozen=True):
    """The request path's deployment: TP and DP per side (the handshake scenarios' [prefill]/[decode] keys)."""

    p_tp: int = 1
    p_dp: int = 1
    d_tp: int = 1
    d_dp: int = 1

    @property
    def single(self) -> bool:
        return self.p_tp == self.d_tp == self.p_dp == self.d_dp == 1

    @property
    def heads(self) -> int:
        """The model's KV heads: one per rank of the wider side at least, so no P rank is replicated."""
        return max(2, self.p_tp, self.d_tp)

    def text(self) -> str:
        def side(tp: int, dp: int) -> str:
            return f"TP {tp}" + (f" x DP {dp}" if dp > 1 else "")

        return f"P {side(self.p_tp, self.p_dp)} -> D {side(self.d_tp, self.d_dp)}"


def geometry(shape: Shape, tp: int) -> Geometry:
    """One rank's KV cache of the request path's small model on a side of TP `tp` (2 layers, head dim 64)."""
    return Geometry(tp_size=tp, block_size=16, layers=2, total_kv_heads=shape.heads, head_dim=64, dtype="bfloat16",
                    attn_backend="FLASH_ATTN", use_mla=False)


def sources(shape: Shape, d_rank: int) -> list[int]:
    """The P ranks D rank `d_rank` reads (kvsplit's one rule)."""
    return corrected_reads(d_rank, shape.d_tp, shape.p_tp, shape.heads, False)


def consumers(shape: Shape, p_rank: int) -> int:
    """The D ranks of one DP group that read P rank `p_rank`."""
    return sum(p_rank in sources(shape, d) for d in range(shape.d_tp))


def notif_count(line: Lifecycle, shape: Shape) -> int:
    """The number after the ':' of D's done notification."""
    if line.first >= CONSUMERS_SINCE or line.first < WORLD_SINCE:
        return max(1, shape.d_tp // shape.p_tp)  # tp_ratio (0.9.1-0.13), expected_consumers (0.34)
    return shape.d_tp  # the world size (0.14-0.33)


def expected(line: Lifecycle, n: int, p_tp: int) -> int:
    """How many notifications P waits for, from the number one carries (0.14-0.33: consumers per producer)."""
    if WORLD_SINCE <= line.first < CONSUMERS_SINCE:
        return n // p_tp if n > p_tp else 1
    return max(1, n)


def p_group(shape: Shape, req: int) -> int:
    """The P DP rank the router sends request `req` to (round robin)."""
    return req % shape.p_dp


def d_group(shape: Shape, req: int) -> int:
    """The D DP rank the router sends request `req` to (round robin)."""
    return req % shape.d_dp


def engine(base: str, dp: int, dp_size: int) -> str:
    """A DP rank's engine id (each DP rank is an engine of its own, with its own side channel)."""
    return base if dp_size == 1 else f"{base}-dp{dp}"


def d_label(shape: Shape, dp: int, tp: int) -> str:
    return rank_label(tp, dp, shape.d_dp > 1)


class Read(msgspec.Struct, frozen=True):
    """One P rank a D rank reads: bytes [remote_offset, +read_len) of each P block into D's block at
    local_offset (heads-first blocks: a head run is contiguous)."""

    p_rank: int
    read_len: int
    local_offset: int = 0
    remote_offset: int = 0


def reads(p: Geometry, d: Geometry, d_rank: int) -> list[Read]:
    """What D rank `d_rank` reads of each of its P ranks (geometry.read_source where one P rank holds its heads;
    with P TP > D TP every P rank of its group, each whole block into its heads' place)."""
    one = read_source(p, d, d_rank)
    if one is not None:
        return [Read(one[0], d.block_len, 0, one[1])]
    srcs = corrected_reads(d_rank, d.tp_size, p.tp_size, d.total_kv_heads, d.use_mla)
    return [Read(s, p.block_len, (p.head_start(s) - d.head_start(d_rank)) * d.head_slice_bytes) for s in srcs]
