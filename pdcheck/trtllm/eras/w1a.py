"""W1a, an early Python transceiver wire (Shixiaowei02:disagg/native/kv_transfer.py@0033fff3, T9): str message
constants sent as ASCII, GenReqInfo requests (T27), 5-frame TASK_STATE results (T37), a flat RankInfo with
`recv_endpoint` (T31; its full key list was not read: pdcheck's is W1's with that key) and an InstanceInfo with
`ctx_endpoints` (T32). Its listener loops have no try: an unknown type or any handler exception ends the thread,
and every later request to that rank hangs (T43). PeerRegistrar checks assumed as W1b's (T67). Dated only by the
pull requests that touched it (2026, before W1b); kv_transfer_timeout_ms None assumed (before trtllm#12249)."""

from pdcheck.trtllm.eras.base import TrtLine

MODEL = TrtLine(
    name="W1a", era="E4 (opt-in Python)", releases="1.3.0rc (not established which)", runtime="python",
    wire="W1a", checks="registrar", listener="dies", transfer_timeout_ms=None,
    timeout_source="no timeout in the module; kv_transfer_timeout_ms default None before trtllm#12249 (assumed)",
    dated="a main snapshot of early 2026, in no release read (T8)",
    summary="str frames, TASK_STATE; a listener exception ends the thread",
    facts=("T9", "T27", "T31", "T32", "T37", "T43", "T67"),
)
