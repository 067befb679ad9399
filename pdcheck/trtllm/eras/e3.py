"""E3, TensorRT-LLM 1.2.x: the C++ transceiver as read at 1.2.0rc2 (commit b35ac1b6, T3): the gen spins for the
ready signal and the completion notification with no bound, the ctx's WRITE wait spins, and one exception ends
the ctx's CacheSender thread (T61, T62). kv_transfer_timeout_ms still defaults to None (trtllm#12249 came later)."""

from msgspec.structs import replace

from pdcheck.trtllm.eras import e1

MODEL = replace(
    e1.MODEL, name="E3", era="E3", releases="1.2.x",
    timeout_source="kv_transfer_timeout_ms default None until trtllm#12249 (2026-03-18)",
    dated="1.2.0rc2 by tensorrt_llm/version.py@b35ac1b6 (T3); the C++ agent files read at that commit",
    summary="C++ as read at 1.2.0rc2: unbounded waits for the ready and completion notifications",
)
