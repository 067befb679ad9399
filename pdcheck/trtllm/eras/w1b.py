"""W1b, the Python transceiver of disagg/native/kv_transfer.py@1696f36d with kv_mapper.py@cd820382 (T11): bytes
constants, RecvReqInfo with block_ids as msgpack ints (T28), 6-frame TASK_STATUS results (T37), flat RankInfo with
kv_ptrs (T31) and the InstanceInfo reply (T32), PeerRegistrar checks (T67). Handlers raise; ZMQMessenger decides:
@65b31db1 stops the listener, @0825635c logs and goes on, and which shipped with W1b is not established (T44):
pdcheck models the one that stops."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import w1a

MODEL = replace(
    w1a.MODEL, name="W1b", wire="W1b", listener="stops",
    summary="bytes frames, TASK_STATUS; the messenger stops its listener on an exception (@65b31db1)",
    facts=("T11", "T28", "T31", "T32", "T37", "T44", "T67"),
)
