"""SGLang 0.5.23 (R7): more PrefillServerInfo keys (B6), a 24-field registration and is_dummy on the request (E6;
R7 nixl/conn.py:376-456, 3428-3526), completion by P's ZMQ KV_STATUS message instead of NIXL notifications
(nixl/conn.py:515), a log line when P's bootstrap thread dies (:3413-3424), and a registration with fewer KV
regions than P's kills that thread (_add_remote_peer -> _prepare_payload_xfer, :1482-1492, :2046)."""

from msgspec.structs import replace

from pdcheck.sglang.releases import r0_5_13
from pdcheck.sglang.releases.base import AUX_SKEW_LOG, FEWER_REGIONS

INFO_EXTRA = ("enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout", "decode_allocation_policy",
              "enable_kv_cache_sharding", "prefill_http_port")

MODEL = replace(
    r0_5_13.MODEL, name="0.5.23", tag="R7", versions=("0.5.23",),
    bootstrap="B6",
    put_keys=(*r0_5_13.PUT_B5, "kv_layout", "dsv41_spec_layout", "enable_dsa_cache_layer_split",
              "enable_kv_cache_sharding", "prefill_http_port", "decode_allocation_policy"),
    info_keys=(*r0_5_13.INFO_REQUIRED, *INFO_EXTRA, *r0_5_13.INFO_TARGETS),
    wire="E6",
    completion="kv_status",
    room_reuse="cleared", aux_pairing="shorter", aux_skew_log=AUX_SKEW_LOG, fewer_regions_raise=FEWER_REGIONS,
    thread_death_log=("prefill bootstrap_thread died on engine_rank={rank}; requests to this rank will time out "
                      "in KVPoll.Bootstrapping"),
    receiver_exception="KVTransferError(bootstrap_room={room}): {reason}",
    summary="24-field registration, KV_STATUS completion over ZMQ, strict PrefillServerInfo",
)
