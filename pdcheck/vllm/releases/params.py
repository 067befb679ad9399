"""kv_transfer_params keys per vLLM release: what P's request_finished returns, in the release's own order. The
one table that serve, the request path (pull) and push mode read; each wheel it was read in is listed in
docs/release-models.md ("kv_transfer_params keys"). Beside it, the shape of the values (read in the same wheels):

* remote_block_ids: a flat list of P's block ids up to 0.17; from 0.18 the connector's request_finished wraps them
  `(block_ids,)`, one list per KV-cache group (msgpack and JSON carry the tuple as a list of lists), and D reads
  them per group (BLOCK_IDS_PER_GROUP).
* remote_num_tokens (0.21+): `request.num_computed_tokens`, P's computed tokens (blocks * block_size for full
  blocks), not a block count; D's get_num_new_matched_tokens loads `min(remote_num_tokens, num_prompt_tokens) -
  num_computed_tokens` tokens (tokens_to_load).
* remote_port: P's side-channel port (`self.side_channel_port`), where D handshakes with it.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdcheck.releaseline import ANY, ReleaseTable, version_tuple

Keys = tuple[str, ...]

_BASE = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id")
_SIDE = ("remote_host", "remote_port")
_ID = (*_BASE, "remote_request_id", *_SIDE, "tp_size")  # 0.13+: the request id between engine id and host

# Pull: NixlConnectorScheduler.request_finished (nixl_connector.py; nixl/scheduler.py 0.20 - 0.23), from 0.24
# NixlPullConnectorScheduler (nixl/pull_scheduler.py).
PULL: ReleaseTable[Keys] = ReleaseTable.from_firsts((
    ((0, 9, 0), (*_BASE, *_SIDE)),
    ((0, 9, 2), (*_BASE, *_SIDE, "tp_size")),
    ((0, 13, 0), _ID),
    ((0, 21, 0), (*_ID, "remote_num_tokens")),
    ((0, 26, 0), (*_ID, "remote_num_tokens", "remote_blocks_expiry_time")),
    ((0, 28, 0), (*_ID, "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode")),
    ((0, 29, 0), (*_ID, "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time",
                  "transfer_mode")),
    ((0, 33, 0), (*_ID, "dcp_size", "pp_size", "remote_num_tokens", "remote_blocks_expiry_time",
                  "remote_registration_generation", "transfer_mode")),
), last=(0, 34, ANY))

# Push: NixlPushConnectorScheduler.request_finished (nixl/push_scheduler.py), 0.24+.
PUSH: ReleaseTable[Keys] = ReleaseTable.from_firsts((
    ((0, 24, 0), (*_ID, "remote_num_tokens")),
    ((0, 26, 0), (*_ID, "pp_size", "remote_num_tokens")),
    ((0, 28, 0), (*_ID, "pp_size", "remote_num_tokens", "transfer_mode")),
    ((0, 30, 0), (*_ID, "dcp_size", "pp_size", "remote_num_tokens", "transfer_mode")),
), last=(0, 34, ANY))


BLOCK_IDS_PER_GROUP = (0, 18, 0)  # request_finished(request, (block_ids,)) from here on

BlockIds = list[int] | list[list[int]]


def _v(release: str | Sequence[int]) -> Sequence[int]:
    return version_tuple(release) if isinstance(release, str) else release


def pull_keys(release: str | Sequence[int]) -> Keys:
    """The keys P returns in pull mode (a release name or version tuple; past 0.34 the newest)."""
    return PULL.clamped(_v(release))


def push_keys(release: str | Sequence[int]) -> Keys:
    """The keys P's push scheduler returns; () before 0.24 (no push connector)."""
    v = _v(release)
    return () if tuple(v) < PUSH.first else PUSH.clamped(v)


def block_ids_value(release: str | Sequence[int], groups: Sequence[Sequence[int]]) -> BlockIds:
    """remote_block_ids as P of `release` returns them: one list per KV-cache group from 0.18, flat before (one
    group: the flat list is that group's)."""
    if tuple(_v(release)) >= BLOCK_IDS_PER_GROUP:
        return [list(g) for g in groups]
    if len(groups) != 1:
        raise ValueError("a release before 0.18 hands out one group's block ids")
    return list(groups[0])


def block_id_groups(value: object) -> list[list[int]]:
    """D's reading of remote_block_ids, either shape: the block ids of each KV-cache group. A flat list (before
    0.18) is one group; ValueError on anything else (a router's hand-made params)."""
    if not isinstance(value, list | tuple):
        raise ValueError(f"remote_block_ids is {type(value).__name__}, not a list")
    if all(isinstance(x, list | tuple) for x in value) and value:
        return [[int(b) for b in g] for g in value]
    if any(isinstance(x, list | tuple) for x in value):
        raise ValueError("remote_block_ids mixes block ids and per-group lists")
    return [[int(b) for b in value]]


def reshaped(like: object, ids: list[int]) -> BlockIds:
    """`ids` in the shape of the remote_block_ids value `like` (one group): for a router rewriting the ids."""
    nested = isinstance(like, list | tuple) and bool(like) and all(isinstance(x, list | tuple) for x in like)
    return [list(ids)] if nested else list(ids)


def num_tokens(blocks: int, block_size: int) -> int:
    """remote_num_tokens as P returns it: request.num_computed_tokens, the tokens its full blocks hold."""
    return blocks * block_size


def tokens_to_load(params: dict[str, object], prompt_tokens: int, computed: int = 0) -> int:
    """The tokens D loads from P (0.21+ get_num_new_matched_tokens): `min(remote_num_tokens, num_prompt_tokens)
    - num_computed_tokens`, `remote_num_tokens` read as `params.get("remote_num_tokens") or 0`."""
    remote = params.get("remote_num_tokens") or 0
    return max(0, min(int(remote), prompt_tokens) - computed)  # type: ignore[call-overload]


def changes() -> list[tuple[int, int, int]]:
    """Every release where the pull or push keys or a value's shape change: the request path's lines start at
    each."""
    return sorted({*PULL.firsts(), *PUSH.firsts(), BLOCK_IDS_PER_GROUP})
