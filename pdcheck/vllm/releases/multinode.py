"""Multi-node TP (vllm#25981, PR #26338): where a D rank finds each P rank's metadata when P's TP group spans
nodes. Read from the wheels (the opt-in tests/test_shapes_wheels.py checks these facts against 0.9.2, 0.11.1,
0.14.0, 0.26.0 and 0.34.0):

- every release: D dials kv_transfer_params' `remote_host` for every P rank it reads. P's scheduler, on the head
  node, puts its own VLLM_NIXL_SIDE_CHANNEL_HOST there (`remote_host=self.side_channel_host` in
  request_finished), so every rank is looked up on the head node's address.
- eras A-E (0.9.x - 0.11.0): each worker runs its own listener on its own node
  (`_nixl_handshake_listener(metadata, ready_event, base_port, tp_rank)` binds VLLM_NIXL_SIDE_CHANNEL_HOST at
  base + tp_rank), and D connects to `make_zmq_path("tcp", host, port + p_remote_rank)`: a rank on another node
  is not at that address. `sock.recv()` has no timeout, so the handshake hangs.
- eras F-H (0.11.1+, PR #26338): the engine core gathers every worker's metadata (`content.update(worker_dict)`),
  `set_xfer_handshake_metadata` hands the dict to the scheduler, whose one listener on the head node answers
  `(GET_META_MSG, tp_rank)` (0.26+: `(GET_META_MSG, pp_rank, tp_rank)`) for every rank: nothing is dialled on
  another node.

The corrected model reads each rank's metadata where it is served: rank 0's listener for all ranks (F+), else
each rank's own node address.
"""

from __future__ import annotations

from pdcheck.releaseline import is_corrected
from pdcheck.vllm.releases.base import ReleaseModel
from pdcheck.vllm.wire import FORMATS

PR = "PR #26338"
CORRECTED_EFFECT = ("reads each rank's metadata where it is served: rank 0's listener for every rank (F+), else "
                    "each rank's own node address")


def serves_all_ranks(p_wire: str) -> bool:
    """P's head-node scheduler answers for every TP rank (eras F-H); else each worker listens on its own node."""
    return FORMATS[p_wire].port_scheme == "per_dp"


def dials_head_node(release: ReleaseModel) -> bool:
    """The release dials kv_transfer_params' remote_host (the head node) for every P rank: every vLLM release.
    pdcheck's corrected model knows where each rank is served."""
    return not is_corrected(release)


def rank_node(tp_rank: int, tp_size: int, nodes: int) -> int:
    """The node of a TP rank: ranks split evenly, node by node, as torchrun and Ray place them (node 0, the head,
    holds rank 0 and the scheduler). The one home of this rule: the runtime asks here too."""
    return tp_rank // (tp_size // nodes)


def unreachable(release: ReleaseModel, p_wire: str, tp_size: int, nodes: int) -> list[int]:
    """The P ranks a D rank of `release` cannot reach: those off the head node, when each listens on its own node
    and the release dials the head node for them."""
    if nodes <= 1 or serves_all_ranks(p_wire) or not dials_head_node(release):
        return []
    return [r for r in range(tp_size) if rank_node(r, tp_size, nodes) > 0]


def effect(release: ReleaseModel, p_wire: str, hit: list[int], lost: list[int], ranks_text: str) -> str:
    """One line: what `release` does with a P spanning nodes. hit: D ranks that ask a rank in `lost`."""
    if serves_all_ranks(p_wire):
        return (f"rank 0's scheduler listener on the head node serves every rank's gathered metadata "
                f"((GET_META_MSG, rank), {PR}): every D rank reaches its P ranks")
    if not hit:
        return "every D rank asks only head-node ranks (base + rank on remote_host): reached"
    wait = ("recv() has no timeout: the handshake hangs" if release.recv_timeout_ms is None
            else f"zmq.error.Again after {release.recv_timeout_ms} ms")
    return (f"D dials remote_host (the head node) at base + rank for P rank{'s' if len(lost) > 1 else ''} "
            f"{ranks_text}, which listen on their own node: D rank{'s' if len(hit) > 1 else ''} "
            f"{', '.join(map(str, hit))} get no reply; {wait}")
