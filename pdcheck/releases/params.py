"""kv_transfer_params keys per vLLM release: what P's request_finished returns, in the release's own order. The
one table that serve, the request path (pull) and push mode read; each wheel it was read in is listed in
docs/release-models.md ("kv_transfer_params keys")."""

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
), last=(0, 34, ANY), modelled="0.9.0 to 0.34.x")

# Push: NixlPushConnectorScheduler.request_finished (nixl/push_scheduler.py), 0.24+.
PUSH: ReleaseTable[Keys] = ReleaseTable.from_firsts((
    ((0, 24, 0), (*_ID, "remote_num_tokens")),
    ((0, 26, 0), (*_ID, "pp_size", "remote_num_tokens")),
    ((0, 28, 0), (*_ID, "pp_size", "remote_num_tokens", "transfer_mode")),
    ((0, 30, 0), (*_ID, "dcp_size", "pp_size", "remote_num_tokens", "transfer_mode")),
), last=(0, 34, ANY), modelled="0.24.0 to 0.34.x")


def _v(release: str | Sequence[int]) -> Sequence[int]:
    return version_tuple(release) if isinstance(release, str) else release


def pull_keys(release: str | Sequence[int]) -> Keys:
    """The keys P returns in pull mode (a release name or version tuple; past 0.34 the newest)."""
    return PULL.clamped(_v(release))


def push_keys(release: str | Sequence[int]) -> Keys:
    """The keys P's push scheduler returns; () before 0.24 (no push connector)."""
    v = _v(release)
    return () if tuple(v) < PUSH.first else PUSH.clamped(v)


def changes() -> list[tuple[int, int, int]]:
    """Every release where the pull or push keys change: the request path's lines start at each."""
    return sorted({*PULL.firsts(), *PUSH.firsts()})
